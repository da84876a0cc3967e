"""What XLA keeps live at the peak of a compiled GPU step, from its dump: the temporaries' allocation taken apart.

  XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_module_re=jit_step" JAX_PLATFORMS=cpu \
      .venv-gpu/bin/python -m jaxseek.explore --config ... --compile --target h100
  python benchmarks/xla_peak.py DIR [--top 40]

XLA assigns every value of the step's temporaries an offset in one preallocated buffer (`*buffer-assignment.txt`)
and a live range in the module's flattened schedule (`*live-range.txt`). Values that share bytes at one time are
aliases of one buffer (an in-place update, a while loop's carry). At each point of the schedule this script takes
the union of the byte ranges of the values live there; the largest union is the peak that sizes the allocation.
It prints the peak, then its buffers (one line per byte range, the op that defines its first value) and a count of
them by size.
"""

from __future__ import annotations

import argparse
import collections
import glob
import re


def read(folder: str, suffix: str) -> str:
  files = glob.glob(f"{folder}/*gpu_after_optimizations{suffix}")
  if not files:
    raise SystemExit(f"no *gpu_after_optimizations{suffix} in {folder}: compile with XLA_FLAGS=--xla_dump_to={folder}")
  return open(files[0]).read()


def temporaries(assignment: str) -> tuple[int, dict[str, tuple[int, int]]]:
  """The preallocated temp buffer's size and its values: name → (offset, size)."""
  found = re.search(r"allocation \d+: size (\d+), preallocated-temp:\n((?: value:.*\n)+)", assignment)
  values = {}
  for m in re.finditer(r"value: <\d+ ([^ ]+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)", found.group(2)):
    name = m.group(1) if m.group(1).endswith("}") else m.group(1) + "{}"
    values[name] = (int(m.group(3)), int(m.group(2)))
  return int(found.group(1)), values


def union(ranges) -> int:
  total, end = 0, -1
  for offset, size in sorted(ranges):
    total += max(0, offset + size - max(offset, end))
    end = max(end, offset + size)
  return total


def peak(values: dict[str, tuple[int, int]], live: str) -> tuple[int, int, dict[tuple[int, int], list[str]]]:
  """(bytes, time, byte range → the values live in it) at the point where the live values span the most bytes."""
  spans = {m.group(1): (int(m.group(2)), int(m.group(3)))
           for m in re.finditer(r"^\s+([^\s:]+):(\d+)-(\d+)$", live, re.M)}
  items = [(*spans[n], offset, size, n) for n, (offset, size) in values.items() if n in spans]
  best = (0, 0)
  for t in sorted({start for start, *_ in items}):
    best = max(best, (union({(o, s) for a, b, o, s, _ in items if a <= t <= b}), t))
  ranges = collections.defaultdict(list)
  for a, b, offset, size, name in items:
    if a <= best[1] <= b:
      ranges[offset, size].append(name)
  return best[0], best[1], ranges


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("folder")
  parser.add_argument("--top", type=int, default=40)
  args = parser.parse_args()
  size, values = temporaries(read(args.folder, "-buffer-assignment.txt"))
  total, time, ranges = peak(values, read(args.folder, "-live-range.txt"))
  hlo = read(args.folder, ".txt")
  ops = {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(
      r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) .*?op_name=\"([^\"]*)\"", hlo, re.M)}
  mib = lambda n: f"{n / 2**20:,.1f} MiB"
  print(f"temporaries {mib(size)}; peak at schedule point {time}: {mib(total)} live")
  rows = sorted(ranges.items(), key=lambda kv: -kv[0][1])
  for (offset, nbytes), names in rows[:args.top]:
    shape, op = ops.get(names[0].split("{")[0], ("", ""))
    shape = shape if names[0].endswith("{}") else ""  # a tuple's element: its size says it
    print(f"{mib(nbytes):>14s}  {names[0][:36]:36s} {shape[:34]:34s} {op[-90:]}")
  by_size = collections.Counter(nbytes for _, nbytes in ranges)
  print("by size: " + ", ".join(f"{n} × {mib(s)}" for s, n in sorted(by_size.items(), reverse=True)[:args.top]))


if __name__ == "__main__":
  main()
