"""The explorer's console tables (rich) and its picture (`--plot`, needs matplotlib)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from jaxseek.errors import UserError
from jaxseek.explore.memory import KINDS


def human(nbytes: float) -> str:
  for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(nbytes) >= size:
      return f"{nbytes / size:.2f} {unit}"
  return f"{int(nbytes)} B"


def seconds(s: float) -> str:
  return f"{s * 1e6:.1f} µs" if s < 1e-3 else f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


class _Table(Table):
  """A rich Table whose cells are plain text (a placement like w[E, D] is not a style tag)."""

  def add_row(self, *cells: str) -> None:
    super().add_row(*(escape(c) for c in cells))


def _table(title: str, *columns: str) -> Table:
  table = _Table(title=title, title_justify="left", header_style="bold")
  for column in columns:
    table.add_column(column, justify="right" if column.startswith(("bytes", "count", "time", "%")) else "left",
                     overflow="fold")
  return table


def console() -> Console:
  """A console at least 150 columns wide (rich would fold the tables into 80 when the output is a file)."""
  return Console(width=max(Console().width, 150))


def print_plan(result: dict[str, Any], out: Console | None = None) -> None:
  """Layout, memory, communication (and, with --compile, XLA's figures beside them)."""
  out = out or console()
  mesh = " × ".join(f"{a}={n}" for a, n in result["mesh"].items())
  out.print(f"[bold]{result['model']['model_type']}[/bold]: {result['total_parameters']:,} parameters "
                f"({result['mtp_parameters']:,} in multi-token prediction) | mesh {mesh} ({result['devices']} "
                f"devices) | pipeline: {result['pipeline']}")
  out.print(result["kernels"] if "compiled" not in result or "kernel_choice" not in result["compiled"]
            else result["compiled"]["kernel_choice"])
  if result.get("pipeline_schedules"):
    sched = _table("Table schedules on these stages (from the tables the step runs; kept: "
                   "train.pipeline_recompute=false, F keeps the forward's residuals, else b recomputes the forward)",
                   "schedule", "chunks x layers", "bubble", "at F=b=W=1", "ticks", "inputs", "cotangents",
                   "stashes", "residuals", "FLOP / stage")
    for r in result["pipeline_schedules"]:
      name = r["schedule"] + ("" if r.get("recompute", True) else " (kept)")
      sched.add_row(name, f"{r['chunks_per_stage']} x {r['layers_per_chunk']}", f"{100 * r['bubble']:.1f}%",
                    f"{100 * r['unit_bubble']:.1f}%", str(r["ticks"]), str(r["kept_inputs"]),
                    str(r["kept_cotangents"]), str(r["kept_stashes"]), str(r.get("kept_residuals", 0)),
                    f"{r.get('flops_per_stage', 0):.3g}")
    out.print(sched)
  table = _table("Parameters (layer stacks folded: L = layers)", "name", "shape", "dtype", "logical axes",
                 "placement", "bytes / device")
  for r in result["parameters"]:
    table.add_row(r["name"].replace(".blocks.", "."), _shape(r["shape"]), _dtype(r["dtype"]),
                  ",".join(str(n) for n in r["logical_axes"]), r["placement"], human(r["bytes_per_device"]))
  out.print(table)
  table = _table("Optimiser state", "slot", "stack", "arrays", "elements", "dtype", "placement", "bytes / device")
  for r in result["optimizer"]:
    table.add_row(r["slot"], str(r["stack"] or "-"), str(r["arrays"]), f"{r['elements']:,}", _dtype(r["dtype"]),
                  r["placement"], human(r["bytes_per_device"]))
  out.print(table)
  table = _table(f"Activations of one layer, per microbatch ({result['memory']['platform']} expert path)", "layer",
                 "name", "shape", "placement", "copies", "bytes / device")
  for r in result["activations"]:
    table.add_row(r["layer"], r["name"], _shape(r["shape"]), r["placement"], str(r["copies"]),
                  human(r["bytes_per_device"]))
  out.print(table)
  print_memory(result, out)
  print_communication(result, out)
  if "compiled" in result:
    print_compiled(result["compiled"], out)


def _shape(shape: list[int]) -> str:
  return "×".join(str(d) for d in shape) or "scalar"


def _dtype(name: str) -> str:
  return {"float32": "f32", "bfloat16": "bf16", "int32": "i32"}.get(name, name)


def print_memory(result: dict[str, Any], out: Console) -> None:
  mem, hw, where = result["memory_per_device"], result["hardware"], result["memory"]
  title = "Memory per device"
  if where["stages"] > 1:
    layers = where["layers_on_stage"]
    held = [f"{layers['dense_layers']} dense layers", f"{layers['moe_layers']} MoE layers",
            "the embedding, head and MTP"]
    title += f" (each of {where['stages']} pipeline stages: {', '.join(held)})"
  table = _table(title, "kind", "bytes", "% of device")
  host = result["train"].get("optimizer_memory") == "host"
  for kind in KINDS + ("total",):
    label = "optimizer (host; on the device for the update)" if kind == "optimizer" and host else kind
    table.add_row(label, human(mem[kind]), f"{100 * mem[kind] / hw['memory_bytes']:.1f}")
  out.print(table)
  verdict = "[green]fits[/green]" if where["fits"] else "[red]does not fit[/red]"
  out.print(f"{human(mem['total'])} of {human(hw['memory_bytes'])} ({hw['name']}, "
                f"{human(hw['usable_bytes'])} usable): {verdict}")


def print_communication(result: dict[str, Any], out: Console) -> None:
  table = _table("Communication per step", "axis", "collective", "what", "count", "bytes / device", "link", "time")
  for axis, items in result["communication"].items():
    for c in items:
      table.add_row(axis, c["collective"], c["what"], str(c["count"]), human(c["bytes_per_device"]), c["link"],
                    seconds(c["time_s"]))
  out.print(table)
  compute, hw = result["compute"], result["hardware"]
  summed = result.get("gradient_sums_once_per_step")
  if summed is not None:
    out.print(f"gradient sums once per step over: {', '.join(summed) or 'none'} (the other batch axes reduce per "
              f"microbatch)")
  g = result.get("gradient_compression")
  if g:
    out.print(compression_line(g))
  x = result.get("expert_dispatch")
  if x and x["shards"] > 1:
    out.print(expert_line(x))
  fp8 = (f" ({compute['fp8_flops_per_device']:.3g} of them train.fp8's GEMMs at the float8 peak, "
         f"{hw['fp8_tflops']:g} TFLOP/s; {seconds(compute['time_at_bf16_s'])} all at bfloat16)"
         if compute.get("fp8_flops_per_device") else "")
  out.print(f"compute {compute['flops_per_device']:.3g} FLOPs/device → {seconds(compute['time_s'])} at "
                f"{hw['peak_tflops']:g} TFLOP/s{fp8}; pipeline bubble {seconds(compute['bubble_s'])}{uneven_stages(compute)}; step: bound "
                f"{seconds(result['step_time_s'])} at peak rates (no overlap of compute and collectives)")
  if result.get("prediction"):
    out.print(prediction_line(result["prediction"]))


def uneven_stages(compute: dict[str, Any]) -> str:
  """Where a table schedule's stages do unequal work: the busiest one, whose ticks set the pace."""
  work = compute.get("stage_work_s")
  if not work or max(work) <= 1.02 * sum(work) / len(work):
    return ""
  busiest = max(range(len(work)), key=work.__getitem__)
  return (f", of it uneven stages: stage {busiest} works {max(work) / (sum(work) / len(work)):.2f}× the average "
          f"(the first and last virtual stages also run the embedding, the layers outside the pipelined stack, "
          f"the head and the loss)")


def prediction_line(p: dict[str, Any]) -> str:
  """The step predicted at achieved rates, with its parts."""
  names = (("compute", "compute_s"), ("memory-bound kernels", "memory_bound_s"), ("launches", "launch_s"),
           ("bubble", "bubble_s"), ("exposed expert exchange", "exposed_exchange_s"),
           ("exposed gradient reductions", "exposed_reductions_s"), ("other exposed collectives", "exposed_other_s"),
           ("optimiser", "optimizer_s"))
  parts = ", ".join(f"{name} {seconds(p[key])}" for name, key in names if p[key] > 0)
  return (f"step predicted at achieved rates ({p['rates']} rates, explore/rates/{p['rates']}.toml; overlap from the "
          f"{p['overlap']}): {seconds(p['step_s'])} = {parts}; {p['tokens_per_s_per_device']:,.0f} tokens/s per device")


def compression_line(g: dict[str, Any]) -> str:
  """Where train.grad_compression pays on this data size: each method's bytes per device per step."""
  name = lambda m: f"powersgd rank {g['powersgd_rank']}" if m == "powersgd" else m
  parts = [f"{name(m)} {human(b)} ({g['ratio_to_none'][m]:.2f}×)" for m, b in g["bytes_per_device"].items()]
  return f"data-axis gradient sum over data={g['data']}, per device per step: {' | '.join(parts)} " \
         f"(train.grad_compression={g['configured']})"


def expert_line(x: dict[str, Any]) -> str:
  """The expert dispatch in one paragraph: rows, where the copies go, what the shard limit bounds."""
  P, g = x["shards"], x["shards_per_node"]
  rows = (f"{x['rows_sent']:,} buffer rows out and back" if x["kind"] == "fixed"
          else f"{x['rows_sent']:,} token copies sent, {x['rows_received']:,} rows received")
  limit = x["max_expert_shards"]
  by = [f"model.moe_max_expert_shards={limit}"] * bool(limit) + ["group-limited routing"] * x.get("group_limited", 0)
  bound = (f"{' and '.join(by)}: a token reaches at most {x['shards_per_token_max']} shards on "
           f"{x['nodes_per_token_max']} nodes" if by else "no shard limit")
  if x["kind"] == "two_stage":
    crossing = (f"two stages: a token's row crosses to {x['inter_node_rows_per_token']:.2f} other nodes on average "
                f"under uniform routing (at most {x['inter_node_sends_per_token_one_per_node_max']}), where the one-stage "
                f"exchange sends {x['inter_node_copies_per_token']:.2f} of its copies across")
  else:
    crossing = (f"one stage, every copy sent: {x['inter_node_copies_per_token']:.2f} of a token's copies cross nodes "
                f"(a two-stage dispatch would send at most {x['inter_node_sends_per_token_one_per_node_max']} a token)")
  return (f"expert dispatch ({x['kind']}, {x['dispatch_dtype']} out): {rows} per MoE layer run; of the copies "
          f"{100 * x['share_on_device']:.1f}% stay on the device, {100 * x['share_intra_node']:.1f}% go to the "
          f"{g - 1} other shards of its node, {100 * x['share_inter_node']:.1f}% cross nodes ({x['nodes']} nodes of "
          f"{g} shards); {bound}; {crossing}; {human(x['bytes_total'])} per step ({human(x['bytes_inter_node'])} "
          f"across nodes) = {x['vs_ideal']:.2f} × the ideal of one stage ({human(x['ideal_bytes'])})")


def print_overlap(overlap: dict[str, Any], out: Console) -> None:
  table = _table("Collectives XLA overlaps with compute (ops weighted by loop trip counts)", "collective", "ops",
                 "async", "overlapped", "% bytes overlapped", "% every step", "% hidden (est.)",
                 "% hidden every step", "time (analytic, no overlap)")
  for kind, r in overlap["kinds"].items():
    table.add_row(kind, f"{r['ops']:g}", f"{r['async']:g}", f"{r['overlapped']:g}",
                  f"{100 * r['overlapped_share']:.0f}", f"{100 * r['always_overlapped_share']:.0f}",
                  f"{100 * r['hidden_share']:.0f}", f"{100 * r['always_hidden_share']:.0f}",
                  seconds(r["analytic_time_s"]))
  out.print(table)
  out.print(f"bound at peak rates: step {seconds(overlap['step_time_s'])} with no overlap; "
            f"{seconds(overlap['step_if_estimate_hidden_s'])} with what the kernels beside each collective hide "
            f"(their FLOPs at peak or bytes at memory bandwidth against the transfer's time), of what runs every "
            f"step; {seconds(overlap['step_if_overlap_hidden_s'])} if every overlapped "
            f"collective were hidden whole. The dropless exchange's further rounds (which run only under skew) "
            f"count in the ops as if always taken, not in what runs every step")


def matmul_line(m: dict[str, float]) -> str:
  share = lambda part, whole: f"{100 * m[part] / m[whole]:.1f}%" if m[whole] else "-"
  return (f"matmuls per step (loops weighted by trip counts, every branch and further exchange round counted as "
          f"run): {m['all']:.3g} FLOPs, {share('all_f8', 'all')} with "
          f"float8 operands; of the FP8 recipe's GEMMs (attention, MLP and expert projections, forward and both "
          f"gradients; not the head, router or attention scores) {m['recipe']:.3g} FLOPs, "
          f"{share('recipe_f8', 'recipe')} on float8")


def print_compiled(compiled: dict[str, Any], out: Console) -> None:
  where = f"for {compiled['devices']} × {compiled['device_kind']}, deviceless" if "target" in compiled else \
      "on simulated CPU devices"
  table = _table(f"Compiled train step (XLA {where}, per device) vs analytic", "figure", "bytes (XLA)",
                 "bytes (analytic)", "% difference")
  for name, xla, analytic in (("arguments (state + batch)", compiled["argument_bytes"],
                               compiled["predicted_argument_bytes"]),
                              ("temporaries", compiled["temp_bytes"], compiled["predicted_temp_bytes"])):
    table.add_row(name, human(xla), human(analytic), f"{100 * (analytic / xla - 1):+.1f}")
  out.print(table)
  if "target" in compiled:
    table = _table("Kernels in the compiled module (custom calls)", "custom call", "count")
    for name, count in sorted(compiled["custom_calls"].items()):
      table.add_row(name, str(count))
    out.print(table)
    out.print(f"XLA total (arguments + outputs − aliased + temporaries): {human(compiled['total_bytes'])} per device")
    if compiled.get("matmuls", {}).get("all"):
      out.print(matmul_line(compiled["matmuls"]))
    if "overlap" in compiled:
      print_overlap(compiled["overlap"], out)
  table = _table("Collectives in the compiled module (ops by mesh axes)", "collective", "axes", "count",
                 "analytic expects")
  expected = compiled["predicted_collectives"]
  for kind, by_axes in sorted(compiled["collectives"].items()):
    for axes, count in sorted(by_axes.items()):
      known = axes != "-" and all(a in expected.get(kind, []) for a in axes.split("+"))
      table.add_row(kind, axes, str(count), "yes" if known else "single-device group" if axes == "-" else "")
  out.print(table)


def print_suggestions(rows: list[dict[str, Any]], out: Console | None = None) -> None:
  out = out or console()
  if not rows:
    out.print("[red]no mesh of these devices fits[/red]")
    return
  table = _table("Layouts that fit, fastest first (predicted at achieved rates; the bound at peak beside it)", "#",
                 "mesh", "microbatches", "remat", "bytes / device", "time / step predicted", "time / step bound",
                 "why it loses to #1")
  for r in rows:
    mesh = " ".join(f"{a}={n}" for a, n in r["mesh"].items() if n > 1) or "one device"
    mesh += " (tensor ranks as expert shards)" if r.get("moe_tensor") == "experts" else ""
    table.add_row(str(r["rank"]), mesh, str(r["microbatches"]), r["remat"], human(r["memory_bytes"]),
                  seconds(r["predicted_step_s"]), seconds(r["step_time_s"]), r["why_not_first"])
  out.print(table)
  out.print("overrides of #1: " + " ".join(rows[0]["overrides"]))


def require_matplotlib() -> None:
  if importlib.util.find_spec("matplotlib") is None:
    raise UserError("--plot needs matplotlib, which is not installed; pip install matplotlib, or drop --plot")


def plot(result: dict[str, Any], path: str | Path) -> None:
  """A PNG: the memory per device by kind against the device, and how one parameter of each kind is split."""
  require_matplotlib()
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  examples = _examples(result["parameters"])
  fig, axes = plt.subplots(1, 1 + len(examples), figsize=(4 + 3 * len(examples), 4.5), squeeze=False)
  ax = axes[0][0]
  mem, limit = result["memory_per_device"], result["hardware"]["memory_bytes"]
  bottom = 0.0
  for kind in KINDS:
    ax.bar([0], [mem[kind] / 2**30], bottom=bottom, label=kind)
    bottom += mem[kind] / 2**30
  ax.axhline(limit / 2**30, color="black", linestyle="--", label=result["hardware"]["name"])
  ax.set_xticks([])
  ax.set_ylabel("GiB per device")
  ax.legend(fontsize=7, loc="upper left")
  ax.set_title("memory per device")
  for ax, row in zip(axes[0][1:], examples):
    _draw_parameter(ax, row, result["mesh"])
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


KINDS_SHOWN = (("embedding", lambda r: r["name"].startswith("embed.")),
               ("attention", lambda r: ".attn.w_" in r["name"]),
               ("MLP", lambda r: ".mlp.w_" in r["name"] and "experts" not in r["logical_axes"]),
               ("experts", lambda r: "experts" in r["logical_axes"]))


def _examples(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The first parameter of each kind: embedding, attention, MLP, experts (those the model has)."""
  return [next(r for r in rows if test(r)) for _, test in KINDS_SHOWN if any(test(r) for r in rows)]


def _draw_parameter(ax, row: dict[str, Any], mesh: dict[str, int]) -> None:
  """The parameter's two most divided dimensions as a grid of tiles, one tile per device's piece."""
  shards = [math.prod(mesh[a] for a in axes) for axes in row["mesh_axes"]]
  if row["logical_axes"][0] == "layers":
    shards[0] = row["stages"]  # the stack's layers split over the pipeline stages that hold it
  order = sorted(range(len(shards)), key=lambda k: (-shards[k], -row["shape"][k]))[:2]
  i, j = sorted(order) if len(order) == 2 else (order[0], order[0])
  rows, cols = shards[i], shards[j] if j != i else 1
  for r in range(rows):
    for c in range(cols):
      ax.add_patch(_tile(c / cols, 1 - (r + 1) / rows, 1 / cols, 1 / rows, (r * cols + c) % 10))
  ax.set_xlim(0, 1)
  ax.set_ylim(0, 1)
  ax.set_xticks([])
  ax.set_yticks([])
  rest = math.prod(shards) // (rows * cols)
  more = f"\neach tile split {rest} ways more on its other dims" if rest > 1 else ""
  ax.set_title(f"{row['name']}\n{row['placement']}{more}", fontsize=7)
  ax.set_xlabel(f"dim {j}: {row['shape'][j]} in {cols} pieces", fontsize=8)
  ax.set_ylabel(f"dim {i}: {row['shape'][i]} in {rows} pieces", fontsize=8)


def _tile(x: float, y: float, w: float, h: float, color: int):
  from matplotlib.patches import Rectangle

  return Rectangle((x, y), w, h, facecolor=f"C{color}", edgecolor="white", alpha=0.8)
