"""Context parallelism: compiled temp memory per device against the context size, for one long sequence.

  python benchmarks/bench_context.py [--config configs/tiny-v3.yaml] [--seq 4096] [--contexts 1 2 4 8]
                                     [--train-steps 0] [--set KEY=VALUE ...]

The train step of the config on one sequence of `--seq` tokens (mesh context=c, data=1, on c simulated CPU
devices). Printed per c: XLA's temp bytes per device, their ratio to c = 1 and 1/c beside it, and the shapes
the forward's context all-gathers carry (the MLA latent and rope key, not the expanded heads). With
--train-steps N the largest context also runs N real steps and prints their losses.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import jax


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs/tiny-v3.yaml"))
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--contexts", type=int, nargs="*", default=[1, 2, 4, 8])
  parser.add_argument("--train-steps", type=int, default=0)
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
  parser.add_argument("--results", default=None)
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", max(args.contexts))
  import common
  from jaxseek import step as step_lib
  from jaxseek.config import MESH_AXES, load
  from jaxseek.input import global_batches
  from jaxseek.explore import compile as explore_compile
  from jaxseek.sharding.mesh import make_mesh

  base = None
  print(f"{args.config}, one sequence of {args.seq} tokens")
  print(f"{'context':>7} {'temp MiB/dev':>13} {'vs c=1':>7} {'1/c':>6}  context all-gathers (forward, per call)")
  for c in args.contexts:
    cfg = load(args.config, [f"mesh.context={c}", "mesh.data=1", f"train.seq_len={args.seq}", "train.batch_size=1",
                             f"model.max_position_embeddings={max(args.seq, 256)}", *args.set])
    mesh = make_mesh(cfg, jax.devices()[:c])
    trainer = step_lib.make_trainer(cfg, mesh)
    batches = global_batches(cfg, mesh)
    with jax.set_mesh(mesh):
      compiled = step_lib.compile_step(trainer, cfg, mesh).lower(trainer.abstract_state, next(batches)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    base = base or temp
    sizes = tuple(mesh.shape[a] for a in MESH_AXES)
    gathers = sorted({m.group(1) for line in compiled.as_text().splitlines()
                      if (m := re.search(r"= (\w+\[[\d,]+\])\S* all-gather(?:-start)?\(", line))
                      and explore_compile.collective_axes(line, sizes) == ("context",)})
    print(f"{c:>7} {temp / 2**20:>13.1f} {temp / base:>7.3f} {1 / c:>6.3f}  {', '.join(gathers) or '-'}", flush=True)
    common.append_result(args.results or common.RESULTS, dict(bench="context", config=args.config, seq=args.seq,
                                                              context=c, temp_bytes=temp, gathers=gathers))
    if args.train_steps and c == max(args.contexts):
      state = trainer.init()
      step = step_lib.compile_step(trainer, cfg, mesh)
      with jax.set_mesh(mesh):
        for i in range(args.train_steps):
          start = time.perf_counter()
          state, metrics = step(state, next(batches))
          print(f"  context {c}, step {i + 1}: loss {float(metrics['loss']):.4f} "
                f"({time.perf_counter() - start:.1f} s)", flush=True)


if __name__ == "__main__":
  sys.exit(main())
