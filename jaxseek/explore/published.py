"""The explorer's predictions against published training runs: `python -m jaxseek.explore.published`.

Each run of `published.toml` (hardware, layout, batch, the published throughput, with its source) is laid out as
jaxseek would run it, on the nearest settings jaxseek has (`settings`: what differs is printed beside it), and
the prediction at achieved rates (explore/predict.py) is set against the published step time. The rates come
from kernel and link microbenchmarks only (explore/rates/*.toml); these runs check the model, they never set it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from jaxseek.errors import UserError, cli

# The bounds a prediction must meet against a published run (docs/explore.md, tests/test_published.py)
BOUNDS = (0.75, 1.33)
RECIPES = {"fp8-blockwise": "rowwise", "fp8-tensorwise": "tensorwise", "mxfp8": "mxfp8", "bf16": "false"}
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEVICES = {"h100": "h100-80g", "h800": "h800-80g", "h200": "h200-141g", "b200": "b200-180g", "a100": "a100-80g"}


@functools.cache
def runs() -> tuple[dict[str, Any], ...]:
  """The published runs jaxseek has rates for (GB200 and others without a rates file are left out)."""
  text = resources.files("jaxseek.explore").joinpath("published.toml").read_text()
  return tuple(r for r in tomllib.loads(text)["run"] if r["hardware"] in DEVICES)


def published_step(run: dict[str, Any]) -> float:
  """The run's step time in seconds, from its step time or its tokens per second per GPU."""
  if run.get("step_s"):
    return float(run["step_s"])
  rate = run.get("tokens_per_s_per_gpu") or run["derived_tokens_per_s_per_gpu"]
  return run["global_batch"] * run["seq_len"] / (rate * run["gpus"])


def settings(run: dict[str, Any]) -> tuple[str, list[str], list[str]]:
  """(config file, overrides, what differs from the published run) for jaxseek's nearest layout of `run`."""
  tp, pp, vp, ep, cp = run["tp"], run["pp"], run.get("vp", 1), run.get("ep", 1), run.get("cp", 1)
  # Megatron's expert tensor parallel size 1 with tp > 1: its tp ranks are expert ranks too, as jaxseek's
  # model.moe_tensor=experts makes them (the expert axis then holds ep / tp of the ep expert shards)
  whole = run["model"] == "deepseek-v3" and tp > 1 and run.get("etp", tp) == 1 and ep % tp == 0
  expert = ep // tp if whole else ep
  data = run["gpus"] // (tp * pp * expert * cp)
  differs = []
  batch = run["global_batch"]
  split = data * expert * cp
  micro = batch // (split * run["micro_batch"]) if run.get("micro_batch") else 60
  over = [f"mesh.pipeline={pp}", f"mesh.tensor={tp}", f"mesh.expert={expert}", f"mesh.context={cp}",
          f"mesh.data={data}", "mesh.fsdp=1", f"train.batch_size={batch}", f"train.seq_len={run['seq_len']}",
          "mesh.allow_cross_host=true", "train.compute_dtype=bfloat16", f"train.fp8={RECIPES[run['precision']]}"]
  if whole:
    over.append("model.moe_tensor=experts")
  if run["precision"] == "fp8-blockwise":
    differs.append("FP8 rowwise (jaxseek's blockwise is emulated: no FP8 GEMM on Hopper takes 128-element scales)")
  if tp > 1:
    over.append("mesh.sequence_parallel=true")  # Megatron runs tensor parallelism with sequence parallelism
  if pp > 1:
    over.append(f"train.microbatches={micro}")
    if run["model"] == "deepseek-v3" and "DualPipe" in run.get("notes", ""):
      # DualPipe's V of two chunks a stage, keeping the forward's residuals (V3 recomputes norms and up-projections
      # only); jaxseek does not run a chunk's forward beside another's backward on this schedule
      over += ["train.pipeline_schedule=dualpipev", "train.pipeline_repeats=2", "train.pipeline_recompute=false"]
      differs.append("DualPipeV without DualPipe's forward-backward overlap: the exchange runs beside no compute")
    elif vp > 1:
      over += ["train.pipeline_schedule=interleaved_1f1b", f"train.pipeline_repeats={vp}"]
    else:
      over.append("train.pipeline_schedule=1f1b")
    if run["model"] != "deepseek-v3":  # Megatron keeps the forward's activations for the backward
      over.append("train.pipeline_recompute=false")
    if not run.get("micro_batch"):
      differs.append(f"{micro} microbatches (not published)")
  elif run.get("micro_batch"):
    over.append(f"train.microbatches={max(batch // (split * run['micro_batch']), 1)}")
  if run["model"] == "deepseek-v3":
    # both recompute only parts of a layer (V3: norms and MLA up-projections; Megatron: those and the MLP), as
    # train.remat=minimal does (MLA's latents and the attention output kept, the rest recomputed)
    over += ["model.moe_capacity_factor=null", "model.moe_dispatch_dtype=float8_e4m3fn", "optim.moments_dtype=bfloat16",
             "train.remat=minimal"]
    return str(CONFIGS / "deepseek-v3-671b.yaml"), over, differs
  a = run["arch"]
  over += [f"model.num_hidden_layers={a['layers']}", f"model.hidden_size={a['hidden']}",
           f"model.intermediate_size={a['intermediate']}", f"model.num_attention_heads={a['heads']}",
           f"model.num_key_value_heads={a['kv_heads']}", f"model.vocab_size={a['vocab']}",
           f"model.max_position_embeddings={max(run['seq_len'], 4096)}", "train.remat=none"]
  if run.get("dp", 1) > 1 and tp == 1 and pp == 1:  # sharded data parallelism (FSDP) over the node
    over = [o for o in over if not o.startswith(("mesh.data=", "mesh.fsdp="))] + ["mesh.data=1",
                                                                                  f"mesh.fsdp={data}"]
  differs.append(f"{run['model']} as a DeepSeek LLM (dense, grouped-query attention) of its sizes")
  return str(CONFIGS / "deepseek-llm-67b.yaml"), over, differs


# Megatron's MoE runs overlap the expert all-to-all with 1F1B and recompute only parts of a layer; jaxseek has one
# or the other: paired ticks (a forward beside a backward that recomputes its chunk, exchange included), or 1F1B
# keeping the forward's residuals (nothing run twice, nothing paired). `check` plans both and keeps the one the
# explorer predicts faster among those that fit, as a user of the explorer would.
PAIRED = (["train.pipeline_overlap=true"], "Megatron's 1F1B all-to-all overlap as jaxseek's paired ticks (a forward "
          "beside a backward), b recomputing the chunk's forward, exchange included (Megatron recomputes the MLA "
          "up-projections and the MLP)")
KEPT = (["train.pipeline_recompute=false"], "1F1B keeping the forward's residuals (nothing recomputed, as Megatron's), "
        "the exchange beside no compute (Megatron overlaps its all-to-all with 1F1B)")


def variants(run: dict[str, Any], over: list[str]) -> list[tuple[list[str], str]]:
  """jaxseek's choices for what the published layout leaves open: (extra overrides, what differs), one or more."""
  table = any(o.startswith("train.pipeline_schedule=") and "dualpipev" not in o for o in over)
  return [PAIRED, KEPT] if run["model"] == "deepseek-v3" and table else [([], "")]


def check(run: dict[str, Any]) -> dict[str, Any]:
  """The explorer's plan of `run` on jaxseek's nearest layout (of `variants`, the one predicted faster among those
  that fit), its prediction and the ratio to the published step."""
  from jaxseek import config as config_lib
  from jaxseek.explore import core

  path, over, differs = settings(run)
  model, plans = core.describe(config_lib.load(path, over)), []
  for extra, why in variants(run, over):  # schedule settings: the same arrays, so one description serves
    cfg = config_lib.load(path, over + extra)
    sizes = core.mesh_sizes(cfg, run["gpus"])
    plan = core.plan(dataclasses.replace(model, cfg=cfg), sizes, core.hardware(DEVICES[run["hardware"]]))
    plans.append((not plan["memory"]["fits"], plan["prediction"]["step_s"], plan, extra, why))
  _, _, plan, extra, why = min(plans, key=lambda p: p[:2])
  over, differs = over + extra, differs + ([why] if why else [])
  published = published_step(run)
  p = plan["prediction"]
  return {"name": run["name"], "hardware": run["hardware"], "gpus": run["gpus"], "published_s": published,
          "predicted_s": p["step_s"], "bound_s": plan["step_time_s"], "ratio": p["step_s"] / published,
          "prediction": p, "overrides": over, "differs": differs, "source": run["source"],
          "forced_balance": run.get("forced_balance", False), "fits": plan["memory"]["fits"]}


def table(results: list[dict[str, Any]]) -> str:
  lo, hi = BOUNDS
  lines = ["| run | GPUs | published step | bound at peak | predicted | predicted / published | routing |",
           "|---|---|---|---|---|---|---|"]
  for r in results:
    mark = "" if lo <= r["ratio"] <= hi else " (outside)"
    lines.append(f"| {r['name']} | {r['gpus']} {r['hardware'].upper()} | {r['published_s']:.2f} s | "
                 f"{r['bound_s']:.2f} s | {r['predicted_s']:.2f} s | {r['ratio']:.2f}{mark} | "
                 f"{'forced balance' if r['forced_balance'] else 'real'} |")
  return "\n".join(lines)


@cli
def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--run", action="append", help="only the runs whose name contains this (repeatable)")
  parser.add_argument("--parts", action="store_true", help="print each prediction's parts")
  args = parser.parse_args(argv)
  chosen = [r for r in runs() if not args.run or any(k in r["name"] for k in args.run)]
  if not chosen:
    raise UserError(f"--run {args.run}: no published run matches; known: {', '.join(r['name'] for r in runs())}")
  results = [check(r) for r in chosen]
  print(table(results))
  for r in results:
    print(f"\n{r['name']}: {r['source']}\n  jaxseek: {' '.join(r['overrides'])}")
    for d in r["differs"]:
      print(f"  differs: {d}")
    if args.parts:
      print("  " + ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in r["prediction"].items()
                             if k.endswith("_s") and k != "step_s"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
