"""Loss curves of train.grad_compression methods side by side on real text, over several seeds.

  python benchmarks/compression_curves.py --steps 400 --seeds 0 1 2 --methods none int8 powersgd \
      --plot docs/compression_curves.png

Each run is `python -m jaxseek.train` of configs/tiny-v3.yaml (a tiny DeepSeek-V3: MLA, MoE with a shared expert)
on byte-level python-stdlib text over 8 simulated CPU devices, all on `data` (data = 8), the same data and seed
for every method. Printed per method: the final loss (the mean of the last 20 steps, as one step's loss is
noisy) averaged over the seeds and its difference from none's, with each seed's. Results go to
benchmarks/results.jsonl (bench "compression_curves"); --plot draws the curves (needs matplotlib).

  python benchmarks/compression_curves.py --from benchmarks/results.jsonl --plot docs/compression_curves.png

redraws and reprints the compression_curves results of earlier runs (the last per method and overrides).
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
BASE = ["--config", str(ROOT / "configs/tiny-v3.yaml"), "mesh.num_cpu_devices=8", "mesh.data=8",
        "data.source=python-stdlib", "data.max_bytes=2000000", "train.seq_len=64", "train.batch_size=32",
        "checkpoint.every=0", "metrics.every=1"]
TAIL = 20


def curve(steps: int, seed: int, method: str, extra: list[str], run_dir: Path, key: str = "train.grad_compression",
          base: list[str] = BASE, warmup: float = 0.05) -> np.ndarray:
  """The per-step losses of one run with `key`=`method` (and `extra` overrides) after `base`, warming up over
  the `warmup` fraction of the steps."""
  cmd = [sys.executable, "-m", "jaxseek.train", *base, f"train.steps={steps}", f"optim.warmup_steps={int(steps * warmup)}",
         f"train.seed={seed}", f"{key}={method}", f"train.run_dir={run_dir}", *extra]
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  if done.returncode:
    sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
  by_step = {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}
  return np.array([by_step[s] for s in range(1, steps + 1)])


def draw(curves: dict[str, list[np.ndarray]], out: Path, smooth: int = 10,
         title: str = "tiny-v3 on python-stdlib, data = 8: train.grad_compression, one line per seed") -> None:
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(7, 4.2), dpi=110, layout="constrained")
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  kernel = np.ones(smooth) / smooth
  for i, (method, runs) in enumerate(curves.items()):
    for j, losses in enumerate(runs):
      ys = np.convolve(losses, kernel, mode="valid")
      ax.plot(np.arange(smooth, len(losses) + 1), ys, color=f"C{i}", lw=1, alpha=0.8,
              label=method if j == 0 else None)
  ax.set_xlabel("step")
  ax.set_ylabel(f"loss (moving average over {smooth} steps)")
  ax.set_title(title, fontsize=10)
  ax.grid(True, alpha=0.3)
  ax.legend()
  fig.savefig(out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--methods", nargs="+", default=["none", "int8", "powersgd"])
  parser.add_argument("--plot", default=None)
  parser.add_argument("--results", default=None)
  parser.add_argument("--from", dest="saved", nargs="+", default=None, metavar="RESULTS_JSONL")
  parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
  args = parser.parse_args()
  curves: dict[str, list[np.ndarray]] = {}
  if args.saved:
    for path in args.saved:
      for r in read_jsonl(Path(path)):
        if r.get("bench") == "compression_curves":
          curves[" ".join([r["method"], *r["overrides"]])] = [np.array(c) for c in r["losses"]]
    report(curves, args, save=False)
    return
  with tempfile.TemporaryDirectory() as tmp:
    for method in args.methods:
      for seed in args.seeds:
        got = curve(args.steps, seed, method, args.overrides, Path(tmp) / f"{method}-{seed}")
        curves.setdefault(method, []).append(got)
        print(f"{method} seed {seed}: final (last {TAIL} mean) {got[-TAIL:].mean():.4f}", flush=True)
  report(curves, args, save=True)


def report(curves: dict[str, list[np.ndarray]], args, save: bool) -> None:
  finals = {m: np.array([c[-TAIL:].mean() for c in runs]) for m, runs in curves.items()}
  base = finals.get("none")
  w = max(10, *(len(m) for m in finals))
  print(f"{'method':<{w}} {'final':>8} {'vs none':>8}  per seed")
  for method, f in finals.items():
    rel = f.mean() / base.mean() - 1 if base is not None else float("nan")
    seeds = ", ".join(f"{x:.4f}" + (f" ({x / b - 1:+.2%})" if base is not None else "") for x, b in
                      zip(f, base if base is not None else f))
    print(f"{method:<{w}} {f.mean():>8.4f} {rel:>+8.2%}  {seeds}")
    if not save:
      continue
    common.append_result(args.results or common.RESULTS, dict(
        bench="compression_curves", steps=args.steps, seeds=args.seeds, method=method, overrides=args.overrides,
        final_last20=f.tolist(), final_mean=float(f.mean()), rel_to_none=float(rel),
        losses=[c.tolist() for c in curves[method]]))
  if args.plot:
    draw(curves, Path(args.plot))
    print(f"plot: {args.plot}")


if __name__ == "__main__":
  main()
