"""Zero-bubble pipeline orders: the backward of a chunk split into B (its input's cotangent, on the critical path)
and W (its weights' gradients, which nothing waits for), and the orders that fill the bubbles with W.

An order gives each stage a program: instructions run one a tick, in lock step, an instruction in the first tick
in which what it reads has arrived (a forward the tick after the previous virtual stage's forward; a backward the
tick after the next virtual stage's backward, or after its own forward on the last virtual stage; a W after its
B). An instruction holds one op, or a forward and a backward run together (DualPipeV's F&B pairs). Ops:

    f   forward of a chunk                                      cost 1
    b   its input's cotangent only (stashes what W needs)       cost 1
    w   its weights' gradients from the stash                   cost 1
    B   the whole backward (b and w in one)                     cost 2

A tick lasts as long as its busiest stage, so

    bubble = 1 − (work of one stage) / Σ_ticks max_s (cost of stage s's instruction in the tick)

Orders (S stages, M microbatches):

- `zb_h1` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, handcrafted ZB-H1): 1F1B's order with B
  split; stage s runs W of microbatch k − s after B of k, the last s at the end. The memory of 1F1B (stage s
  holds at most S − s stage inputs and s + 1 stashes); bubble (S − 1) / (3M + S − 1).
- `zbv` (ZB-V: the V layout, stage s holding virtual stages s and 2S − 1 − s): built greedily tick by tick, each
  stage running a ready b first (the critical path), else a forward while fewer than `cap` of its chunks are
  between forward and W, else the oldest W; the caps 2S and 2S + 1 are tried and the shorter order kept. Near
  (S − 1) / (6M + S − 1).
- `dualpipev_zb`: DeepSeek's DualPipeV per-rank order (deepseek-ai/DualPipe `dualpipev.py`, its steps 1-8): the
  zero-bubble backwards (b, with their W queued first in, first out) in step 3, in step 6 from its (s + 1)/2-th
  iteration on (the zb switch) and in step 7, the W drain in steps 7 and 8; the other backwards (those of the
  F&B pairs of steps 4 and 5, and the first of step 6) run b then W at once. Every op takes a tick of its own
  (a pair's forward, then its backward), so no tick costs a stage more than 1. DeepSeek refuses M < 2S; here
  the same order runs with the missing microbatches left out.
"""

from __future__ import annotations

import dataclasses

import numpy as np

COST = {"f": 1, "b": 1, "w": 1, "B": 2}
# jaxseek's b recomputes the chunk's forward from its kept input before the input's cotangent: it costs two
RECOMPUTE = {"f": 1, "b": 2, "w": 1, "B": 3}
Op = tuple[str, int, int]  # (kind, chunk, microbatch)


@dataclasses.dataclass(frozen=True)
class Order:
  """A zero-bubble order run in lock step: `ticks[t][s]` the ops stage s runs in tick t, `virtual[s, r]` the
  virtual stage chunk r of stage s is."""

  stages: int
  microbatches: int
  virtual: np.ndarray
  ticks: tuple[tuple[tuple[Op, ...], ...], ...]

  def bubble(self, cost: dict[str, int] = COST) -> float:
    """The share of the step a stage is idle, with `cost` per op (F = b = W = 1 per chunk by default)."""
    return 1 - self.work(cost) / self.span(cost)

  def work(self, cost: dict[str, int] = COST) -> float:
    """A stage's work (the busiest stage's, which all stages share here)."""
    return max(sum(cost[k] for tick in self.ticks for k, _, _ in tick[s]) for s in range(self.stages))

  def span(self, cost: dict[str, int] = COST) -> float:
    """The step's length: each tick as long as its busiest stage's ops."""
    return sum(max(sum(cost[k] for k, _, _ in tick[s]) for s in range(self.stages)) for tick in self.ticks)

  def kept(self) -> dict[str, int]:
    """The most chunks a stage holds at once: between forward and backward (`inputs`, the stage inputs kept
    for the backward's recomputation) and between b and W (`stashes`, what W reads)."""
    inputs = stashes = 0
    for s in range(self.stages):
      open_f, open_w = set(), set()
      for tick in self.ticks:
        for kind, r, m in tick[s]:
          if kind == "f":
            open_f.add((r, m))
          elif kind in ("b", "B"):
            open_f.discard((r, m))
            if kind == "b":
              open_w.add((r, m))
          else:
            open_w.discard((r, m))
        inputs, stashes = max(inputs, len(open_f)), max(stashes, len(open_w))
    return {"inputs": inputs, "stashes": stashes}


def run_programs(S: int, M: int, virtual: np.ndarray, programs: list[list[tuple[Op, ...]]],
                 packed: bool = False) -> Order:
  """Runs each stage's program in lock step: an instruction in the first tick in which everything it reads has
  arrived (sent in an earlier tick). Checks that every chunk of every microbatch runs f, and b then w (or B),
  once. `packed` (for b costing two, `RECOMPUTE`): a lone f or w runs together with the program's next
  instruction when that is a lone op of the other kind that is ready too, so that a tick costs a stage two,
  as a tick of b does."""
  V = virtual.size
  done: dict[tuple[str, int, int], int] = {}  # (f | b | w, microbatch, virtual stage) → tick
  at, t, ticks = [0] * S, 0, []
  while any(at[s] < len(programs[s]) for s in range(S)):
    row = []
    for s in range(S):
      program = programs[s]
      ops = program[at[s]] if at[s] < len(program) else ()
      if ops and all(_ready(op, int(virtual[s, op[1]]), V, done, t) for op in ops):
        at[s] += 1
        if packed and _lone_fw(ops) and at[s] < len(program) and _lone_fw(program[at[s]]) and \
            program[at[s]][0][0] != ops[0][0] and _ready(program[at[s]][0], int(virtual[s, program[at[s]][0][1]]),
                                                       V, done, t):
          ops = ops + program[at[s]]
          at[s] += 1
        row.append(ops)
      else:
        row.append(())
    if not any(row):
      raise AssertionError(f"zero-bubble order deadlocks at tick {t} (S={S}, M={M})")
    for s, ops in enumerate(row):
      for kind, r, m in ops:
        v = int(virtual[s, r])
        for k in ("b", "w") if kind == "B" else (kind,):
          if (k, m, v) in done:
            raise AssertionError(f"{k} of microbatch {m} at virtual stage {v} runs twice")
          done[k, m, v] = t
    ticks.append(tuple(row))
    t += 1
  if len(done) != 3 * M * V:
    raise AssertionError("an order must run f, b and w of every microbatch on every virtual stage once")
  return Order(S, M, virtual, tuple(ticks))


def _lone_fw(ops: tuple[Op, ...]) -> bool:
  return len(ops) == 1 and ops[0][0] in ("f", "w")


def _ready(op: Op, v: int, V: int, done: dict, t: int) -> bool:
  kind, _, m = op
  before = lambda key: key in done and done[key] < t
  if kind == "f":
    return v == 0 or before(("f", m, v - 1))
  if kind in ("b", "B"):
    return before(("f", m, v)) and (v == V - 1 or before(("b", m, v + 1)))
  return before(("b", m, v))


def zb_h1(S: int, M: int, packed: bool = False, stashes: int = 0) -> Order:
  """ZB-H1: 1F1B with the backward split, stage s's W delayed by s microbatches (`packed`: see run_programs);
  with `stashes` > 0 by at most stashes − 1, so that no stage keeps more than `stashes` stashes."""
  programs = []
  for s in range(S):
    delay = s if stashes <= 0 else min(s, stashes - 1)
    warm = min(S - s - 1, M)
    ops: list[tuple[Op, ...]] = [(("f", 0, m),) for m in range(warm)]
    for k in range(M):
      if k + warm < M:
        ops.append((("f", 0, k + warm),))
      ops.append((("b", 0, k),))
      if k >= delay:
        ops.append((("w", 0, k - delay),))
    ops += [(("w", 0, k),) for k in range(max(M - delay, 0), M)]
    programs.append(ops)
  return run_programs(S, M, np.arange(S)[:, None], programs, packed)


def v_placement(S: int) -> np.ndarray:
  """The V: stage s holds virtual stages s and 2S − 1 − s."""
  return np.stack([np.arange(S), 2 * S - 1 - np.arange(S)], axis=1)


def zbv(S: int, M: int, packed: bool = False, stashes: int = 0) -> Order:
  """ZB-V, built greedily (module docstring); the shorter of the caps 2S and 2S + 1. `packed` (b costing two,
  `RECOMPUTE`): a stage without a ready b runs a forward and a W in one tick, as long as a b's. With `stashes`
  > 0 a stage runs no b while it keeps that many stashes (it runs their W first)."""
  cost = RECOMPUTE if packed else COST
  orders = [_greedy_v(S, M, cap, packed, stashes) for cap in (2 * S, 2 * S + 1)]
  return min((o for o in orders if o is not None), key=lambda o: o.span(cost))


def _greedy_v(S: int, M: int, cap: int, packed: bool = False, stashes: int = 0) -> Order | None:
  virtual = v_placement(S)
  V = 2 * S
  done: dict[tuple[str, int, int], int] = {}
  next_f = [[0, 0] for _ in range(S)]
  # a virtual stage's b run in microbatch order (each waits for the next one's b, or for its forward on the last),
  # so the first not yet run is the only one that can be ready
  next_b = [[0, 0] for _ in range(S)]
  waiting_w: list[list[tuple[int, int]]] = [[] for _ in range(S)]
  live = [0] * S
  ticks = []
  t = 0
  while len(done) < 3 * M * V:
    if t > 8 * (M + S) * 3:
      return None  # the cap starves the order
    row = []
    for s in range(S):
      op = None
      for r in (1, 0) if stashes <= 0 or len(waiting_w[s]) < stashes else ():  # a ready b, the later chunk first
        m = next_b[s][r]
        if m < M and _ready(("b", r, m), int(virtual[s, r]), V, done, t):
          op = ("b", r, m)
          break
      if op is None and live[s] < cap:
        for r in (1, 0):
          m = next_f[s][r]
          if m < M and _ready(("f", r, m), int(virtual[s, r]), V, done, t):
            op = ("f", r, m)
            break
      ops = (op,) if op else ()
      if (op is None or (packed and op[0] == "f")) and waiting_w[s]:
        ops += (("w", *waiting_w[s][0]),)
      row.append(ops)
    for s, ops in enumerate(row):
      for kind, r, m in ops:
        done[kind, m, int(virtual[s, r])] = t
        if kind == "f":
          next_f[s][r] += 1
          live[s] += 1
        elif kind == "b":
          next_b[s][r] += 1
          waiting_w[s].append((r, m))
        else:
          waiting_w[s].pop(0)
          live[s] -= 1
    ticks.append(tuple(row))
    t += 1
  return Order(S, M, virtual, tuple(ticks))


def dualpipev_zb(S: int, M: int, fuse: bool = False, packed: bool = False) -> Order:
  """DeepSeek's DualPipeV order with the zero-bubble backwards and the W drain (module docstring). Each op runs
  in a tick of its own, so that every tick costs 1 on every stage: an F&B pair of DeepSeek's steps 4 and 5 runs
  as its forward, then its backward's b, then its w; a whole backward as b then w. With `fuse` a pair's forward
  and b share one tick (to overlap one's all-to-all with the other's compute), its w following; `packed`: see
  run_programs."""
  programs = [_dualpipev_program(S, s, M, fuse) for s in range(S)]
  return run_programs(S, M, v_placement(S), programs, packed)


class _Program:
  """One stage's DualPipeV program as it is written down: each chunk's forwards and backwards take the next
  microbatch (none past M), the W of zero-bubble backwards wait in a queue."""

  def __init__(self, M: int, fuse: bool):
    self.M, self.fuse = M, fuse
    self.counters = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
    self.queue: list[tuple[int, int]] = []  # the W of zero-bubble backwards, first in first out
    self.program: list[tuple[Op, ...]] = []

  def take(self, name):
    m = self.counters[name]
    self.counters[name] += 1
    return m if m < self.M else None

  def f(self, r):
    m = self.take(f"f{r}")
    if m is not None:
      self.program.append((("f", r, m),))

  def b(self, r, zb=False, with_f=None):
    """A backward of chunk r: zero-bubble (b now, its w queued) or whole (b, then w in the next tick);
    `with_f`: the chunk whose forward runs before it (in its tick when fusing)."""
    m_f = self.take(f"f{with_f}") if with_f is not None else None
    m = self.take(f"b{r}")
    ops = [("f", with_f, m_f)] if m_f is not None else []
    if m is not None:
      ops.append(("b", r, m))
    if self.fuse and len(ops) == 2:
      self.program.append(tuple(ops))
    else:
      self.program.extend((op,) for op in ops)
    if m is not None:
      if zb:
        self.queue.append((r, m))
      else:
        self.program.append((("w", r, m),))

  def w(self):
    if self.queue:
      self.program.append((("w", *self.queue.pop(0)),))


def _dualpipev_program(S: int, s: int, M: int, fuse: bool = False) -> list[tuple[Op, ...]]:
  """Stage s's program: DeepSeek's steps 1-8 (module docstring)."""
  n = max(M, 2 * S)  # the order for n ≥ 2S microbatches; those past M are left out
  p = _Program(M, fuse)
  f, b, w = p.f, p.b, p.w
  for _ in range(2 * (S - s - 1)):  # 1: warm-up forwards of chunk 0
    f(0)
  for _ in range(s + 1):  # 2: chunk 0 and 1 in turn
    f(0)
    f(1)
  for _ in range(S - s - 1):  # 3: zero-bubble B1, its W, F1
    b(1, zb=True)
    w()
    f(1)
  for i in range(n - 2 * S + s + 1):  # 4: the steady F0&B1, F1&B0 pairs
    if i == 0 and s == S - 1:  # DeepSeek does not overlap these two on the last stage
      f(0)
      b(1)
    else:
      b(1, with_f=0)
    b(0, with_f=1)
  for _ in range(S - s - 1):  # 5: B1, F1&B0
    b(1)
    b(0, with_f=1)
  zb, switch = False, (s + 1) // 2  # 6: B1, B0; zero-bubble from the zb switch on (odd stages before B1)
  for i in range(s + 1):
    zb = zb or (i == switch and s % 2 == 1)
    b(1, zb)
    zb = zb or (i == switch and s % 2 == 0)
    b(0, zb)
  for _ in range(S - s - 1):  # 7: W, zero-bubble B0
    w()
    b(0, zb=True)
  while p.queue:  # 8: the W drain
    w()
  return p.program
