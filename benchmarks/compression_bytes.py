"""Bytes each device sends per step for the data-axis gradient sum, by train.grad_compression method, read from
the compiled train step on simulated CPU devices (the collectives' static shapes, loop bodies weighted by their
trip counts), against no compression.

  python benchmarks/compression_bytes.py --config configs/bench-v3-1b.yaml --data 8 16 -- \
      model.num_hidden_layers=4 train.seq_len=128

The mesh is data-parallel only (data = N, every other axis 1), so every collective of the step spans `data`.
Wire bytes per device from each op's result size R on a group of n: all-reduce 2(n − 1)/n · R (ring),
all-gather and all-to-all (n − 1)/n · R, reduce-scatter (n − 1) · R. Printed per method and data size: the
bytes, their ratio to none, and what `compression.step_bytes` (the explorer's and the start-up line's count)
says. Results go to benchmarks/results.jsonl (bench "compression_bytes").
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

METHODS = ("none", "bf16", "int8", "powersgd")


def wire(collectives: dict[str, dict[str, float]], sizes: dict[str, int]) -> float:
  out = 0.0
  for kind, by_axes in collectives.items():
    for axes, nbytes in by_axes.items():
      n = 1
      for a in axes.split("+"):
        n *= sizes.get(a, 1)
      if n <= 1:
        continue
      out += nbytes * {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1}.get(kind, (n - 1) / n)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", required=True)
  ap.add_argument("--data", type=int, nargs="+", default=[8, 16])
  ap.add_argument("--methods", nargs="+", default=list(METHODS))
  ap.add_argument("--results", default=None)
  ap.add_argument("overrides", nargs="*")
  args = ap.parse_args()
  import jax

  jax.config.update("jax_num_cpu_devices", max(args.data))
  import common
  from jaxseek import config as config_lib
  from jaxseek import step as step_lib
  from jaxseek.explore import compile as explore_compile
  from jaxseek.sharding import compression
  from jaxseek.sharding.mesh import make_mesh

  print(f"{'data':>4} {'method':<9} {'MB/device/step':>15} {'× none':>7} {'counted':>9}", flush=True)
  for n in args.data:
    base = None
    for method in args.methods:
      cfg = config_lib.load(args.config, [*args.overrides, f"mesh.data={n}", f"train.batch_size={n}",
                                          f"train.grad_compression={method}"])
      mesh = make_mesh(cfg, jax.devices()[:n])
      trainer = step_lib.make_trainer(cfg, mesh)
      with jax.set_mesh(mesh):
        compiled = step_lib.compile_step(trainer, cfg, mesh).lower(
            trainer.abstract_state, explore_compile.abstract_batch(cfg, mesh)).compile()
      coll = explore_compile.collective_bytes(compiled.as_text(), tuple(mesh.devices.shape))
      got = wire(coll, dict(mesh.shape))
      counted = step_lib.compression_bytes(cfg, trainer, mesh)
      base = got if method == "none" else base
      ratio = got / base if base else float("nan")
      print(f"{n:>4} {method:<9} {got / 1e6:>15.2f} {ratio:>7.3f} {counted / 1e6:>9.2f}", flush=True)
      common.append_result(args.results or common.RESULTS, dict(
          bench="compression_bytes", config=os.path.basename(args.config), overrides=args.overrides, data=n,
          method=method, rank=cfg.train.powersgd_rank, wire_bytes=got, ratio_to_none=ratio, counted_bytes=counted,
          collectives=coll))


if __name__ == "__main__":
  main()
