"""Which collectives XLA overlaps with compute, read from an optimised, scheduled HLO module (`as_text()`).

On a GPU target XLA splits a collective into an async pair, `all-gather-start` … `all-gather-done` (also
all-reduce, collective-permute, and through the generic async wrapper all-to-all, reduce-scatter and
ragged-all-to-all); in a scheduled module the instructions of a computation are listed in the order they run.
A pair overlaps compute when a kernel (a fusion, custom call, dot or convolution, or a while, conditional or
call whose computations launch one) is scheduled between its start and its done in the same computation, and
XLA did not mark it `is_sync` (run synchronously, whatever lies between). Bytes outside every conditional's
branch are also counted apart (`always_*`): what runs whatever the data, where a branch may be skipped (the
dropless exchange's further rounds run only under skew).

Each collective is weighted by how often it runs: the product of the `known_trip_count`s of the while loops
whose bodies hold it. A conditional's branches each count as if taken every time (an upper bound: the table
schedules' `lax.switch` takes one branch a tick).
"""

from __future__ import annotations

import re
from typing import Any

KINDS = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter", "ragged-all-to-all",
         "collective-broadcast")
COMPUTE = frozenset({"fusion", "custom-call", "dot", "convolution"})
CALLERS = frozenset({"while", "conditional", "call"})
ITEMSIZE = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
            "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*[({]")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")


def parse(text: str) -> tuple[dict[str, list[dict[str, Any]]], str | None]:
  """({computation: [instruction {name, type, opcode, operands, attrs}] in the order listed}, the entry's name)."""
  out: dict[str, list[dict[str, Any]]] = {}
  current = entry = None
  for line in text.splitlines():
    stripped = line.strip()
    if current is None:
      match = _HEADER.match(stripped)
      if match and stripped.endswith("{") and " = " not in stripped.split("(")[0]:
        current = match.group(1)
        out[current] = []
        entry = current if stripped.startswith("ENTRY") else entry
      continue
    if stripped == "}":
      current = None
      continue
    instruction = _instruction(stripped)
    if instruction:
      out[current].append(instruction)
  return out, entry


def _instruction(line: str) -> dict[str, Any] | None:
  match = _NAME.match(line)
  if not match:
    return None
  rest = line[match.end():]
  if rest.startswith("("):  # a tuple type: up to its closing parenthesis
    end = _closing(rest, 0)
    type_, rest = rest[:end + 1], rest[end + 1:].lstrip()
  else:
    type_, _, rest = rest.partition(" ")
  paren = rest.find("(")
  if paren < 0:
    return None
  end = _closing(rest, paren)
  return {"name": match.group(1), "type": type_, "opcode": rest[:paren].strip(),
          "operands": rest[paren + 1:end], "attrs": rest[end + 1:]}


def _closing(text: str, start: int) -> int:
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i
  return len(text) - 1


def array_bytes(type_: str) -> int:
  """Bytes of every array in an HLO type (a tuple's elements summed)."""
  total = 0
  for dtype, dims in _ARRAY.findall(type_):
    if dtype in ITEMSIZE:
      n = 1
      for d in dims.split(","):
        n *= int(d) if d else 1
      total += ITEMSIZE[dtype] * n
  return total


def callees(instruction: dict[str, Any]) -> list[tuple[str, str]]:
  attrs = instruction["attrs"]
  found = [(key, name) for key, name in _CALLED.findall(attrs)]
  for group in _BRANCHES.findall(attrs):
    found += [("branch", name.strip().lstrip("%")) for name in group.split(",") if name.strip()]
  return found


def weights(module: dict[str, list[dict[str, Any]]], entry: str) -> dict[str, int]:
  """How many times each computation runs per execution of `entry` (while bodies × their trip counts)."""
  out = {entry: 1}
  stack = [entry]
  while stack:
    caller = stack.pop()
    for instruction in module.get(caller, []):
      trips = _TRIP.search(instruction["attrs"])
      for key, callee in callees(instruction):
        if callee not in module or instruction["opcode"] == "async-start":
          continue  # an async wrapper's computation is its start / done pair, counted there
        n = out[caller] * (int(trips.group(1)) if trips and key in ("body", "condition") else 1)
        out[callee] = out.get(callee, 0) + n
        stack.append(callee)
  return out


def in_branches(module: dict[str, list[dict[str, Any]]], entry: str) -> set[str]:
  """The computations that run only inside a conditional's branch (and what they call): work that may be
  skipped, such as the dropless exchange's further rounds."""
  out: set[str] = set()
  stack = [(entry, False)]
  seen = set()
  while stack:
    name, under = stack.pop()
    if (name, under) in seen:
      continue
    seen.add((name, under))
    out |= {name} if under else set()
    for instruction in module.get(name, []):
      for key, callee in callees(instruction):
        if callee in module and instruction["opcode"] != "async-start":
          stack.append((callee, under or key in ("branch", "true_computation", "false_computation")))
  return out - {n for n, u in seen if not u}


def _launches(module, name: str, memo: dict[str, bool]) -> bool:
  """Whether running computation `name` launches a kernel."""
  if name not in memo:
    memo[name] = False
    memo[name] = any(_is_compute(module, i, memo) for i in module.get(name, []))
  return memo[name]


def _is_compute(module, instruction: dict[str, Any], memo: dict[str, bool]) -> bool:
  if instruction["opcode"] in COMPUTE:
    return True
  if instruction["opcode"] in CALLERS:
    return any(_launches(module, callee, memo) for key, callee in callees(instruction) if key != "condition")
  return False


def collective_kind(module, instruction: dict[str, Any]) -> str | None:
  """The collective an async start begins ("all-gather" for all-gather-start; the wrapped op of async-start)."""
  op = instruction["opcode"]
  if op.endswith("-start") and op[:-len("-start")] in KINDS:
    return op[:-len("-start")]
  if op == "async-start":
    for key, callee in callees(instruction):
      for inner in module.get(callee, []) if key == "calls" else []:
        if inner["opcode"] in KINDS:
          return inner["opcode"]
  return None


def overlap(text: str) -> dict[str, dict[str, float]]:
  """Per collective kind, weighted by the trip counts of the loops that run it: `ops` (all), `async` (start /
  done pairs), `overlapped` (pairs with a kernel scheduled between start and done), and the bytes they
  deliver (the done's result) for the same three."""
  module, entry = parse(text)
  if entry is None:
    return {}
  runs = weights(module, entry)
  branches = in_branches(module, entry)
  memo: dict[str, bool] = {}
  out: dict[str, dict[str, float]] = {}
  for name, instructions in module.items():
    w = runs.get(name, 0)
    if not w:
      continue
    always = name not in branches
    for k, instruction in enumerate(instructions):
      row = None
      kind = collective_kind(module, instruction)
      if kind is not None:
        done = next((j for j in range(k + 1, len(instructions)) if instructions[j]["opcode"].endswith("-done")
                     and _operand_names(instructions[j]) & {instruction["name"]}), None)
        row = out.setdefault(kind, _empty())
        nbytes = array_bytes(instructions[done]["type"]) if done is not None else 0
        row["ops"] += w
        row["async"] += w
        row["bytes"] += w * nbytes
        row["async_bytes"] += w * nbytes
        row["always_bytes"] += always * w * nbytes
        sync = '"is_sync":true' in instruction["attrs"]  # XLA chose to run it synchronously
        if done is not None and not sync and any(_is_compute(module, instructions[j], memo)
                                                 for j in range(k + 1, done)):
          row["overlapped"] += w
          row["overlapped_bytes"] += w * nbytes
          row["always_overlapped_bytes"] += always * w * nbytes
      elif instruction["opcode"] in KINDS:
        row = out.setdefault(instruction["opcode"], _empty())
        row["ops"] += w
        row["bytes"] += w * array_bytes(instruction["type"])
        row["always_bytes"] += always * w * array_bytes(instruction["type"])
  return out


def _operand_names(instruction: dict[str, Any]) -> set[str]:
  """The names an instruction reads (with or without the % of older printers; types are words too)."""
  return set(re.findall(r"%?([\w.\-]+)", instruction["operands"]))


def _empty() -> dict[str, float]:
  return dict.fromkeys(("ops", "async", "overlapped", "bytes", "async_bytes", "overlapped_bytes", "always_bytes",
                        "always_overlapped_bytes"), 0.0)


def beside_estimate(overlaps: dict[str, dict[str, float]], communication: dict[str, list[dict[str, Any]]],
                    step_s: float) -> dict[str, Any]:
  """The compiled module's overlap next to the explorer's no-overlap bound: per kind the analytic time, the
  share of its bytes XLA overlaps with compute (all, and outside conditional branches), and the step if the
  share outside branches were hidden entirely (the analytic time counts what always runs: one round of the
  exchange under balanced routing)."""
  analytic: dict[str, float] = {}
  for items in communication.values():
    for item in items:
      analytic[item["collective"]] = analytic.get(item["collective"], 0.0) + item["time_s"]
  rows, hidden = {}, 0.0
  for kind in sorted(set(analytic) | set(overlaps)):
    got = overlaps.get(kind, _empty())
    share = got["overlapped_bytes"] / got["bytes"] if got["bytes"] else 0.0
    always = got["always_overlapped_bytes"] / got["always_bytes"] if got["always_bytes"] else share
    time = analytic.get(kind, 0.0)
    hidden += always * time  # the analytic time is the exchange that always runs (one round, balanced routing)
    rows[kind] = {**got, "overlapped_share": share, "always_overlapped_share": always, "analytic_time_s": time}
  return {"kinds": rows, "step_time_s": step_s, "step_if_overlap_hidden_s": step_s - hidden}
