"""Per branch of a pipeline tick (train.pipeline_overlap: serial, paired, paired with the backward on virtual stage
0), the share of ticks it runs and how much of its expert exchange the kernels beside it are estimated to hide, read
from a compiled program that `python -m jaxseek.explore ... --compile --target T --hlo FILE` wrote:

  JAX_PLATFORMS=cpu .venv-gpu/bin/python benchmarks/overlap_branches.py FILE [--target h200] [--devices-per-node 8]
"""

import argparse

from jaxseek.explore import gpu as explore_gpu
from jaxseek.explore import overlap


def reachable(module, name: str, seen: set[str]) -> set[str]:
  if name not in seen:
    seen.add(name)
    for instruction in module.get(name, []):
      for _, callee in overlap.callees(instruction):
        if callee in module and instruction["opcode"] != "async-start":
          reachable(module, callee, seen)
  return seen


def tick_branches(module) -> list[str]:
  """The branch computations of the conditionals whose branches carry a share and which carry none themselves."""
  out = []
  for instructions in module.values():
    for instruction in instructions:
      if instruction["opcode"] != "conditional" or overlap._SHARE.search(instruction["attrs"]):
        continue
      names = [c for key, c in overlap.callees(instruction) if c in module]
      if any(overlap._SHARE.search(i["attrs"]) for c in names for i in module[c]):
        out += names
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("hlo")
  parser.add_argument("--target", default="h200")
  parser.add_argument("--devices-per-node", type=int, default=8)
  args = parser.parse_args()
  module, _ = overlap.parse(open(args.hlo).read())
  timer = overlap._Timer(module, explore_gpu.target_rates(args.target, args.devices_per_node))
  memo: dict[str, bool] = {}
  for branch in tick_branches(module):
    sent = hidden = beside = count = 0.0
    for name in reachable(module, branch, set()):
      for k, instruction in enumerate(module[name]):
        if overlap.collective_kind(module, instruction) == "ragged-all-to-all":
          nbytes, between = overlap._pair(module, module[name], k, memo)
          hidden += nbytes * timer.hidden(name, instruction, between, nbytes) if between else 0.0
          sent, beside, count = sent + nbytes, beside + nbytes * bool(between), count + 1
    print(f"{branch}: share of ticks {overlap.branch_share(module[branch]):.3f}, {count:.0f} ragged exchanges, "
          f"{100 * beside / max(sent, 1):.0f}% of their bytes beside compute, {100 * hidden / max(sent, 1):.0f}% "
          f"estimated hidden")


if __name__ == "__main__":
  main()
