"""Pipeline schedules as tables: which microbatch and chunk each stage runs forward and backward at each tick.

A tick is one lock-step round of the pipeline: every stage runs at most one forward (F) and one backward (B) of
a chunk of its layers, then passes activations one stage on and cotangents one stage back. Stage s holds chunks
r = 0 … R − 1 (virtual stage v = r·S + s; R = 1 without interleaving). Work item k of a stage is microbatch
m = g·S + i in round r, with k = g·R·S + r·S + i (microbatches go round in groups of S, as in the circular
schedule), so the forward of item k runs on stage s at tick s + k and its output reaches virtual stage v + 1 at
the next tick.

1F1B: the last virtual stage runs the loss and the backward of a microbatch in the tick of its forward, and the
backward of virtual stage v runs RS − 1 − v ticks later, so cotangents flow back one stage a tick while new
forwards still flow in: after a warm-up, every stage runs one forward and one backward each tick, and a stage
keeps the inputs of at most 2·R·S − 1 items (2S − 1 without interleaving) alive — bounded by the stage count,
not by the number of microbatches. Ticks with no work in a slot skip it (a conditional), so the schedule costs

    (F + B) · (M + S − 1)  for 1F1B, as GPipe does, but holds 2S − 1 microbatches instead of M + S − 1.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Table:
  """Per tick and stage ([ticks, S] int32, −1 where the slot is empty): the forward's microbatch and chunk, the
  backward's microbatch and chunk, and the buffer slot of the stage input each one writes or reads."""

  stages: int
  microbatches: int
  repeats: int
  f_micro: np.ndarray
  f_chunk: np.ndarray
  f_slot: np.ndarray
  b_micro: np.ndarray
  b_chunk: np.ndarray
  b_slot: np.ndarray
  slots: int  # stage inputs a stage keeps (the buffer's length)

  @property
  def ticks(self) -> int:
    return self.f_micro.shape[0]

  def bubble(self, backward_cost: float = 2.0) -> float:
    """The share of the schedule's time a stage is idle, with a forward costing 1 and a backward
    `backward_cost`: a tick lasts as long as the busiest stage's work in it."""
    per_stage = (self.f_micro >= 0) + backward_cost * (self.b_micro >= 0)  # [ticks, S]
    total = per_stage.max(axis=1).sum()
    return float(1 - per_stage.sum(axis=0).max() / total)


def work_items(S: int, M: int, R: int) -> list[tuple[int, int]]:
  """(microbatch, round) of each work item k of a stage, in order; None entries are bubbles of a partial group."""
  groups = -(-M // S)
  items = []
  for k in range(groups * R * S):
    g, rest = divmod(k, R * S)
    r, i = divmod(rest, S)
    m = g * S + i
    items.append((m, r) if m < M else None)
  return items


def one_f_one_b(S: int, M: int, R: int = 1) -> Table:
  """The 1F1B table (interleaved over R chunks per stage when R > 1)."""
  items = work_items(S, M, R)
  last = {m: k for k, item in enumerate(items) if item is not None for m, r in [item] if r == R - 1}
  f_tick = {}  # (m, r, s) → tick
  b_tick = {}
  for s in range(S):
    for k, item in enumerate(items):
      if item is None:
        continue
      m, r = item
      f_tick[m, r, s] = s + k
      b_tick[m, r, s] = (S - 1 + last[m]) + (R * S - 1 - (r * S + s))
  ticks = max(b_tick.values()) + 1
  slots = max(b_tick[key] - f_tick[key] for key in f_tick) + 1
  table = {name: np.full((ticks, S), -1, np.int32) for name in ("fm", "fr", "fs", "bm", "br", "bs")}
  for s in range(S):
    for k, item in enumerate(items):
      if item is None:
        continue
      m, r = item
      t_f, t_b = f_tick[m, r, s], b_tick[m, r, s]
      if table["fm"][t_f, s] >= 0 or table["bm"][t_b, s] >= 0:
        raise AssertionError(f"two items in one slot at stage {s}")  # the construction rules this out
      table["fm"][t_f, s], table["fr"][t_f, s], table["fs"][t_f, s] = m, r, k % slots
      table["bm"][t_b, s], table["br"][t_b, s], table["bs"][t_b, s] = m, r, k % slots
  return Table(S, M, R, table["fm"], table["fr"], table["fs"], table["bm"], table["br"], table["bs"], slots)
