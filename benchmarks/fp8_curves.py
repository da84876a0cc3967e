"""Loss curves of the train.fp8 recipes against bfloat16, paired over seeds, beside neutral rows that change
nothing but rounding: what this benchmark can tell apart.

  python benchmarks/fp8_curves.py --steps 100 --seeds 0 1 2 3 4 5 6 7 --jobs 2 --plot docs/fp8_curves.png \
      train.batch_size=16

Each run is `python -m jaxseek.train` of configs/tiny-v3-256.yaml (a tiny DeepSeek-V3 at widths DeepSeek's FP8
tiles divide: MLA, MoE with a shared expert) in bfloat16 on `data.source=python-package:jax`: the byte-level
sources of the jax package at the version constraints.txt pins, the same bytes on every machine (the run's
fingerprint names them). A seed sets both the initialisation (train.seed) and the data order (data.seed), and
every variant of one seed sees the same both: differences are paired per seed. On CPU each recipe's GEMMs
multiply the e4m3 values XLA:CPU upcasts, so the losses are the recipe's numerics (not its speed).

Variants: `false` (the bfloat16 baseline), the recipes (`--recipes`), and the neutral rows (`--neutral`), which
change only rounding or summation order and so show how far such a change alone moves a run of this model:

  float32      the baseline in float32 compute
  ragged_dot   the baseline's routed experts through lax.ragged_dot instead of the blocked GEMM
  mesh         the baseline on 2 simulated devices (data = 2: another summation order of the gradient)

Printed per variant: the final loss (mean of the last 20 steps) over the seeds, the mean of the per-seed relative
differences from the baseline with its standard error and 95% interval (Student's t), and per seed. The noise band
is the largest |mean| + 2 SE of the neutral rows; a recipe is "inside" when its mean difference lies within it,
i.e. the benchmark cannot tell it from a rounding change. DeepSeek-V3's bound is 0.25%: with n seeds and a per-seed
spread s of the paired differences, the 95% interval is about 2s/√n wide, so resolving 0.25% needs s/√n ≲ 0.1%.
Results go to benchmarks/results.jsonl (bench "fp8_curves"); --from re-reports saved results; --plot draws the
curves (needs matplotlib).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import common
from compression_curves import TAIL, curve, draw
from jaxseek.metrics import read_jsonl

CORPUS = "python-package:jax"
FP8_BASE = ["--config", str(common.ROOT / "configs/tiny-v3-256.yaml"), f"data.source={CORPUS}", "checkpoint.every=0",
            "metrics.every=1"]
NEUTRAL = {"float32": ["train.compute_dtype=float32"], "ragged_dot": ["model.moe_matmul=ragged_dot"],
           "mesh": ["mesh.num_cpu_devices=2", "mesh.data=2"]}
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20}


def paired(finals: np.ndarray, base: np.ndarray) -> tuple[float, float, float]:
  """Mean relative difference of paired runs, its standard error, its 95% half-interval (Student's t)."""
  rel = finals / base - 1
  if len(rel) < 2:
    return float(rel.mean()), float("nan"), float("nan")
  se = rel.std(ddof=1) / np.sqrt(len(rel))
  return float(rel.mean()), float(se), float(T95.get(len(rel) - 1, 1.96) * se)


def report(curves: dict[str, list[np.ndarray]], neutral: list[str]) -> None:
  finals = {r: np.array([c[-TAIL:].mean() for c in runs]) for r, runs in curves.items()}
  base = finals.get("false")
  n = len(next(iter(finals.values())))
  print(f"{'variant':<12} {'final':>8} {'vs bf16':>9} {'SE':>7} {'95%':>8}  per seed ({n} seeds)")
  stats = {}
  for variant, f in finals.items():
    if base is None or variant == "false":
      print(f"{variant:<12} {f.mean():>8.4f}")
      continue
    stats[variant] = mean, se, half = paired(f, base)
    seeds_text = ", ".join(f"{x / b - 1:+.2%}" for x, b in zip(f, base))
    print(f"{variant:<12} {f.mean():>8.4f} {mean:>+9.2%} {se:>7.2%} {half:>8.2%}  {seeds_text}")
  rows = [stats[v] for v in neutral if v in stats]
  if rows:
    band = max(abs(m) + 2 * se for m, se, _ in rows)
    print(f"noise band (neutral rows, largest |mean| + 2 SE): {band:.2%}")
    for variant, (mean, se, _) in stats.items():
      if variant not in neutral:
        print(f"  {variant}: mean {mean:+.2%} -> {'inside' if abs(mean) <= band else 'OUTSIDE'} the noise band")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
  parser.add_argument("--recipes", nargs="+", default=["rowwise", "tensorwise", "mxfp8", "blockwise"])
  parser.add_argument("--neutral", nargs="*", default=list(NEUTRAL), choices=list(NEUTRAL))
  parser.add_argument("--jobs", type=int, default=2, help="runs at once")
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
        if r.get("bench") == "fp8_curves" and r.get("corpus") == CORPUS:
          curves[r["recipe"]] = [np.array(c) for c in r["losses"]]
  else:
    variants = [("false", "false", []), *((r, r, []) for r in args.recipes),
                *((name, "false", NEUTRAL[name]) for name in args.neutral)]
    runs = [(v, seed) for v in variants for seed in args.seeds]
    with tempfile.TemporaryDirectory() as scratch:
      tmp = args.run_dir or scratch
      # the seeds of one variant compile the same program: later runs read it from this cache
      os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tmp) / "compile-cache"))

      def one(run):
        (name, recipe, extra), seed = run
        got = curve(args.steps, seed, recipe, [*args.overrides, f"data.seed={seed}", *extra],
                    Path(tmp) / f"{name}-{seed}", key="train.fp8", base=FP8_BASE, warmup=0.1)
        print(f"{name} seed {seed}: final (last {TAIL} mean) {got[-TAIL:].mean():.4f}", flush=True)
        return got

      with ThreadPoolExecutor(args.jobs) as pool:
        for ((name, _, _), _), got in zip(runs, pool.map(one, runs)):
          curves.setdefault(name, []).append(got)
      for name, recipe, extra in variants:
        common.append_result(args.results or common.RESULTS, dict(
            bench="fp8_curves", corpus=CORPUS, steps=args.steps, seeds=args.seeds, recipe=name,
            overrides=[*args.overrides, f"train.fp8={recipe}", *extra],
            final_last20=[float(c[-TAIL:].mean()) for c in curves[name]], losses=[c.tolist() for c in curves[name]]))
  report(curves, args.neutral)
  if args.plot:
    named = {({"false": "bfloat16"}.get(r, r)): c for r, c in curves.items()}
    draw(named, Path(args.plot), title=f"tiny-v3-256 on {CORPUS}, bfloat16: train.fp8 recipes and neutral rows")
    print(f"plot: {args.plot}")


if __name__ == "__main__":
  main()
