"""How long a checkpoint save blocks training, against the whole save (async Orbax vs the full write).

  python benchmarks/checkpoint_save.py [--repeats 3]

Builds a ~150 MB (parameters) DeepSeek-V3-style model with its AdamW state on one CPU device, then times:
  block   the time `Checkpointer.save` holds the training loop (async: device→host copy and dispatch)
  total   block + waiting for the write to finish
  sync    the same save with checkpoint.async_save=false
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax

from jaxseek import checkpoint as checkpoint_lib
from jaxseek import config as config_lib
from jaxseek import step as step_lib
from jaxseek.sharding.mesh import make_mesh

ROOT = Path(__file__).resolve().parents[1]
SIZE = ["model.hidden_size=512", "model.vocab_size=16384", "model.intermediate_size=1536", "model.num_hidden_layers=4",
        "model.moe_intermediate_size=512", "model.q_lora_rank=256", "model.kv_lora_rank=128", "mesh.data=1",
        "mesh.fsdp=1", "mesh.tensor=1"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  results = {}
  for mode in ("async", "sync"):
    with tempfile.TemporaryDirectory() as tmp:
      cfg = config_lib.load(ROOT / "configs/demo.yaml", SIZE + [f"checkpoint.async_save={mode == 'async'}",
                                                                f"train.run_dir={tmp}", "checkpoint.keep=100"])
      mesh = make_mesh(cfg, jax.devices()[:1])
      trainer, state = step_lib.init_state(cfg, mesh)
      mb = sum(x.nbytes for x in jax.tree.leaves(state.params)) / 2**20
      total_mb = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
      ckpt = checkpoint_lib.Checkpointer(cfg, Path(tmp) / "checkpoints")
      ckpt.save(0, state, None)  # warm-up: Orbax's first save sets up its thread pools
      ckpt.wait()
      blocks, totals = [], []
      for i in range(1, args.repeats + 1):
        start = time.perf_counter()
        blocks.append(ckpt.save(i, state, None))
        ckpt.wait()
        totals.append(time.perf_counter() - start)
      ckpt.close()
      results[mode] = (statistics.median(blocks), statistics.median(totals))
  print(f"parameters {mb:.0f} MiB, whole train state {total_mb:.0f} MiB, median of {args.repeats} saves")
  for mode, (block, total) in results.items():
    print(f"{mode:>5}: blocks {block:.3f} s, whole save {total:.3f} s, block / whole = {block / total:.3f}")
  print(f"async block / sync save = {results['async'][0] / results['sync'][1]:.3f}")


if __name__ == "__main__":
  main()
