"""The data-iterator state: exact resume with the same layout, re-split resume when the layout changes.

Each source is read as one endless stream of shuffled chunks; data shard i of n reads positions
start + i, start + i + n, ... and every row remembers the highest position it holds. The state of this
process's iterator is

  {"data": what is read (source fingerprints, seed, seq_len), "layout": which rows this process makes,
   "starts": per source, where the streams began, "frontier": per source, the highest position emitted,
   "pipeline": the grain pipeline's own state}

Same data and layout: `set_state(state)` restores the grain state, and the batches that follow are exactly
those of an uninterrupted run. Other layout (process count, batch size, data.pack_bins, data.worker_count):
`set_state([state of every old process])` restarts every stream at 1 + the highest position any old process
emitted, so nothing is read twice; the chunks at lower positions that some old process had read but not yet
emitted (its packing and prefetch buffers, and the spread between processes) are skipped for this epoch.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import grain

from jaxseek.errors import UserError

LayoutT = dict[str, int]


class PipelineIterator(grain.DatasetIterator):
  """Local batches of `build(starts)` (an IterDataset, see pipeline.make_dataset) without the tracking keys,
  with the state described above."""

  def __init__(self, build: Callable[[list[int]], grain.IterDataset], num_sources: int, data: dict, layout: LayoutT,
               batch_keys: tuple[str, ...]):
    super().__init__()
    self.build, self.data, self.layout, self.batch_keys = build, data, layout, batch_keys
    self._finalizer = None
    self._restart([0] * num_sources)

  def _restart(self, starts: list[int]) -> None:
    self.close()
    self._closed = False
    self.starts = [int(s) for s in starts]
    self.frontier = [s - 1 for s in self.starts]
    self._pipeline = [iter(self.build(self.starts))]
    # Closed and dropped when this iterator is collected or, at the latest, at interpreter exit: grain's prefetch
    # iterators fail in __del__ once modules are torn down.
    self._finalizer = weakref.finalize(self, _release, self._pipeline)

  @property
  def _inner(self) -> grain.DatasetIterator:
    return self._pipeline[0]

  def __next__(self) -> dict[str, Any]:
    batch = next(self._inner)
    for source, index in zip(batch["_source"].tolist(), batch["_index"].tolist()):
      self.frontier[source] = max(self.frontier[source], index)
    return {k: batch[k] for k in self.batch_keys}

  def get_state(self) -> dict[str, Any]:
    return {"data": self.data, "layout": self.layout, "starts": list(self.starts), "frontier": list(self.frontier),
            "pipeline": self._inner.get_state()}

  def set_state(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
    """Exact restore from this process's state (alone, or among the states of all old processes); otherwise a
    re-split restart from the states of all old processes (a single state is all of them when it was alone)."""
    states = state if isinstance(state, list) else [state]
    for s in states:
      self._check_data(s)
    mine = [s for s in states if s["layout"] == self.layout]
    if mine:
      if mine[0]["starts"] != self.starts:
        self._restart(mine[0]["starts"])
      self._inner.set_state(mine[0]["pipeline"])
      self.frontier = list(mine[0]["frontier"])
      return
    count = states[0]["layout"]["shard_count"]
    shards = sorted({s["layout"]["shard_index"] for s in states})
    if shards != list(range(count)) or any(s["layout"]["shard_count"] != count for s in states):
      raise UserError(f"the data-iterator state was saved with layout {states[0]['layout']}, this run has "
                      f"{self.layout}; to re-split, pass set_state the states of all {count} old data shards "
                      f"(got shards {shards})")
    self._restart([max(max(s["frontier"][i] + 1, s["starts"][i]) for s in states) for i in range(len(self.starts))])

  def _check_data(self, state: dict[str, Any]) -> None:
    if not isinstance(state, dict) or "data" not in state:
      raise UserError("the data-iterator state is not one that jaxseek's pipeline saved; start without it")
    if state["data"] != self.data:
      changed = sorted(k for k in self.data if state["data"].get(k) != self.data[k])
      raise UserError(f"the data-iterator state was saved for other data ({', '.join(changed)} differ); "
                      f"restore with the data.source, data.seed and train.seq_len it was saved with, or start "
                      f"without the data state")

  def start_prefetch(self) -> None:
    self._inner.start_prefetch()

  def close(self) -> None:
    self._closed = True
    if self._finalizer is not None:
      self._finalizer()


def _release(pipeline: list[grain.DatasetIterator]) -> None:
  for it in pipeline:
    it.close()
  pipeline.clear()
