"""Bytes each device sends per step for the data-axis gradient sum, by train.grad_compression method, read from
the compiled train step on simulated CPU devices (the collectives' static shapes, loop bodies weighted by their
trip counts), against no compression.

  python benchmarks/compression_bytes.py --config configs/bench-v3-1b.yaml --data 8 16 -- \
      model.num_hidden_layers=4 train.seq_len=128
  python benchmarks/compression_bytes.py --config configs/tiny-dense.yaml --data 2 --mesh fsdp=2 tensor=2 \
      --methods powersgd

The mesh is data = N times the axes of --mesh (none: data-parallel only). Counted are the collectives whose
groups span `data`, arrays of rank ≥ 1 (the loss and metrics' scalars summed over the batch are no gradient).
Wire bytes per device from each op's result size R on a group of n: all-reduce 2(n − 1)/n · R (ring),
all-gather and all-to-all (n − 1)/n · R, reduce-scatter (n − 1) · R. Printed per method and data size: the
bytes, their ratio to none, and what `compression.step_bytes` (the explorer's and the start-up line's count)
says. Results go to benchmarks/results.jsonl (bench "compression_bytes").
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

METHODS = ("none", "bf16", "int8", "powersgd")
SCALAR = re.compile(r"\b[a-z]+\d*[a-z0-9]*\[\]")  # an HLO scalar type, f32[]


def data_wire(text: str, mesh_shape: dict[str, int]) -> float:
  """Bytes each device sends per step in the collectives of a compiled module (XLA:CPU's: no async pairs) whose
  groups span `data`, scalars left out, loop bodies weighted by their trip counts."""
  from jaxseek.explore import compile as explore_compile
  from jaxseek.explore import overlap

  module, entry = overlap.parse(text)
  runs = overlap.weights(module, entry)
  out = 0.0
  for name, instructions in module.items():
    for instruction in instructions:
      kind = instruction["opcode"]
      if kind not in overlap.KINDS and overlap.collective_kind(module, instruction):
        raise ValueError(f"an async {overlap.collective_kind(module, instruction)} (a GPU module): count on CPU")
      if kind not in overlap.KINDS or not runs.get(name):
        continue
      axes = explore_compile.collective_axes(instruction["attrs"], tuple(mesh_shape.values()))
      if axes is None:
        raise ValueError(f"groups not understood: {instruction['attrs'][:200]}")
      if "data" in axes:
        n = math.prod(mesh_shape[a] for a in axes)
        per = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1, "collective-permute": 1}.get(kind, (n - 1) / n)
        out += runs[name] * per * overlap.array_bytes(SCALAR.sub("", instruction["type"]))
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", required=True)
  ap.add_argument("--data", type=int, nargs="+", default=[8, 16])
  ap.add_argument("--mesh", nargs="*", default=[], help="other mesh axes, e.g. fsdp=2 tensor=2")
  ap.add_argument("--methods", nargs="+", default=list(METHODS))
  ap.add_argument("--results", default=None)
  ap.add_argument("overrides", nargs="*")
  args = ap.parse_args()
  import jax

  others = math.prod(int(a.split("=")[1]) for a in args.mesh)
  jax.config.update("jax_num_cpu_devices", max(args.data) * others)
  import common
  from jaxseek import config as config_lib
  from jaxseek import step as step_lib
  from jaxseek.explore import compile as explore_compile
  from jaxseek.sharding.mesh import make_mesh

  print(f"{'data':>4} {'method':<9} {'MB/device/step':>15} {'× none':>7} {'counted':>9}", flush=True)
  for n in args.data:
    base = None
    for method in args.methods:
      mesh_overrides = [f"mesh.{a}" for a in args.mesh]
      cfg = config_lib.load(args.config, [*args.overrides, f"mesh.data={n}", *mesh_overrides,
                                          f"train.batch_size={n * others}", f"train.grad_compression={method}"])
      mesh = make_mesh(cfg, jax.devices()[:n * others])
      trainer = step_lib.make_trainer(cfg, mesh)
      with jax.set_mesh(mesh):
        compiled = step_lib.compile_step(trainer, cfg, mesh).lower(
            trainer.abstract_state, explore_compile.abstract_batch(cfg, mesh)).compile()
      text = compiled.as_text()
      coll = explore_compile.collective_bytes(text, tuple(mesh.devices.shape))
      got = data_wire(text, dict(mesh.shape))
      counted = step_lib.compression_bytes(cfg, trainer, mesh)
      base = got if method == "none" else base
      ratio = got / base if base else float("nan")
      print(f"{n:>4} {method:<9} {got / 1e6:>15.6f} {ratio:>7.3f} {counted / 1e6:>9.6f}", flush=True)
      common.append_result(args.results or common.RESULTS, dict(
          bench="compression_bytes", config=os.path.basename(args.config), overrides=args.overrides, data=n,
          mesh=args.mesh, method=method, rank=cfg.train.powersgd_rank, wire_bytes=got, ratio_to_none=ratio,
          counted_bytes=counted, collectives=coll))


if __name__ == "__main__":
  main()
