"""Loss curves of the train.fp8 recipes against bfloat16 on real text, over several seeds, beside bfloat16's own
noise floor.

  python benchmarks/fp8_curves.py --steps 300 --seeds 0 1 2 3 4 5 \
      --recipes false rowwise tensorwise mxfp8 blockwise --plot docs/fp8_curves.png

Each run is `python -m jaxseek.train` of configs/tiny-v3.yaml (a tiny DeepSeek-V3: MLA, MoE with a shared expert)
in bfloat16 on byte-level python-stdlib text over 8 simulated CPU devices (data = 8), the same data and seed for
every recipe; false is the bfloat16 baseline. On CPU each recipe's GEMMs multiply the e4m3 values XLA:CPU
upcasts, so the losses are the recipe's numerics (not its speed).

The noise floor is bfloat16 again with only the summation order changed (`--floor`, by default the same 8 devices
as data 4 × fsdp 2, which equals data 8 to rounding): how far a rounding-sized perturbation alone moves a run of
this model. A recipe is told apart from bfloat16 only where it moves the loss further than that.

Printed per variant: the final loss (the mean of the last 20 steps) averaged over the seeds, the mean of the
per-seed (paired) relative differences from bfloat16 with its 95% interval (Student's t over the seeds) and the
mean absolute difference; DeepSeek-V3's bound is 0.25%. Results go to benchmarks/results.jsonl (bench
"fp8_curves"); --from re-reports saved results; --plot draws the curves (needs matplotlib).
"""

from __future__ import annotations

import argparse
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import common
from compression_curves import TAIL, curve, draw
from jaxseek.metrics import read_jsonl

FP8_BASE = ["--config", str(common.ROOT / "configs/tiny-v3-256.yaml"), "checkpoint.every=0", "metrics.every=1"]
FLOOR = "floor"  # the bfloat16 run with another summation order
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # Student's t, 97.5%


def paired(finals: np.ndarray, base: np.ndarray) -> tuple[float, float, float]:
  """Mean relative difference of paired runs, its 95% half-interval over the seeds, mean absolute difference."""
  rel = finals / base - 1
  half = T95.get(len(rel) - 1, 1.96) * rel.std(ddof=1) / np.sqrt(len(rel)) if len(rel) > 1 else float("nan")
  return float(rel.mean()), float(half), float(np.abs(rel).mean())


def report(curves: dict[str, list[np.ndarray]], seeds: list[int]) -> None:
  finals = {r: np.array([c[-TAIL:].mean() for c in runs]) for r, runs in curves.items()}
  base = finals.get("false")
  print(f"{'train.fp8':<12} {'final':>8} {'vs bf16 (95%)':>18} {'mean |diff|':>12}  per seed ({len(seeds)} seeds)")
  for recipe, f in finals.items():
    if base is None:
      print(f"{recipe:<12} {f.mean():>8.4f}")
      continue
    mean, half, absolute = paired(f, base)
    seeds_text = ", ".join(f"{x:.4f} ({x / b - 1:+.2%})" for x, b in zip(f, base))
    print(f"{recipe:<12} {f.mean():>8.4f} {mean:>+9.2%} ± {half:>5.2%} {absolute:>12.2%}  {seeds_text}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--recipes", nargs="+", default=["false", "rowwise", "tensorwise", "mxfp8", "blockwise"])
  parser.add_argument("--jobs", type=int, default=2, help="runs at once")
  parser.add_argument("--floor", nargs="*", default=["train.microbatches=2"], metavar="KEY=VALUE",
                      help="overrides of the noise-floor run (bfloat16, another summation order); none: no floor")
  parser.add_argument("--run-dir", default=None, help="keep each run's directory here (default: deleted)")
  parser.add_argument("--plot", default=None)
  parser.add_argument("--results", default=None)
  parser.add_argument("--from", dest="saved", nargs="+", default=None, metavar="RESULTS_JSONL")
  parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
  args = parser.parse_args()
  curves: dict[str, list[np.ndarray]] = {}
  if args.saved:
    for path in args.saved:
      for r in read_jsonl(Path(path)):
        if r.get("bench") == "fp8_curves":
          curves[r["recipe"]] = [np.array(c) for c in r["losses"]]
          args.seeds = r["seeds"]
  else:
    variants = [(r, r, []) for r in args.recipes] + ([(FLOOR, "false", args.floor)] if args.floor else [])
    runs = [(v, seed) for v in variants for seed in args.seeds]
    with tempfile.TemporaryDirectory() as scratch:
      tmp = args.run_dir or scratch

      def one(run):
        (name, recipe, extra), seed = run
        got = curve(args.steps, seed, recipe, [*args.overrides, *extra], Path(tmp) / f"{name}-{seed}",
                    key="train.fp8", base=FP8_BASE, warmup=0.1)
        print(f"{name} seed {seed}: final (last {TAIL} mean) {got[-TAIL:].mean():.4f}", flush=True)
        return got

      with ThreadPoolExecutor(args.jobs) as pool:
        for ((name, _, _), _), got in zip(runs, pool.map(one, runs)):
          curves.setdefault(name, []).append(got)
      for name, _, extra in variants:
        common.append_result(args.results or common.RESULTS, dict(
            bench="fp8_curves", steps=args.steps, seeds=args.seeds, recipe=name,
            overrides=[*args.overrides, *extra], final_last20=[float(c[-TAIL:].mean()) for c in curves[name]],
            losses=[c.tolist() for c in curves[name]]))
  report(curves, args.seeds)
  if args.plot:
    named = {({"false": "bfloat16", FLOOR: "bfloat16, 2 microbatches"}.get(r, r)): c for r, c in curves.items()}
    draw(named, Path(args.plot), title="tiny-v3-256 on python-stdlib, bfloat16: train.fp8 recipes, one line per seed")
    print(f"plot: {args.plot}")


if __name__ == "__main__":
  main()
