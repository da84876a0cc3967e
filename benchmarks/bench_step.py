"""Throughput and MFU of jaxseek's train step for any config, on the first local device.

  python benchmarks/bench_step.py --config configs/bench-v3-1b.yaml [--steps 10] [section.key=value ...]

Compiles the step (time reported), runs one warm-up step and --steps timed steps (each waits for its loss), and
prints tokens/s, TFLOP/s and MFU against the device's peak (jaxseek.metrics: the accelerator table, or on CPU the
measured matmul rate), with the device's peak memory where the runtime reports it. Appends a JSON line to
benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import os

import jax

import common
from jaxseek import config as config_lib
from jaxseek import metrics as metrics_lib


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--results", default=str(common.RESULTS))
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args()
  cfg = config_lib.load(args.config, ["mesh.data=1", "mesh.fsdp=1", *args.overrides])
  device = jax.devices()[0]
  peak, source = metrics_lib.peak_tflops_per_device(cfg.metrics.peak_tflops)
  timer = common.StepTimer(cfg)
  times, losses = timer.run(args.steps)
  tps = timer.tokens_per_sec(times)
  tflops = tps * timer.flops_per_token / 1e12
  stats = device.memory_stats() or {}
  peak_gib = stats.get("peak_bytes_in_use", 0) / 2**30
  print(f"{args.config}: {timer.n_params / 1e9:.3f}B parameters, batch {cfg.train.batch_size} x {cfg.train.seq_len}, "
        f"{cfg.train.compute_dtype} compute, {device.device_kind}")
  print(f"compile {timer.compile_s:.1f} s | step {cfg.train.batch_size * cfg.train.seq_len / tps:.3f} s | "
        f"{tps:,.0f} tokens/s | {tflops:.3g} TFLOP/s | MFU {100 * tflops / peak:.1f}% of {peak:.3g} TFLOP/s "
        f"({source}) | loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        + (f" | peak memory {peak_gib:.1f} GiB" if peak_gib else ""))
  common.append_result(args.results, dict(bench="step", config=args.config, overrides=args.overrides,
                                          params=timer.n_params, batch=cfg.train.batch_size, seq=cfg.train.seq_len,
                                          dtype=cfg.train.compute_dtype, compile_s=timer.compile_s,
                                          tokens_per_sec=tps, tflops=tflops, peak_tflops=peak, mfu=tflops / peak,
                                          peak_memory_gib=peak_gib, xla_flags=os.environ.get("XLA_FLAGS", "")))


if __name__ == "__main__":
  main()
