"""Bytes each device moves per step by collective kind and mesh axes, read from the compiled train step, every
loop body weighted by its trip count (a plain count sees a `while` body once).

  # 8 simulated CPU devices
  python benchmarks/collective_bytes.py --config configs/tiny-v3.yaml mesh.data=8 train.microbatches=4
  # deviceless, for 8 H200s (needs .venv-gpu: make test-gpu-compile)
  JAX_PLATFORMS=cpu .venv-gpu/bin/python benchmarks/collective_bytes.py --target h200 \
      --config configs/bench-v3-1b.yaml model.num_hidden_layers=4 train.seq_len=1024 train.batch_size=8 mesh.data=8

Prints one JSON object: {"collectives": {kind: {axes: bytes per device per step}}, "temp_bytes": ...,
"gradient_reduction_bytes": all-reduce and reduce-scatter bytes over the batch axes}. Bytes are the result
sizes of each op (an all-reduce's operand, an all-gather's gathered result, the received buffer of an
all-to-all), not wire bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", required=True)
  ap.add_argument("--target", default=None, help="h200 | h100: deviceless GPU compile (JAX_PLATFORMS=cpu)")
  ap.add_argument("overrides", nargs="*")
  args = ap.parse_args()
  from jaxseek import config as config_lib
  from jaxseek.explore import compile as explore_compile

  cfg = config_lib.load(args.config, args.overrides)
  sizes = cfg.mesh.sizes()
  n = 1
  for v in sizes.values():
    n *= v
  if args.target:
    from jaxseek.explore import gpu as explore_gpu

    got = explore_gpu.compile_for_target(cfg, sizes, args.target, per_host=min(n, 8))
    hlo, temp, shape = got["hlo"], got["temp_bytes"], tuple(sizes.values())
  else:
    import jax

    jax.config.update("jax_num_cpu_devices", n)
    from jaxseek import step as step_lib
    from jaxseek.sharding import mesh as mesh_lib

    mesh = mesh_lib.make_mesh(cfg)
    trainer = step_lib.make_trainer(cfg, mesh)
    with jax.set_mesh(mesh):
      compiled = step_lib.compile_step(trainer, cfg, mesh).lower(
          trainer.abstract_state, explore_compile.abstract_batch(cfg, mesh)).compile()
    hlo, temp, shape = compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes, tuple(mesh.devices.shape)
  coll = explore_compile.collective_bytes(hlo, shape)
  print(json.dumps({"config": args.config, "overrides": args.overrides, "target": args.target or "cpu",
                    "temp_bytes": temp, "gradient_reduction_bytes": explore_compile.gradient_reduction_bytes(coll),
                    "collectives": coll}, indent=1))


if __name__ == "__main__":
  main()
