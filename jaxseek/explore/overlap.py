"""Which collectives XLA overlaps with compute, read from an optimised, scheduled HLO module (`as_text()`).

On a GPU target XLA splits a collective into an async pair, `all-gather-start` … `all-gather-done` (also
all-reduce, collective-permute, and through the generic async wrapper all-to-all, reduce-scatter and
ragged-all-to-all); in a scheduled module the instructions of a computation are listed in the order they run.
A pair overlaps compute when a kernel (a fusion, custom call, dot or convolution, or a while, conditional or
call whose computations launch one) is scheduled between its start and its done in the same computation, and
XLA did not mark it `is_sync` (run synchronously, whatever lies between). What runs every step is also counted
apart (`always_*`): all but the dropless exchange's further rounds, which run only under skew (their ops carry
the frontend attribute `jaxseek_round="further"`, sharding/experts.py).

Each collective is weighted by how often it runs: the product of the `known_trip_count`s of the while loops
whose bodies hold it. A conditional's branches each count as if taken every time (an upper bound: a pipeline
tick's forward runs in some ticks only), except where a branch's ops say what share of the runs takes it
(`jaxseek_share`, set by the pipeline executor on a tick's paired and serial branches: pipeline/executor.py).

That a kernel lies between start and done says nothing of how long it runs: a few small fusions beside a large
exchange hide little of it. Given `Rates` (the device's peak, its memory bandwidth and its links), `overlap`
also estimates what each pair hides (`hidden_bytes`): its bytes × min(1, the time of the kernels between
start and done / the time of the transfer). A kernel's time is the larger of its matmul FLOPs at peak (dots in
fusions, and GEMM custom calls sized from their operands; on float8 operands at the float8 peak) and the bytes
it reads and writes at the memory
bandwidth; a while loop's body counts its trip count times, a conditional its longest branch. The transfer's
time is the bytes the done delivers over the link its device groups use (within a node of `per_node` devices,
or across nodes); for a ragged exchange the smaller of its send and receive buffers (the receive buffer of a
dispatch has room for more than arrives).
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import numpy as np

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
_SHARE = re.compile(r'jaxseek_share="([\d.e+-]+)"')  # pipeline/executor.py SHARE
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_IOTA = re.compile(r"\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))? \{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)")
_LIST_GROUPS = re.compile(r"(replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}")
FURTHER = 'jaxseek_round="further"'  # the exchange's further rounds (sharding/experts.py FURTHER)
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_FLOAT = ("f64", "f32", "bf16", "f16", "f8e4m3fn", "f8e5m2")


class Rates(NamedTuple):
  """What `overlap` times kernels and transfers with: FLOP/s at peak, memory bytes/s, link bytes/s within a node
  and across nodes, and the devices of a node (device ids node-major)."""

  flops: float
  memory: float
  intra_node: float
  inter_node: float
  per_node: int
  fp8_flops: float = 0.0  # FLOP/s of GEMMs on float8 operands (0: as `flops`)


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


def weights(module: dict[str, list[dict[str, Any]]], entry: str) -> dict[str, float]:
  """How many times each computation runs per execution of `entry` (while bodies × their trip counts; a
  conditional's branch × the share its ops carry, where the conditional carries none itself)."""
  out = {entry: 1}
  stack = [entry]
  while stack:
    caller = stack.pop()
    for instruction in module.get(caller, []):
      trips = _TRIP.search(instruction["attrs"])
      own_share = _SHARE.search(instruction["attrs"]) is not None
      for key, callee in callees(instruction):
        if callee not in module or instruction["opcode"] == "async-start":
          continue  # an async wrapper's computation is its start / done pair, counted there
        n = out[caller] * (int(trips.group(1)) if trips and key in ("body", "condition") else 1)
        if key in ("branch", "true_computation", "false_computation") and not own_share:
          n *= branch_share(module[callee])
        out[callee] = out.get(callee, 0) + n
        stack.append(callee)
  return out


def branch_share(instructions: list[dict[str, Any]]) -> float:
  """The share of its conditional's runs a branch computation takes: the `jaxseek_share` its ops carry (1: every
  run, an upper bound, where none does)."""
  for instruction in instructions:
    found = _SHARE.search(instruction["attrs"])
    if found:
      return float(found.group(1))
  return 1.0


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


def overlap(text: str, rates: Rates | None = None) -> dict[str, dict[str, float]]:
  """Per collective kind, weighted by the trip counts of the loops that run it: `ops` (all), `async` (start /
  done pairs), `overlapped` (pairs with a kernel scheduled between start and done), and the bytes they
  deliver (the done's result) for the same three; with `rates`, also the bytes the kernels between start and
  done are estimated to hide (`hidden_bytes`, `always_hidden_bytes`)."""
  module, entry = parse(text)
  if entry is None:
    return {}
  runs = weights(module, entry)
  timer = _Timer(module, rates) if rates else None
  memo: dict[str, bool] = {}
  out: dict[str, dict[str, float]] = {}
  for name, instructions in module.items():
    w = runs.get(name, 0)
    if not w:
      continue
    for k, instruction in enumerate(instructions):
      kind = collective_kind(module, instruction)
      always = (kind or instruction["opcode"] in KINDS) and _every_step(module, instruction)
      if kind is not None:
        row = out.setdefault(kind, _empty())
        nbytes, between = _pair(module, instructions, k, memo)
        hidden = nbytes * timer.hidden(name, instruction, between, nbytes) if timer and between else 0.0
        for key, value in (("ops", 1), ("async", 1), ("bytes", nbytes), ("async_bytes", nbytes),
                           ("overlapped", bool(between)), ("overlapped_bytes", nbytes * bool(between)),
                           ("hidden_bytes", hidden)):
          row[key] += w * value
          if key.endswith("bytes") and f"always_{key}" in row:
            row[f"always_{key}"] += always * w * value
      elif instruction["opcode"] in KINDS:
        row = out.setdefault(instruction["opcode"], _empty())
        row["ops"] += w
        row["bytes"] += w * array_bytes(instruction["type"])
        row["always_bytes"] += always * w * array_bytes(instruction["type"])
  return out


def _every_step(module, instruction: dict[str, Any]) -> bool:
  """Whether a collective runs every step: not one of the dropless exchange's further rounds (marked on it, or
  on the collective an async-start wraps)."""
  wrapped = [i["attrs"] for _, c in callees(instruction) for i in module.get(c, [])] \
      if instruction["opcode"] == "async-start" else []
  return not any(FURTHER in attrs for attrs in (instruction["attrs"], *wrapped))


def _pair(module, instructions: list[dict[str, Any]], k: int, memo: dict[str, bool]) -> tuple[int, list]:
  """(the bytes the done of the async start at `k` delivers, the kernels scheduled between start and done; none
  when XLA runs the pair synchronously)."""
  done = next((j for j in range(k + 1, len(instructions)) if instructions[j]["opcode"].endswith("-done")
               and _operand_names(instructions[j]) & {instructions[k]["name"]}), None)
  if done is None:
    return 0, []
  if '"is_sync":true' in instructions[k]["attrs"]:  # XLA chose to run it synchronously
    return array_bytes(instructions[done]["type"]), []
  between = [i for i in instructions[k + 1:done] if _is_compute(module, i, memo)]
  return array_bytes(instructions[done]["type"]), between


class _Timer:
  """Estimated seconds of the kernels and transfers of a parsed module (the module docstring says how)."""

  def __init__(self, module: dict[str, list[dict[str, Any]]], rates: Rates):
    self.module, self.rates = module, rates
    self.types = {c: {i["name"]: i["type"] for i in ins} for c, ins in module.items()}
    self.memo: dict[str, float] = {}

  def transfer(self, start: dict[str, Any], nbytes: int) -> float:
    """Seconds of the transfer an async start begins, whose done delivers `nbytes` (a ragged exchange: what is
    sent, not the buffer it lands in)."""
    if collective_kind(self.module, start) == "ragged-all-to-all":
      first = _ARRAY.search(start["type"])
      nbytes = min(nbytes, array_bytes(first.group(0))) if first else nbytes
    return nbytes / self.link(start)

  def hidden(self, computation: str, start: dict[str, Any], between: list, nbytes: int) -> float:
    """The share of the transfer started by `start` that the kernels `between` cover."""
    transfer = self.transfer(start, nbytes)
    window = sum(self.kernel(computation, i) for i in between)
    return min(1.0, window / transfer) if transfer > 0 else 1.0

  def link(self, start: dict[str, Any]) -> float:
    attrs = start["attrs"] + "".join(i["attrs"] for _, c in callees(start) for i in self.module.get(c, []))
    groups = device_groups(attrs) or []
    n = self.rates.per_node
    spans = any(min(g) // n != max(g) // n for g in groups if g)
    return self.rates.inter_node if spans else self.rates.intra_node

  def kernel(self, computation: str, instruction: dict[str, Any]) -> float:
    op = instruction["opcode"]
    if op in CALLERS:
      times = [self.body(c) for key, c in callees(instruction) if key != "condition" and c in self.module]
      trips = _TRIP.search(instruction["attrs"])
      if op == "conditional":
        return max(times, default=0.0)
      return (int(trips.group(1)) if trips and op == "while" else 1) * sum(times)
    if op not in COMPUTE:
      return 0.0
    # the output written and as much read: a slice of a large operand reads only what it writes
    memory = 2 * self.written(computation, instruction) / self.rates.memory
    flops, f8 = self.flops(computation, instruction), self.flops(computation, instruction, f8_only=True)
    return max((flops - f8) / self.rates.flops + f8 / (self.rates.fp8_flops or self.rates.flops), memory)

  def written(self, computation: str, instruction: dict[str, Any]) -> int:
    """Bytes a kernel writes: its output, or only the update where a fusion updates a slice in place."""
    for key, c in callees(instruction):
      root = self.module.get(c, [None])[-1] if key == "calls" else None
      if root and root["opcode"] == "dynamic-update-slice":
        update = re.findall(r"%?([\w.\-]+)", root["operands"])[1:2]
        return array_bytes(self.types[c].get(update[0], "")) if update else 0
    return array_bytes(instruction["type"])

  def body(self, computation: str) -> float:
    if computation not in self.memo:
      self.memo[computation] = 0.0
      self.memo[computation] = sum(self.kernel(computation, i) for i in self.module[computation])
    return self.memo[computation]

  def flops(self, computation: str, instruction: dict[str, Any], f8_only: bool = False) -> float:
    """The matmul FLOPs of a dot, a GEMM custom call or a fusion's dots (`f8_only`: of those on float8)."""
    op, types = instruction["opcode"], self.types[computation]
    operands = re.findall(r"%?([\w.\-]+)", instruction["operands"])
    if op == "fusion":
      return sum(self.flops(c, i, f8_only) for key, c in callees(instruction) if key == "calls" and c in self.module
                 for i in self.module[c] if i["opcode"] in ("dot", "fusion"))
    if f8_only and not self.on_f8(computation, instruction):
      return 0.0
    if op == "dot" and operands:
      lhs = _dims(types.get(operands[0], ""))
      contracting = _CONTRACTING.search(instruction["attrs"])
      k = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting and lhs else 0
      return 2.0 * math.prod(_dims(instruction["type"]) or [0]) * k
    if op == "custom-call":  # a GEMM [M, N] = [M, K] · [(G,) K, N]: K from the float operand that has M
      first = _ARRAY.search(instruction["type"])  # (a tuple's first element: cuDNN adds its workspace)
      out = _dims(first.group(0)) if first else []
      inputs = [_dims(types.get(name, ""), floats_only=True) for name in operands]
      floats = [d for d in inputs if len(d) == 2]
      if len(out) == 2:
        for dims in floats:
          if out[0] in dims:
            return 2.0 * out[0] * out[1] * dims[1 - dims.index(out[0])]
      batched = [d for d in inputs if len(d) == 3]
      if len(out) == 3 and batched and batched[0][:2] == out[:2]:  # [B, M, N] = [B, M, K] · [B, N, K] (scaled dot)
        return 2.0 * math.prod(out) * batched[0][2]
      if len(out) == 3 and len(floats) >= 2 and floats[0][0] == floats[1][0] and out[1:] == [floats[0][1],
                                                                                          floats[1][1]]:
        return 2.0 * floats[0][0] * out[1] * out[2]  # a grouped weight gradient [G, K, N] = Σ_groups [M, K]ᵀ [M, N]
    return 0.0


  def on_f8(self, computation: str, instruction: dict[str, Any]) -> bool:
    """Whether an instruction reads float8 operands."""
    return any(self.types[computation].get(name, "").lstrip("(").startswith("f8")
               for name in _operand_names(instruction))


def _dims(type_: str, floats_only: bool = False) -> list[int]:
  """The dimensions of an HLO array type (empty for a tuple, or a non-float one with `floats_only`)."""
  found = _ARRAY.findall(type_)
  if len(found) != 1 or (floats_only and found[0][0] not in _FLOAT) or type_.lstrip().startswith("("):
    return []
  return [int(d) for d in found[0][1].split(",") if d]


def _operand_names(instruction: dict[str, Any]) -> set[str]:
  """The names an instruction reads (with or without the % of older printers; types are words too)."""
  return set(re.findall(r"%?([\w.\-]+)", instruction["operands"]))


def _empty() -> dict[str, float]:
  return dict.fromkeys(("ops", "async", "overlapped", "bytes", "async_bytes", "overlapped_bytes", "hidden_bytes",
                        "always_bytes", "always_overlapped_bytes", "always_hidden_bytes"), 0.0)


def analytic_profile(text: str, rates: Rates) -> str:
  """Op costs of a compiled module for XLA's latency-hiding scheduler (PGLE's ProfiledInstructionsProto as text,
  train.pgle_profile): each async collective's start costs its transfer on the link its groups use, each kernel
  (fusion, custom call) its time at `rates` (the overlap estimate's timings), at least 1 µs. Instruction names
  are the module's, which a compile of the same program and options gives again."""
  module, _ = parse(text)
  timer, memo, lines, seen = _Timer(module, rates), {}, [], set()
  for computation, instructions in module.items():
    for k, instruction in enumerate(instructions):
      name = instruction["name"]
      if name in seen:
        continue
      if collective_kind(module, instruction) is not None:
        nbytes = _pair(module, instructions, k, memo)[0]
        seconds = timer.transfer(instruction, nbytes)
      elif instruction["opcode"] in ("fusion", "custom-call"):
        seconds = max(timer.kernel(computation, instruction), 1e-6)
      else:
        continue
      seen.add(name)
      lines.append(f'costs {{ name: "{name}" cost_us: {seconds * 1e6:.3f} }}')
  return "\n".join(lines) + "\n"


def beside_estimate(overlaps: dict[str, dict[str, float]], communication: dict[str, list[dict[str, Any]]],
                    step_s: float) -> dict[str, Any]:
  """The compiled module's overlap next to the explorer's no-overlap bound: per kind the analytic time, the
  share of its bytes XLA overlaps with compute (all, and of what runs every step), the share the kernels
  beside them are estimated to hide (`hidden_share`, `always_hidden_share`: overlap's Rates), and two steps:
  with every overlapped pair that runs every step hidden entirely (`step_if_overlap_hidden_s`, a bound), and with
  what the kernels beside them can hide (`step_if_estimate_hidden_s`). The analytic time counts what always
  runs: one round of the exchange under balanced routing."""
  analytic: dict[str, float] = {}
  for items in communication.values():
    for item in items:
      analytic[item["collective"]] = analytic.get(item["collective"], 0.0) + item["time_s"]
  rows, bound, estimate = {}, 0.0, 0.0
  share = lambda part, whole: got[part] / got[whole] if got[whole] else 0.0
  for kind in sorted(set(analytic) | set(overlaps)):
    got = {**_empty(), **overlaps.get(kind, {})}
    always = share("always_overlapped_bytes", "always_bytes") if got["always_bytes"] else \
        share("overlapped_bytes", "bytes")
    time = analytic.get(kind, 0.0)
    bound += always * time
    estimate += (share("always_hidden_bytes", "always_bytes") if got["always_bytes"] else
                 share("hidden_bytes", "bytes")) * time
    rows[kind] = {**got, "overlapped_share": share("overlapped_bytes", "bytes"), "always_overlapped_share": always,
                  "hidden_share": share("hidden_bytes", "bytes"),
                  "always_hidden_share": share("always_hidden_bytes", "always_bytes"), "analytic_time_s": time}
  return {"kinds": rows, "step_time_s": step_s, "step_if_overlap_hidden_s": step_s - bound,
          "step_if_estimate_hidden_s": step_s - estimate}


def device_groups(line: str) -> list[list[int]] | None:
  """Device groups from replica_groups (list, iota or mesh form) or collective-permute source → target pairs."""
  match = _MESH_GROUPS.search(line)
  if match:
    names, sizes = zip(*((k.strip("'"), int(v)) for k, v in (p.split("=") for p in match.group(1).split(","))))
    ids = _iota(match.group(2)) if match.group(2) else np.arange(int(np.prod(sizes)))
    grid = ids.reshape(sizes)
    grouped = [names.index(a.strip().strip("'")) for a in match.group(3).split(",") if a.strip()]
    kept = [i for i in range(len(sizes)) if i not in grouped]
    return np.transpose(grid, kept + grouped).reshape(-1, int(np.prod([sizes[i] for i in grouped]))).tolist()
  match = _IOTA_GROUPS.search(line)
  if match:
    return _iota(match.group(3)).reshape(int(match.group(1)), int(match.group(2))).tolist()
  match = _LIST_GROUPS.search(line)
  if match:
    groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", match.group(2))]
    return [g for g in groups if g] or [[0]]
  return None


def _iota(text: str) -> np.ndarray:
  """The device list of an iota form "[d0,d1,...]T(p0,p1,...)": arange reshaped, transposed, flattened."""
  match = _IOTA.fullmatch(text.strip())
  dims = [int(x) for x in match.group(1).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if match.group(2):
    ids = ids.transpose([int(x) for x in match.group(2).split(",")])
  return ids.reshape(-1)
