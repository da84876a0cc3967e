"""MFU of jaxseek's train step on this machine, for a dense and an MoE model, against the measured matmul peak.

  python benchmarks/bench_mfu.py [--steps 5] [--batch 8] [--seq 256] [--results benchmarks/results.jsonl]

dense  ~50M parameters, DeepSeek LLM layout (benchmarks/common.py DENSE_50M)
moe    the small DeepSeek-V3 of bench_vs_hf.py (common.SMALL_V3: MLA, 16 routed experts top 4, 1 shared)

float32 on one device with all cores. MFU = model FLOPs per token (jaxseek.metrics.flops_per_token: 6 × active
matmul parameters + causal attention) × tokens/s over the float32 matmul rate XLA reaches on a 1024² product here
(on an accelerator, the peak table in jaxseek.metrics). Median of --steps steps after one warm-up step.
"""

from __future__ import annotations

import argparse

import common


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--results", default=str(common.RESULTS))
  args = parser.parse_args()
  peak = common.matmul_peak_tflops()
  print(f"matmul peak (XLA, float32, all cores): {peak * 1e3:.0f} GFLOP/s; batch {args.batch} x {args.seq}")
  print(f"{'model':<7} {'params':>8} {'MFLOP/tok':>10} {'step s':>8} {'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>6}")
  for name, model in (("dense", common.DENSE_50M), ("moe", common.SMALL_V3)):
    timer = common.StepTimer(common.make_config(model, args.batch, args.seq))
    times, _ = timer.run(args.steps)
    tps = timer.tokens_per_sec(times)
    tflops = tps * timer.flops_per_token / 1e12
    print(f"{name:<7} {timer.n_params / 1e6:>7.1f}M {timer.flops_per_token / 1e6:>10.1f} "
          f"{args.batch * args.seq / tps:>8.3f} {tps:>9,.0f} {tflops:>8.3f} {100 * tflops / peak:>5.1f}%")
    common.append_result(args.results, dict(bench="mfu", model=name, params=timer.n_params, batch=args.batch,
                                            seq=args.seq, tokens_per_sec=tps, tflops=tflops, peak_tflops=peak,
                                            mfu=tflops / peak))


if __name__ == "__main__":
  main()
