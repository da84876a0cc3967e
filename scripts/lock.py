"""Write constraints.txt: the versions installed in this environment of everything jaxseek[dev,convert,plot] pulls in.

python scripts/lock.py [--extras dev,convert,plot] [--out constraints.txt]   (run with .venv/bin/python; `make lock`)

Local version labels are dropped (`torch==2.13.0+cpu` is written `torch==2.13.0`): a public pin matches the
CPU build where an index or find-links offers it, and PyPI's build elsewhere.
"""

import argparse
import importlib.metadata as md
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

HEADER = """\
# Versions `make test` passes with; every install target uses them (pip install -c constraints.txt ...).
# Regenerate with `make lock` after changing an installed version in .venv. Written by scripts/lock.py.
"""


def closure(root: str, extras: set[str]) -> tuple[dict[str, md.Distribution], list[str]]:
  """Installed distributions that `pip install root[extras]` requires, transitively (root excluded), and the
  names of those required for this platform but not installed."""
  found: dict[str, tuple[md.Distribution, set[str]]] = {}
  missing: list[str] = []
  todo = [(root, extras)]
  while todo:
    name, wanted = todo.pop()
    key = canonicalize_name(name)
    if key in found and wanted <= found[key][1]:
      continue
    try:
      dist = md.distribution(name)
    except md.PackageNotFoundError:
      missing.append(name)  # markers for other platforms were evaluated before it was queued
      continue
    wanted = wanted | (found[key][1] if key in found else set())
    found[key] = (dist, wanted)
    for line in dist.requires or []:
      req = Requirement(line)
      if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted | {""}):
        todo.append((req.name, set(req.extras)))
  found.pop(canonicalize_name(root), None)
  return {key: dist for key, (dist, _) in found.items()}, missing


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--extras", default="dev,convert,plot")
  parser.add_argument("--out", default="constraints.txt")
  args = parser.parse_args()
  dists, missing = closure("jaxseek", set(filter(None, args.extras.split(","))))
  if missing:
    print(f"lock: not installed in this environment: {', '.join(sorted(set(missing)))}; "
          f"install jaxseek[{args.extras}] first", file=sys.stderr)
    return 2
  lines = sorted(f"{key}=={Version(d.version).public}" for key, d in dists.items() if key != "setuptools")
  with open(args.out, "w") as f:
    f.write(HEADER + "\n".join(lines) + "\n")
  print(f"lock: {len(lines)} pins written to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
