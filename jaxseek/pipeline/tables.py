"""Pipeline schedules as tables: which microbatch and chunk each stage runs forward and backward at each tick.

A tick is one lock-step round of the pipeline: every stage runs at most one forward (F) and one backward (B) of
a chunk of its layers (or, in a zero-bubble table, one op: F, b or W), then passes activations and cotangents
to the stages that need them next. Stage s holds chunks r = 0 … R − 1, each one virtual stage v of the V = S·R a
microbatch goes through in order; the batch enters at virtual stage 0 and the loss follows virtual stage V − 1.
What arrives waits in a stage's buffers (its slot chosen by the table) until the tick that uses it: a stage
input stays there until its backward has read it (the backward recomputes the chunk's layers from it), a
cotangent until its backward runs.

1F1B (`one_f_one_b`; ring placement v = r·S + s): the last virtual stage runs the loss and the backward of a
microbatch in the tick of its forward, and the backward of virtual stage v runs R·S − 1 − v ticks later, so
cotangents flow back one stage a tick while new forwards still flow in: after a warm-up every stage runs one
forward and one backward each tick, and keeps fewer than 2·R·S stage inputs, bounded by the stage count, not
by the number of microbatches M (virtual stage 0 keeps none: it recomputes the embedding from the batch). Ticks
with no work in a slot skip it (a conditional).

Zero-bubble tables (`from_order`: ZB-H1, ZB-V and DeepSeek's DualPipeV, built in pipeline/zero_bubble.py) split
the backward in two: b computes the cotangent of the chunk's input (what the previous virtual stage waits for)
and stashes what W reads, W the chunk's weight gradients later (pipeline/wsplit.py, exactly, each matmul once),
in the ticks 1F1B leaves idle. Stashes wait in their own slots from b to W. A tick runs one op on a stage.

    bubble = 1 − (work of one stage) / Σ_ticks max_s (work of stage s in the tick)
             F = 1, B = 2 per chunk (F = b = W = 1 in a zero-bubble table)

pipeline/executor.py runs a table.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
from typing import NamedTuple

import numpy as np

from jaxseek.pipeline import zero_bubble

LOSS, READ, LATE = 0.3, 0.5, 0.9  # where in a tick a buffer is written or read (the executor's order)
STASH_WRITE, STASH_READ = 0.6, 0.8  # b writes its stash after the tick's reads; W reads it after that
RESIDUAL_WRITE = 0.2  # F writes the forward's residuals (train.pipeline_recompute=false) before the loss
SPLIT = ("zb_h1", "zbv", "dualpipev")  # the train.pipeline_schedule values whose tables split the backward
# the table schedules whose backward stays whole: with train.pipeline_recompute=false their tables keep the
# forward's residuals and run b and W of a chunk in one tick (`one_f_one_b`)
WHOLE_BACKWARD = ("1f1b", "interleaved_1f1b")
V_SHAPED = ("zbv", "dualpipev")  # two chunks a stage on a V (stage s: virtual stages s and 2S − 1 − s)


class Route(NamedTuple):
  """One collective of a tick's sends (Table.routes): stage s sends to s + offset mod S over `pairs`."""

  offset: int
  pairs: tuple[tuple[int, int], ...]
  kinds: tuple[str, ...]  # "f" (the forward's output), "b" (the input's cotangent), in this order in its payload
  active: np.ndarray  # [ticks] bool: some stage receives by it


@dataclasses.dataclass(frozen=True)
class Table:
  """A schedule for S stages, M microbatches, R chunks per stage. `steps` holds [ticks, S] int32 columns, −1
  where nothing happens: f_micro / f_chunk / f_slot (the forward, and the buffer slot of its input), b_micro /
  b_chunk / b_slot / b_grad (the backward, its stage input's slot and its cotangent's slot), loss_grad (where
  the loss's cotangent goes, in the tick of a last virtual stage's forward), and per link offset d (a stage s
  sends to s + d mod S) f_in{d} / b_in{d}: the slot an arriving activation or cotangent is stored in. A table
  that splits the backward (`split`) also has b_stash (the slot b's stash goes to) and w_micro / w_chunk /
  w_stash (the W, and the stash it reads). A split table that keeps the forward's residuals for b
  (`residual_slots` > 0, train.pipeline_recompute=false) has f_residual / b_residual: the slot F writes them
  to and b reads them from, for every virtual stage (the first too)."""

  stages: int
  microbatches: int
  repeats: int
  virtual: np.ndarray  # [S, R]: the virtual stage chunk r of stage s is
  steps: dict[str, np.ndarray]
  slots: int  # stage inputs a stage keeps (the buffer's length)
  grad_slots: int  # cotangents waiting for their backward
  links: dict[str, dict[int, tuple[tuple[int, int], ...]]]  # "f" / "b" → offset → (sender, receiver) pairs
  stash_slots: int = 0  # stashes waiting for their W (0: the backward is whole)
  residual_slots: int = 0  # forward residuals waiting for their b (0: b recomputes the chunk's forward)

  ticks = property(lambda self: self.steps["f_micro"].shape[0])
  f_micro = property(lambda self: self.steps["f_micro"])
  f_chunk = property(lambda self: self.steps["f_chunk"])
  f_slot = property(lambda self: self.steps["f_slot"])
  b_micro = property(lambda self: self.steps["b_micro"])
  b_chunk = property(lambda self: self.steps["b_chunk"])
  split = property(lambda self: "w_micro" in self.steps)

  def bubble(self, cost: dict[str, float] | None = None) -> float:
    """The share of the schedule's time a stage is idle, with `cost` per op ("f", "b", "w"): a tick lasts as long
    as the busiest stage's work in it. By default what the executor runs costs: a forward 1, a whole backward 2
    (1F1B's bubble is the same for any ratio); in a split table b 2 (it recomputes the chunk's forward before
    the input's cotangent) and W 1 (zero_bubble.RECOMPUTE), or F = b = W = 1 where F keeps the forward's
    residuals for b (zero_bubble.COST)."""
    if cost is None:
      cost = (zero_bubble.COST if self.residual_slots else zero_bubble.RECOMPUTE) if self.split else {"f": 1, "b": 2}
    per_stage = cost["f"] * (self.f_micro >= 0) + cost["b"] * (self.b_micro >= 0)  # [ticks, S]
    if self.split:
      per_stage = per_stage + cost["w"] * (self.steps["w_micro"] >= 0)
    total = per_stage.max(axis=1).sum()
    return float(1 - per_stage.sum(axis=0).max() / total)

  def paired(self) -> np.ndarray:
    """[ticks, S] bool: where a stage's tick runs a forward and a backward that do not wait for each other (the
    backward's cotangent is not the loss of this tick's forward), so the executor can run them side by side in one
    program (train.pipeline_overlap). Split tables run one op a tick: never."""
    if self.split:
      return np.zeros(self.f_micro.shape, bool)
    loss, grad = self.steps["loss_grad"], self.steps["b_grad"]
    return (self.f_micro >= 0) & (self.b_micro >= 0) & ~((loss >= 0) & (grad == loss))

  def routes(self) -> list[Route]:
    """How a tick's sends travel, one collective each: per link offset d and its (sender, receiver) pairs, the
    kinds that go by it ("f" activations, "b" cotangents; both where they share the pairs, as on the V: down to
    s + 1, up to s − 1) and the ticks in which some stage receives by it. Offset 0 (the V's turn) moves
    nothing between stages."""
    by_pairs: dict[tuple, list[str]] = {}
    for kind in ("f", "b"):
      for d, pairs in self.links[kind].items():
        by_pairs.setdefault((d, pairs), []).append(kind)
    return [Route(d, pairs, tuple(kinds),
                  np.logical_or.reduce([(self.steps[f"{k}_in{d}"] >= 0).any(axis=1) for k in kinds]))
            for (d, pairs), kinds in sorted(by_pairs.items())]

  def kept(self) -> dict[str, int]:
    """What a stage's buffers hold: stage inputs, cotangents, (split tables) stashes and (kept residuals)
    forward residuals, in chunks."""
    return {"inputs": self.slots, "cotangents": self.grad_slots, "stashes": self.stash_slots,
            **({"residuals": self.residual_slots} if self.residual_slots else {})}


def pairs(cfg) -> bool:
  """Whether the executor pairs a tick's forward and backward (train.pipeline_overlap)."""
  return bool(cfg.train.pipeline_overlap) and cfg.train.pipeline_schedule in ("1f1b", "interleaved_1f1b")


def for_config(cfg, S: int, R: int) -> Table:
  """The table `train.pipeline_schedule` names, for S stages and a stack that makes R rounds (with
  train.pipeline_overlap, each backward a tick after the loss)."""
  t = cfg.train
  return table(t.pipeline_schedule, S, t.microbatches, R, t.pipeline_stashes, t.pipeline_recompute,
               paired=pairs(cfg))


@functools.lru_cache(maxsize=128)  # the explorer asks for every table schedule per layout it plans (never mutated)
def table(name: str, S: int, M: int, R: int, stashes: int = 0, recompute: bool = True,
          paired: bool = False) -> Table:
  """The table of schedule `name` (a train.pipeline_schedule value) for S stages, M microbatches, R rounds;
  `recompute`: b recomputes the chunk's forward (split orders packed for b costing two), else F keeps the
  forward's residuals for b (split: the unit orders, F = b = W = 1; 1F1B: b and W in one tick); `paired` (1F1B): each backward a tick after
  the loss, so the last stage's ticks pair too. Any other name (gpipe, circular: no table) raises ValueError."""
  if name in SPLIT:
    return from_order(zero_bubble_order(name, S, M, packed=recompute, stashes=stashes), kept=not recompute)
  if name in WHOLE_BACKWARD:
    return one_f_one_b(S, M, R, delay=int(paired), kept=not recompute)
  raise ValueError(f"no table for schedule {name!r}; the table schedules are 1f1b, interleaved_1f1b, "
                   f"{', '.join(SPLIT)}")


@functools.lru_cache(maxsize=64)  # built greedily (seconds at S = 16, M = 60); the explorer asks again per layout
def zero_bubble_order(name: str, S: int, M: int, packed: bool = True, stashes: int = 0) -> zero_bubble.Order:
  """The order of a zero-bubble schedule; `packed` (what the step runs): built for b costing two, F and W
  sharing the ticks without a b (zero_bubble.RECOMPUTE), else for F = b = W = 1. `stashes` caps what a stage
  keeps for its W (zb_h1, zbv); 0: S for zbv (a stash holds half a stage's activations, so S of them half of
  what 1F1B without recomputation keeps; unbounded its step is 3% shorter at S = 4, M = 16, its compiled
  temp memory 1.4x larger), and for zb_h1 the fewest with which its step is as short as it gets (packed,
  delaying W does not shorten it: one stash)."""
  if name == "dualpipev":
    return zero_bubble.dualpipev_zb(S, M, packed=packed)
  if name == "zbv":
    return zero_bubble.zbv(S, M, packed=packed, stashes=stashes or S)
  if name != "zb_h1":
    raise ValueError(f"no zero-bubble order named {name!r}; the split schedules are {', '.join(SPLIT)}")
  if stashes:
    return zero_bubble.zb_h1(S, M, packed=packed, stashes=stashes)
  cost = zero_bubble.RECOMPUTE if packed else zero_bubble.COST
  orders = [zero_bubble.zb_h1(S, M, packed=packed, stashes=k) for k in range(1, S + 1)]
  return min(orders, key=lambda o: (o.span(cost), o.kept()["stashes"]))


def dualpipev(S: int, M: int) -> Table:
  """DeepSeek's DualPipeV order (zero_bubble.dualpipev_zb) as the table the step runs."""
  return from_order(zero_bubble_order("dualpipev", S, M))


def work_items(S: int, M: int, R: int) -> list[tuple[int, int] | None]:
  """(microbatch, round) of each work item k of a stage, in order; None entries are bubbles of a partial group."""
  groups = -(-M // S)
  items = []
  for k in range(groups * R * S):
    g, rest = divmod(k, R * S)
    r, i = divmod(rest, S)
    m = g * S + i
    items.append((m, r) if m < M else None)
  return items


def one_f_one_b(S: int, M: int, R: int = 1, delay: int = 0, kept: bool = False) -> Table:
  """The 1F1B table (interleaved over R chunks per stage when R > 1). Work item k = g·R·S + r·S + i of a stage
  is microbatch g·S + i in round r (microbatches go round in groups of S, as in the circular schedule); its
  forward runs on stage s at tick s + k, and its backward `delay` ticks after the last virtual stage has run the
  loss. With delay 1 (train.pipeline_overlap) the last stage runs a microbatch's backward beside the next one's
  forward instead of after it in the same tick, so every stage's steady ticks pair a forward with a backward that
  does not wait for it (`Table.paired`), for one tick more and a stage input and a cotangent more kept. `kept`
  (train.pipeline_recompute=false): the forward keeps its residuals for the backward, which then recomputes
  nothing and runs as b and W in the same tick (the split table's columns, W in b's tick)."""
  items = work_items(S, M, R)
  last = {m: k for k, item in enumerate(items) if item is not None for m, r in [item] if r == R - 1}
  f_tick, b_tick = {}, {}  # (m, v) → tick
  for s in range(S):
    for k, item in enumerate(items):
      if item is not None:
        m, r = item
        f_tick[m, r * S + s] = s + k
        b_tick[m, r * S + s] = (S - 1 + last[m]) + delay + (R * S - 1 - (r * S + s))
  virtual = np.arange(R)[None, :] * S + np.arange(S)[:, None]
  return build(S, M, R, virtual, f_tick, b_tick, dict(b_tick) if kept else None, kept)


def from_order(order: zero_bubble.Order, kept: bool = False) -> Table:
  """The table of a zero-bubble order (pipeline/zero_bubble.py): its f, b and W ticks, a whole backward (B) as b
  and W in one tick; `kept`: F keeps the forward's residuals for b."""
  ticks: dict[str, dict] = {"f": {}, "b": {}, "w": {}}
  for t, row in enumerate(order.ticks):
    for s, ops in enumerate(row):
      for kind, r, m in ops:
        for k in ("b", "w") if kind == "B" else (kind,):
          ticks[k][m, int(order.virtual[s, r])] = t
  S, R = order.virtual.shape
  return build(S, order.microbatches, R, order.virtual, ticks["f"], ticks["b"], ticks["w"], kept)


def build(S: int, M: int, R: int, virtual: np.ndarray, f_tick: dict, b_tick: dict,
          w_tick: dict | None = None, kept: bool = False) -> Table:
  """The table of a schedule given when each (microbatch, virtual stage) runs forward and backward (and, with
  `w_tick`, its W: then the backward is b only): checks it (every forward and backward once, after what it
  reads; one of each per stage and tick; a W after its b), then chooses buffer slots (a stage input from its
  arrival to its backward, a cotangent from its arrival to its backward, a stash from its b to its W, and with
  `kept` the forward's residuals from F to b)."""
  V = S * R
  place = {int(virtual[s, r]): (s, r) for s in range(S) for r in range(R)}
  if sorted(place) != list(range(V)) or set(f_tick) != set(b_tick) or len(f_tick) != M * V or (
      w_tick is not None and set(w_tick) != set(f_tick)):
    raise AssertionError("a schedule must run every microbatch through every virtual stage once")
  ticks = max([*b_tick.values(), *(w_tick or {}).values()]) + 1
  names = ["f_micro", "f_chunk", "f_slot", "b_micro", "b_chunk", "b_slot", "b_grad", "loss_grad"]
  names += ["b_stash", "w_micro", "w_chunk", "w_stash"] if w_tick is not None else []
  names += ["f_residual", "b_residual"] if kept else []
  steps = {name: np.full((ticks, S), -1, np.int32) for name in names}
  inputs, grads, stashes, residuals = ([[] for _ in range(S)] for _ in range(4))  # per stage: (start, end, key)
  for (m, v), t_f in f_tick.items():
    t_b, (s, r) = b_tick[m, v], place[v]
    sent = f_tick[m, v - 1] if v else None
    after = b_tick[m, v + 1] if v < V - 1 else None
    if (sent is not None and sent >= t_f) or (after is not None and after >= t_b) or t_b < t_f or (
        w_tick is not None and w_tick[m, v] < t_b):
      raise AssertionError(f"microbatch {m} at virtual stage {v} runs before its input or cotangent arrives")
    for kind, t in (("f", t_f), ("b", t_b), *((("w", w_tick[m, v]),) if w_tick is not None else ())):
      if steps[f"{kind}_micro"][t, s] >= 0:
        raise AssertionError(f"two {kind} at stage {s}, tick {t}")
      steps[f"{kind}_micro"][t, s], steps[f"{kind}_chunk"][t, s] = m, r
    if v:  # virtual stage 0 recomputes its input from the batch; with `kept` b reads the residuals instead
      inputs[s].append((sent + LATE, (t_f if kept else t_b) + READ, (m, v)))
    grads[s].append((t_f + LOSS if after is None else after + LATE, t_b + READ, (m, v)))
    if w_tick is not None:
      stashes[s].append((t_b + STASH_WRITE, w_tick[m, v] + STASH_READ, (m, v)))
    if kept:
      residuals[s].append((t_f + RESIDUAL_WRITE, t_b + READ, (m, v)))
  slot, grad_slot, stash_slot, residual_slot = (collections.defaultdict(int, _colour(inputs)), _colour(grads),
                                                 _colour(stashes), _colour(residuals))
  links = {"f": {}, "b": {}}
  for (m, v), t_f in f_tick.items():
    s, t_b = place[v][0], b_tick[m, v]
    steps["f_slot"][t_f, s] = slot[m, v]
    steps["b_slot"][t_b, s], steps["b_grad"][t_b, s] = slot[m, v], grad_slot[m, v]
    if w_tick is not None:
      steps["b_stash"][t_b, s] = steps["w_stash"][w_tick[m, v], s] = stash_slot[m, v]
    if kept:
      steps["f_residual"][t_f, s] = steps["b_residual"][t_b, s] = residual_slot[m, v]
    if v == V - 1:
      steps["loss_grad"][t_f, s] = grad_slot[m, v]
    for kind, t, w, table in (("f", t_f, v + 1, slot), ("b", t_b, v - 1, grad_slot)):
      if 0 <= w < V:  # the output goes to virtual stage w, on stage `to`: stored there at the end of the tick
        to = place[w][0]
        d = (to - s) % S
        links[kind].setdefault(d, set()).add((s, to))
        _column(steps, f"{kind}_in{d}", (ticks, S))[t, to] = table[m, w]
  links = {k: {d: tuple(sorted(p)) for d, p in sorted(by.items())} for k, by in links.items()}
  return Table(S, M, R, np.asarray(virtual, np.int32), steps, 1 + max(slot.values(), default=0),
               1 + max(grad_slot.values()), links, 1 + max(stash_slot.values()) if stash_slot else 0,
               1 + max(residual_slot.values()) if residual_slot else 0)


def _column(steps: dict[str, np.ndarray], name: str, shape: tuple[int, int]) -> np.ndarray:
  """steps[name], made (−1 everywhere) the first time; not setdefault, which would build an array every call."""
  if name not in steps:
    steps[name] = np.full(shape, -1, np.int32)
  return steps[name]


def _colour(intervals: list[list[tuple[float, float, tuple]]]) -> dict:
  """A slot for each interval (start, end, key), per stage, so that no two live at once share one (the fewest
  slots: interval graphs colour greedily in order of start)."""
  slot = {}
  for stage in intervals:
    free, busy, n = [], [], 0
    for start, end, key in sorted(stage):
      while busy and busy[0][0] < start:
        heapq.heappush(free, heapq.heappop(busy)[1])
      s = heapq.heappop(free) if free else n
      n = max(n, s + 1)
      slot[key] = s
      heapq.heappush(busy, (end, s))
  return slot
