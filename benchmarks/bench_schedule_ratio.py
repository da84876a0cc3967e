"""A zero-bubble schedule's step time against 1F1B's, side by side, with the compiled FLOPs both execute.

  python benchmarks/bench_schedule_ratio.py [--schedules 1f1b zbv] [--pairs 30] [--rounds 3] [--bound 1.15]
                                            [--devices 4] [--config configs/tiny-dense.yaml] [KEY=VALUE ...]

Default: tiny-dense with 8 layers on 4 simulated CPU devices (mesh pipeline=4, data=1), 16 microbatches of 4
sequences of 32 tokens. Both steps are compiled in one process and timed in alternating pairs (which one runs
first alternates too), so a machine that other work slows slows both alike; `rounds` groups of `pairs` pairs.
Printed per schedule: the table's ticks and bubble, the ppermutes a step runs (Table.routes), process CPU time
and wall time per step; then the median over pairs of the wall-time ratio (the figure --bound applies to: exit
status 1 above it), the ratio of the medians, of the minima and of the CPU times.

FLOPs: `compiled.cost_analysis()` counts a while loop's body once and a conditional's costliest branch, so for a
table schedule it gives one tick that runs everything. `executed_flops` reads the compiled HLO instead: each dot
(2 · its output's size · its contracted size) inside the loop over ticks is weighed by how often the table runs
the op whose named scope holds it (pipeline_forward, pipeline_backward, pipeline_weights, and the loss after the
last virtual stage; virtual stage 0's branch apart) and by the trip counts of the loops inside the op; outside
that loop by the device count. Summed over devices: the work of a step, the bubble left out. 1F1B and ZB-V on the
same model must come out equal but for what their backward recomputes.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import time

import jax
import numpy as np

DEFAULTS = ("model.num_hidden_layers=8", "mesh.data=1", "train.microbatches=16", "train.batch_size=64",
            "train.seq_len=32", "train.steps=1000")
REPEATS = {"zbv": 2, "dualpipev": 2, "interleaved_1f1b": 2}  # chunks a stage; 1 for the others

_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
_DEFINES = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = \w+\[([\d,]*)\]")
_DOT = re.compile(r" dot\(%?([\w.\-]+), %?([\w.\-]+)\)")
_CALLEES = re.compile(r"(?:calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'known_trip_count":\{"n":"(\d+)"')


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
  """The HLO module's computations (name → instruction lines) and the entry's name."""
  comps, current, entry = {}, None, None
  for line in text.splitlines():
    m = _COMPUTATION.match(line)
    if m and not line.startswith(" "):
      current = m.group(2)
      comps[current] = []
      entry = current if m.group(1) else entry
    elif current and line.startswith(" "):
      comps[current].append(line)
  return comps, entry


def _dot_flops(line: str, shapes: dict[str, list[int]]) -> int:
  out = [int(d) for d in _DEFINES.match(line).group(2).split(",") if d]
  lhs = shapes[_DOT.search(line).group(1)]
  contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line).group(1)
  return 2 * int(np.prod(out)) * int(np.prod([lhs[int(i)] for i in contracted.split(",") if i]))


def _op(op_name: str) -> str:
  """The table op a dot inside the tick loop belongs to, from its named scope: f, b, w (first: on virtual stage
  0, the branch that also runs the model before the stack), else the loss after the last virtual stage."""
  tick = op_name.split("/while/body/", 1)[-1]
  for scope, op in (("pipeline_weights", "w"), ("pipeline_backward", "b"), ("pipeline_forward", "f")):
    if scope in tick:
      return op + ("_first" if tick.split(scope, 1)[1].startswith("/cond/branch_1_fun") else "")
  return "loss"


def dot_flops_per_run(hlo: str, ticks: int) -> dict[str, int]:
  """Dot FLOPs of one run of each table op (the loops inside it weighed by their trip counts), and "outside" for
  one device's run of everything outside the loop over `ticks` ticks."""
  comps, entry = _computations(hlo)
  flops = collections.Counter()

  def visit(name: str, weight: int, in_tick: bool) -> None:
    lines = comps[name]
    shapes = {m.group(1): [int(d) for d in m.group(2).split(",") if d] for m in map(_DEFINES.match, lines) if m}
    for line in lines:
      if _DOT.search(line):
        op_name = re.search(r'op_name="([^"]*)"', line)
        flops[_op(op_name.group(1) if op_name else "") if in_tick else "outside"] += weight * _dot_flops(line, shapes)
      if " while(" in line:
        trips = _TRIPS.search(line)
        n = int(trips.group(1)) if trips else 1
        body = re.search(r"body=%?([\w.\-]+)", line).group(1)
        if not in_tick and n == ticks:  # the loop over ticks: its ops weighed by the table instead
          visit(body, weight, True)
        else:
          visit(body, weight * n, in_tick)
        continue
      callees = _CALLEES.findall(line)
      branches = _BRANCHES.search(line)
      callees += re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else []
      for callee in callees:
        if callee in comps:
          visit(callee, weight, in_tick)

  visit(entry, 1, False)
  return dict(flops)


def op_runs(table) -> dict[str, int]:
  """How many times a step runs each table op, summed over the stages (virtual stage 0's apart)."""
  s = np.arange(table.stages)[None, :]
  runs = {}
  for op in ("f", "b"):
    ran = table.steps[f"{op}_micro"] >= 0
    first = ran & (table.virtual[s, np.maximum(table.steps[f"{op}_chunk"], 0)] == 0)
    runs[op], runs[op + "_first"] = int((ran & ~first).sum()), int(first.sum())
  runs["w"] = int((table.steps["w_micro"] >= 0).sum()) if table.split else 0
  runs["loss"] = int((table.steps["loss_grad"] >= 0).sum())
  return runs


def executed_flops(hlo: str, table, devices: int) -> dict[str, int]:
  """Dot FLOPs a step executes over all devices, per table op and outside the schedule."""
  per_run, runs = dot_flops_per_run(hlo, table.ticks), {**op_runs(table), "outside": devices}
  unknown = set(per_run) - set(runs)
  if unknown:
    raise ValueError(f"dots in scopes the table does not count: {sorted(unknown)}")
  return {op: per_run.get(op, 0) * n for op, n in runs.items()}


def compile_schedule(name: str, args: argparse.Namespace) -> dict:
  """The compiled train step of schedule `name` with its state, batch, table and executed FLOPs."""
  import common
  from jaxseek import step as step_lib
  from jaxseek.input import global_batches
  from jaxseek.pipeline import stages, tables
  from jaxseek.sharding.mesh import make_mesh

  S, repeats = args.devices, REPEATS.get(name, 1)
  cfg = common.config_lib.load(common.ROOT / args.config, [
      *DEFAULTS, f"mesh.pipeline={S}", f"train.pipeline_schedule={name}", f"train.pipeline_repeats={repeats}",
      *args.overrides])
  mesh = make_mesh(cfg, jax.devices()[:S])
  trainer, state = step_lib.init_state(cfg, mesh)
  batch = next(global_batches(cfg, mesh))
  n_layers = stages.stack_sizes(cfg.model)[stages.pipelined_stack(cfg.model, S, repeats)]
  table = tables.for_config(cfg, S, stages.stack_repeats(n_layers, S, repeats))
  with jax.set_mesh(mesh):
    compiled = step_lib.compile_step(trainer, cfg, mesh).lower(state, batch).compile()
  return dict(mesh=mesh, compiled=compiled, state=state, batch=batch, table=table, wall=[], cpu=[],
              flops=executed_flops(compiled.as_text(), table, S), cost_flops=compiled.cost_analysis()["flops"],
              permutes=sum(int(r.active.sum()) for r in table.routes() if r.offset))


def step(run: dict) -> float:
  """One train step of `run`; its wall and process CPU time are appended to run["wall"] and run["cpu"]."""
  with jax.set_mesh(run["mesh"]):
    wall, cpu = time.perf_counter(), time.process_time()
    run["state"], metrics = run["compiled"](run["state"], run["batch"])
    float(metrics["loss"])
    run["wall"].append(time.perf_counter() - wall)
    run["cpu"].append(time.process_time() - cpu)
  return run["wall"][-1]


def time_pairs(ref: dict, timed: dict, pairs: int, rounds: int) -> tuple[list[float], list[float]]:
  """Per pair of steps (the first of a pair alternating), timed's wall time over ref's; and each round's median."""
  for run in (ref, timed):  # warm-up
    step(run), step(run)
    run["wall"].clear(), run["cpu"].clear()
  ratios, round_medians = [], []
  for _ in range(rounds):
    got = []
    for i in range(pairs):
      first, second = (ref, timed) if i % 2 == 0 else (timed, ref)
      a, b = step(first), step(second)
      got.append(a / b if first is timed else b / a)
    ratios += got
    round_medians.append(statistics.median(got))
  return ratios, round_medians


def report(runs: dict, ref: str, timed: str, ratios: list[float], round_medians: list[float]) -> dict:
  """Prints the table and the ratios; returns the figures for results.jsonl."""
  print(f"{'schedule':>10} {'ticks':>5} {'bubble':>7} {'ppermutes':>9} {'wall ms':>8} {'min ms':>7} {'cpu ms':>7} "
        f"{'executed GFLOP':>14} {'(f, b, w, loss, outside)':>34} {'cost_analysis':>13}")
  for name, r in runs.items():
    f = r["flops"]
    parts = [f["f"] + f["f_first"], f["b"] + f["b_first"], f["w"], f["loss"], f["outside"]]
    print(f"{name:>10} {r['table'].ticks:>5} {100 * r['table'].bubble():>6.1f}% {r['permutes']:>9} "
          f"{1e3 * statistics.median(r['wall']):>8.1f} {1e3 * min(r['wall']):>7.1f} "
          f"{1e3 * statistics.median(r['cpu']):>7.1f} {sum(f.values()) / 1e9:>14.3f} "
          f"{', '.join(f'{p / 1e9:.3f}' for p in parts):>34} {r['cost_flops'] / 1e9:>13.4f}")
  med = lambda name, key: statistics.median(runs[name][key])
  got = dict(pair_ratio=statistics.median(ratios), round_ratios=round_medians,
             median_ratio=med(timed, "wall") / med(ref, "wall"),
             min_ratio=min(runs[timed]["wall"]) / min(runs[ref]["wall"]), cpu_ratio=med(timed, "cpu") / med(ref, "cpu"),
             flop_ratio=sum(runs[timed]["flops"].values()) / sum(runs[ref]["flops"].values()))
  print(f"{timed}/{ref}: median pair ratio {got['pair_ratio']:.3f} (rounds "
        f"{', '.join(f'{m:.3f}' for m in round_medians)}), ratio of medians {got['median_ratio']:.3f}, of minima "
        f"{got['min_ratio']:.3f}, CPU time {got['cpu_ratio']:.3f}; executed FLOPs {got['flop_ratio']:.3f}")
  return {**got, **{f"{name}_{k}": v for name, r in runs.items() for k, v in (
      ("step_s", med(name, "wall")), ("cpu_s", med(name, "cpu")), ("flops", sum(r["flops"].values())),
      ("ppermutes", r["permutes"]))}}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("overrides", nargs="*", help="config KEY=VALUE, after the defaults")
  parser.add_argument("--config", default="configs/tiny-dense.yaml")
  parser.add_argument("--schedules", nargs=2, default=["1f1b", "zbv"], help="the reference, then the one timed")
  parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices = pipeline stages")
  parser.add_argument("--pairs", type=int, default=30)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--bound", type=float, default=1.15, help="exit 1 when the median pair ratio exceeds it")
  parser.add_argument("--results", default=None)
  args = parser.parse_args()
  import common
  from jaxseek.sharding.mesh import simulate_cpu_devices

  simulate_cpu_devices(args.devices)  # as python -m jaxseek.train starts the simulated devices

  ref, timed = args.schedules
  runs = {name: compile_schedule(name, args) for name in args.schedules}
  ratios, round_medians = time_pairs(runs[ref], runs[timed], args.pairs, args.rounds)
  print(f"{args.config} {' '.join([*DEFAULTS, *args.overrides])}, pipeline {args.devices}, "
        f"{len(ratios)} pairs of steps")
  got = report(runs, ref, timed, ratios, round_medians)
  common.append_result(args.results or common.RESULTS, dict(
      bench="schedule_ratio", config=args.config, overrides=[*DEFAULTS, *args.overrides], stages=args.devices,
      schedules=args.schedules, bound=args.bound, **got))
  if got["pair_ratio"] > args.bound:
    print(f"FAIL: {timed}'s step takes {got['pair_ratio']:.3f}x {ref}'s, above the bound {args.bound}")
    return 1
  print(f"ok: {got['pair_ratio']:.3f} <= {args.bound}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
