"""The expert exchange's collectives compiled for 16 H100s as 2 nodes × 8 (no GPU needed): one-stage ragged
dispatch against the node-limited two-stage dispatch. Prints, per ragged-all-to-all in the optimised HLO, its
operand and output rows, width and dtype, its group size and whether its replica groups span nodes. Needs the CUDA build of JAX (.venv-gpu: make test-gpu-compile installs it):

  JAX_PLATFORMS=cpu .venv-gpu/bin/python benchmarks/node_dispatch_hlo.py
"""

import collections
import re
import sys

from jaxseek import config as config_lib
from jaxseek.explore import gpu as explore_gpu

LAYOUT = ["model.num_hidden_layers=4", "train.seq_len=1024", "train.batch_size=16", "mesh.data=1", "mesh.fsdp=1",
          "mesh.expert=16", "mesh.allow_cross_host=true", "model.moe_capacity_factor=null"]
OP = re.compile(r"ragged-all-to-all-start(?:\.\d+)? = \(\((\w+)\[(\d+),(\d+)\][^)]*\), (\w+)\[(\d+),\d+\].*?"
                r"replica_groups=(\{[^ ]*\})")
PER_NODE = 8


def ops(dispatch: str) -> list[tuple]:
  cfg = config_lib.load("configs/bench-v3-1b.yaml", LAYOUT + [f"model.moe_dispatch={dispatch}"])
  got = explore_gpu.compile_for_target(cfg, cfg.mesh.sizes() | {"data": 1}, "h100", PER_NODE)
  out = []
  for dtype, rows_in, cols, _, rows_out, groups in OP.findall(got["hlo"]):
    members = [list(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", groups[1:-1])]
    spans = any(len({d // PER_NODE for d in g}) > 1 for g in members)
    out.append((dtype, int(rows_in), int(cols), int(rows_out), len(members[0]), spans))
  return out


def main() -> None:
  for dispatch in sys.argv[1:] or ["ragged", "two_stage"]:
    counts = collections.Counter(ops(dispatch))
    print(f"model.moe_dispatch={dispatch}: ragged-all-to-alls (dtype, operand rows, width, output rows, group size, "
          f"spans nodes) × count")
    for op, n in sorted(counts.items()):
      print(f"  {op} × {n}")


if __name__ == "__main__":
  main()
