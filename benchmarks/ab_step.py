"""jaxseek's CPU train step under several settings, compiled in one process and timed in turns.

  python benchmarks/ab_step.py VARIANT [VARIANT ...] [--steps 10] [--set KEY=VALUE ...]

Each VARIANT is a comma-separated list of jaxseek config overrides ("" for none), e.g.

  python benchmarks/ab_step.py "" model.attention_impl=blocked "train.remat=full"

The model is bench_vs_hf.py's (benchmarks/common.py SMALL_V3 with a 4,096-word vocabulary, random weights, batch 8
× 256, float32, AdamW; --set changes the model). Every variant is compiled first, runs two warm-up steps, then the
variants take turns, one step each, the order reversed every other round, so load from other work on the machine
slows all of them alike. Printed per variant: median and minimum step, and the median over rounds of its step over
the first variant's (the figure to read: separate processes on a shared 2-core machine differ by 10% or more) and
the last loss (the same for settings that change no number).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("variants", nargs="+", help='comma-separated config overrides per variant ("" for none)')
  parser.add_argument("--steps", type=int, default=10, help="timed rounds (one step of every variant each)")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="change the model")
  args = parser.parse_args()

  import bench_vs_hf
  import common

  bench_vs_hf._jax_overrides([])

  model = common.parse_sets(["vocab_size=4096", *args.set], common.SMALL_V3)
  tokens = np.random.default_rng(0).integers(0, model["vocab_size"], (args.batch, args.seq + 1), dtype=np.int32)
  overrides = [[item for item in variant.split(",") if item] for variant in args.variants]
  timers = [common.StepTimer(common.with_overrides(common.make_config(model, args.batch, args.seq), items),
                             tokens=tokens) for items in overrides]
  for timer in timers:
    timer.run(0, warmup=2)
  times, losses = [[] for _ in timers], [0.0] * len(timers)
  for i in range(args.steps):
    for k in (range(len(timers)) if i % 2 == 0 else reversed(range(len(timers)))):
      start = time.perf_counter()
      losses[k] = timers[k].step()
      times[k].append(time.perf_counter() - start)
  print(f"{'variant':<40} {'compile s':>9} {'median s':>9} {'min s':>7} {'/ first':>8} {'last loss':>10}")
  for k, variant in enumerate(args.variants):
    ratio = statistics.median(a / b for a, b in zip(times[k], times[0]))
    print(f"{variant or '(defaults)':<40} {timers[k].compile_s:>9.1f} {statistics.median(times[k]):>9.3f} "
          f"{min(times[k]):>7.3f} {ratio:>8.3f} {losses[k]:>10.5f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
