"""Compile time against depth (the layer stack is one lax.scan, so it should stay nearly flat) and step time
against batch size.

  python benchmarks/bench_scaling.py [--layers 4 8 16 32] [--batches 2 4 8 16] [--results ...]

Model: the small DeepSeek-V3 of bench_vs_hf.py (benchmarks/common.py SMALL_V3) with n layers (1 dense, n - 1
MoE). Compile time = lower + compile of the whole train step (forward, backward, AdamW), fresh process state per
depth (JAX's in-memory cache is per function object, and each depth is a new one). Step time: median of --steps
steps after one warm-up, 4 layers, sequence --seq.
"""

from __future__ import annotations

import argparse

import common


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, nargs="*", default=[4, 8, 16, 32])
  parser.add_argument("--batches", type=int, nargs="*", default=[2, 4, 8, 16])
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--results", default=str(common.RESULTS))
  args = parser.parse_args()

  print(f"{'layers':>6} {'params':>8} {'compile s':>10} {'vs first':>9}")
  first = None
  for layers in args.layers:
    timer = common.StepTimer(common.make_config(dict(common.SMALL_V3, num_hidden_layers=layers), 2, args.seq))
    first = first or timer.compile_s
    print(f"{layers:>6} {timer.n_params / 1e6:>7.1f}M {timer.compile_s:>10.2f} {timer.compile_s / first:>8.2f}x")
    common.append_result(args.results, dict(bench="compile_vs_layers", layers=layers, params=timer.n_params,
                                            compile_s=timer.compile_s))
  print(f"\n{'batch':>6} {'tokens':>7} {'step s':>8} {'tokens/s':>9} {'s/token vs first':>17}")
  base = None
  for batch in args.batches:
    timer = common.StepTimer(common.make_config(common.SMALL_V3, batch, args.seq))
    times, _ = timer.run(args.steps)
    tps = timer.tokens_per_sec(times)
    base = base or tps
    print(f"{batch:>6} {batch * args.seq:>7} {batch * args.seq / tps:>8.3f} {tps:>9,.0f} {base / tps:>16.2f}x")
    common.append_result(args.results, dict(bench="step_vs_batch", batch=batch, seq=args.seq, tokens_per_sec=tps))


if __name__ == "__main__":
  main()
