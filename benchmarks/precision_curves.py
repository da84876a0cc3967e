"""Loss curves of precision settings against a baseline run of the same config, data and seed.

  python benchmarks/precision_curves.py --steps 100 --base train.compute_dtype=float32 \
      --variant bf16 train.compute_dtype=bfloat16 [--variant NAME KEY=VALUE ...] [--config configs/demo.yaml]

Each run is `python -m jaxseek.train` with metrics every step. Printed per variant: the final loss, the mean of
the last 10 losses, and the largest and the mean relative difference of its per-step loss from the baseline's.
Results go to benchmarks/results.jsonl (bench "precision_curves") with both curves.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import common
from jaxseek.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def curve(config: str, steps: int, overrides: list[str], run_dir: Path) -> np.ndarray:
  cmd = [sys.executable, "-m", "jaxseek.train", "--config", config, f"train.steps={steps}", "metrics.every=1",
         f"train.run_dir={run_dir}", "checkpoint.every=0", *overrides]
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  if done.returncode:
    sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
  by_step = {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}
  return np.array([by_step[s] for s in range(1, steps + 1)])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=str(ROOT / "configs/demo.yaml"))
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--base", nargs="*", default=[], metavar="KEY=VALUE")
  parser.add_argument("--variant", nargs="+", action="append", default=[], metavar="NAME KEY=VALUE")
  parser.add_argument("--results", default=None)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    base = curve(args.config, args.steps, args.base, Path(tmp) / "base")
    print(f"{Path(args.config).name}, {args.steps} steps; baseline {' '.join(args.base) or '(config)'}: "
          f"final loss {base[-1]:.4f}, last 10 mean {base[-10:].mean():.4f}")
    print(f"{'variant':<12} {'final':>8} {'last 10':>8} {'max rel diff':>13} {'mean rel diff':>14}")
    for name, *overrides in args.variant:
      got = curve(args.config, args.steps, [*args.base, *overrides], Path(tmp) / name)
      rel = np.abs(got / base - 1)
      print(f"{name:<12} {got[-1]:>8.4f} {got[-10:].mean():>8.4f} {rel.max():>13.4f} {rel.mean():>14.4f}",
            flush=True)
      common.append_result(args.results or common.RESULTS, dict(
          bench="precision_curves", config=Path(args.config).name, steps=args.steps, base=args.base,
          variant=name, overrides=overrides, max_rel_diff=float(rel.max()), mean_rel_diff=float(rel.mean()),
          final=float(got[-1]), base_final=float(base[-1]), losses=got.tolist(), base_losses=base.tolist()))


if __name__ == "__main__":
  main()
