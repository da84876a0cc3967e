"""Loss curves of the train.fp8 recipes against bfloat16 on real text, over several seeds.

  python benchmarks/fp8_curves.py --steps 300 --seeds 0 1 2 --recipes false rowwise tensorwise mxfp8 blockwise \
      --plot docs/fp8_curves.png

Each run is `python -m jaxseek.train` of configs/tiny-v3.yaml (a tiny DeepSeek-V3: MLA, MoE with a shared expert)
in bfloat16 on byte-level python-stdlib text over 8 simulated CPU devices (data = 8), the same data and seed for
every recipe; false is the bfloat16 baseline. On CPU each recipe's GEMMs multiply the e4m3 values XLA:CPU
upcasts, so the losses are the recipe's numerics (not its speed). Printed per recipe: the final loss (the mean of
the last 20 steps) averaged over the seeds and its difference from bfloat16's, with each seed's; DeepSeek-V3's
bound is 0.25%. Results go to benchmarks/results.jsonl (bench "fp8_curves"); --plot draws the curves (needs
matplotlib).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import common
from compression_curves import BASE, TAIL, curve, draw

FP8_BASE = [*BASE, "train.compute_dtype=bfloat16"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--recipes", nargs="+", default=["false", "rowwise", "tensorwise", "mxfp8", "blockwise"])
  parser.add_argument("--plot", default=None)
  parser.add_argument("--results", default=None)
  parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
  args = parser.parse_args()
  curves: dict[str, list[np.ndarray]] = {}
  with tempfile.TemporaryDirectory() as tmp:
    for recipe in args.recipes:
      for seed in args.seeds:
        got = curve(args.steps, seed, recipe, args.overrides, Path(tmp) / f"{recipe}-{seed}", key="train.fp8",
                    base=FP8_BASE)
        curves.setdefault(recipe, []).append(got)
        print(f"{recipe} seed {seed}: final (last {TAIL} mean) {got[-TAIL:].mean():.4f}", flush=True)
  finals = {r: np.array([c[-TAIL:].mean() for c in runs]) for r, runs in curves.items()}
  base = finals.get("false")
  print(f"{'train.fp8':<12} {'final':>8} {'vs bf16':>8}  per seed")
  for recipe, f in finals.items():
    rel = f.mean() / base.mean() - 1 if base is not None else float("nan")
    seeds = ", ".join(f"{x:.4f} ({x / b - 1:+.3%})" for x, b in zip(f, base if base is not None else f))
    print(f"{recipe:<12} {f.mean():>8.4f} {rel:>+8.3%}  {seeds}")
    common.append_result(args.results or common.RESULTS, dict(
        bench="fp8_curves", steps=args.steps, seeds=args.seeds, recipe=recipe, overrides=args.overrides,
        final_last20=f.tolist(), final_mean=float(f.mean()), rel_to_bf16=float(rel),
        losses=[c.tolist() for c in curves[recipe]]))
  if args.plot:
    named = {("bfloat16" if r == "false" else r): c for r, c in curves.items()}
    draw(named, Path(args.plot), title="tiny-v3 on python-stdlib, bfloat16: train.fp8 recipes, one line per seed")
    print(f"plot: {args.plot}")


if __name__ == "__main__":
  main()
