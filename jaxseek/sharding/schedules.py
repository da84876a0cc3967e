"""Pipeline schedules as tables: which microbatch and chunk each stage runs forward and backward at each tick.

A tick is one lock-step round of the pipeline: every stage runs at most one forward (F) and one backward (B) of
a chunk of its layers, then passes activations and cotangents to the stages that need them next. Stage s holds
chunks r = 0 … R − 1, each one virtual stage v of the V = S·R a microbatch goes through in order; the batch
enters at virtual stage 0 and the loss follows virtual stage V − 1. What arrives waits in a stage's buffers (its
slot chosen by the table) until the tick that uses it: a stage input stays there until its backward has read it
(the backward recomputes the chunk's layers from it), a cotangent until its backward runs.

1F1B (`one_f_one_b`; ring placement v = r·S + s): the last virtual stage runs the loss and the backward of a
microbatch in the tick of its forward, and the backward of virtual stage v runs R·S − 1 − v ticks later, so
cotangents flow back one stage a tick while new forwards still flow in: after a warm-up every stage runs one
forward and one backward each tick, and keeps fewer than 2·R·S stage inputs, bounded by the stage count, not
by the number of microbatches M (virtual stage 0 keeps none: it recomputes the embedding from the batch). Ticks with no work in a slot skip it (a conditional).

DualPipeV (`dualpipev`; V placement: stage s holds virtual stages s and 2S − 1 − s, so the batch enters and
the loss runs on stage 0): DeepSeek's cut-in-half DualPipe order. Each stage runs its program of forwards of
chunk 0 and 1, then pairs a forward of one chunk with a backward of the other (F0·B1, F1·B0) in the same tick,
then drains the backwards; a tick runs an instruction once what it reads has arrived. Chunks are half a
stage's layers, so fill and drain cost half as much as 1F1B's at the same stage count.

    bubble = 1 − (work of one stage) / Σ_ticks max_s (work of stage s in the tick),  F = 1, B = 2 per chunk
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxseek.sharding.pipeline import AXIS

LOSS, READ, LATE = 0.3, 0.5, 0.9  # where in a tick a buffer is written or read (the executor's order)


@dataclasses.dataclass(frozen=True)
class Table:
  """A schedule for S stages, M microbatches, R chunks per stage. `steps` holds [ticks, S] int32 columns, −1
  where nothing happens: f_micro / f_chunk / f_slot (the forward, and the buffer slot of its input), b_micro /
  b_chunk / b_slot / b_grad (the backward, its stage input's slot and its cotangent's slot), loss_grad (where
  the loss's cotangent goes, in the tick of a last virtual stage's forward), fused (1 where the forward and
  the backward run in one branch), and per link offset d (a stage s sends to s + d mod S) f_in{d} / b_in{d}:
  the slot an arriving activation or cotangent is stored in."""

  stages: int
  microbatches: int
  repeats: int
  virtual: np.ndarray  # [S, R]: the virtual stage chunk r of stage s is
  steps: dict[str, np.ndarray]
  slots: int  # stage inputs a stage keeps (the buffer's length)
  grad_slots: int  # cotangents waiting for their backward
  links: dict[str, dict[int, tuple[tuple[int, int], ...]]]  # "f" / "b" → offset → (sender, receiver) pairs

  ticks = property(lambda self: self.steps["f_micro"].shape[0])
  f_micro = property(lambda self: self.steps["f_micro"])
  f_chunk = property(lambda self: self.steps["f_chunk"])
  f_slot = property(lambda self: self.steps["f_slot"])
  b_micro = property(lambda self: self.steps["b_micro"])
  b_chunk = property(lambda self: self.steps["b_chunk"])

  def bubble(self, backward_cost: float = 2.0) -> float:
    """The share of the schedule's time a stage is idle, with a chunk's forward costing 1 and its backward
    `backward_cost`: a tick lasts as long as the busiest stage's work in it."""
    per_stage = (self.f_micro >= 0) + backward_cost * (self.b_micro >= 0)  # [ticks, S]
    total = per_stage.max(axis=1).sum()
    return float(1 - per_stage.sum(axis=0).max() / total)


def for_config(cfg, S: int, R: int) -> Table:
  """The table `train.pipeline_schedule` names, for S stages and a stack that makes R rounds."""
  M = cfg.train.microbatches
  return dualpipev(S, M) if cfg.train.pipeline_schedule == "dualpipev" else one_f_one_b(S, M, R)


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


def one_f_one_b(S: int, M: int, R: int = 1) -> Table:
  """The 1F1B table (interleaved over R chunks per stage when R > 1). Work item k = g·R·S + r·S + i of a stage
  is microbatch g·S + i in round r (microbatches go round in groups of S, as in the circular schedule); its
  forward runs on stage s at tick s + k, and its backward once the last virtual stage has run the loss."""
  items = work_items(S, M, R)
  last = {m: k for k, item in enumerate(items) if item is not None for m, r in [item] if r == R - 1}
  f_tick, b_tick = {}, {}  # (m, v) → tick
  for s in range(S):
    for k, item in enumerate(items):
      if item is not None:
        m, r = item
        f_tick[m, r * S + s] = s + k
        b_tick[m, r * S + s] = (S - 1 + last[m]) + (R * S - 1 - (r * S + s))
  virtual = np.arange(R)[None, :] * S + np.arange(S)[:, None]
  return build(S, M, R, virtual, f_tick, b_tick)


def dualpipev(S: int, M: int) -> Table:
  """The DualPipeV table: each stage's program (`dualpipev_program`) run in lock step, an instruction in the
  first tick in which everything it reads has arrived."""
  virtual = np.stack([np.arange(S), 2 * S - 1 - np.arange(S)], axis=1)
  programs = [dualpipev_program(S, s, M) for s in range(S)]
  f_tick, b_tick, at, t = {}, {}, [0] * S, 0
  while any(at[s] < len(programs[s]) for s in range(S)):
    done = []
    for s in range(S):
      if at[s] == len(programs[s]):
        continue
      ops, ran_f = programs[s][at[s]], {}
      for kind, r, m in ops:
        v = int(virtual[s, r])
        if kind == "f":
          ready = v == 0 or f_tick.get((m, v - 1), t) < t
          ran_f[m, v] = t
        else:  # the loss's cotangent is there in its forward's tick; others arrive a tick after they are sent
          ready = (f_tick.get((m, v), ran_f.get((m, v), t + 1)) <= t if v == 2 * S - 1 else
                   b_tick.get((m, v + 1), t) < t)
        if not ready:
          break
      else:
        done.append((s, ops))
    if not done:
      raise AssertionError(f"DualPipeV order deadlocks at tick {t} (S={S}, M={M})")
    for s, ops in done:
      for kind, r, m in ops:
        (f_tick if kind == "f" else b_tick)[m, int(virtual[s, r])] = t
      at[s] += 1
    t += 1
  return build(S, M, 2, virtual, f_tick, b_tick, fuse=True)


def dualpipev_program(S: int, s: int, M: int) -> list[tuple[tuple[str, int, int], ...]]:
  """Stage s's DualPipeV instructions in order, each one tick's ops (kind "f" | "b", chunk, microbatch). The
  order is DeepSeek's for at least 2S microbatches (warm-up forwards of chunk 0, then chunk 0 and 1 in turn,
  F1·B1, the steady F0·B1 / F1·B0 pairs, then the drain), with a backward that also computes the weight
  gradient (no separate W pass). Fewer microbatches run the same order with the missing ones left out."""
  n = max(M, 2 * S)
  f0, f1, b1, b0 = ("f", 0), ("f", 1), ("b", 1), ("b", 0)
  order = [(f0,)] * (2 * (S - s - 1)) + [(f0,), (f1,)] * (s + 1) + [(f1, b1)] * (S - s - 1)
  for i in range(n - 2 * S + s + 1):
    order += [(f0,), (b1,)] if i == 0 and s == S - 1 else [(f0, b1)]
    order += [(f1, b0)]
  order += [(b1,), (f1, b0)] * (S - s - 1) + [(b1,), (b0,)] * (s + 1) + [(b0,)] * (S - s - 1)
  count, program = {}, []
  for ops in order:
    numbered = []
    for op in ops:
      m = count[op] = count.get(op, -1) + 1
      if m < M:
        numbered.append((*op, m))
    if numbered:
      program.append(tuple(numbered))
  return program


def build(S: int, M: int, R: int, virtual: np.ndarray, f_tick: dict, b_tick: dict, fuse: bool = False) -> Table:
  """The table of a schedule given when each (microbatch, virtual stage) runs forward and backward: checks it
  (every forward and backward once, after what it reads; one of each per stage and tick), then chooses buffer
  slots (a stage input from its arrival to its backward, a cotangent from its arrival to its backward). With
  `fuse`, column `fused` marks the ticks whose forward and backward are independent (the backward's cotangent
  is not the loss of this tick's forward): the executor runs those two in one branch, so that XLA may overlap
  one's collectives with the other's compute."""
  V = S * R
  place = {int(virtual[s, r]): (s, r) for s in range(S) for r in range(R)}
  if sorted(place) != list(range(V)) or set(f_tick) != set(b_tick) or len(f_tick) != M * V:
    raise AssertionError("a schedule must run every microbatch through every virtual stage once")
  ticks = max(b_tick.values()) + 1
  steps = {name: np.full((ticks, S), -1, np.int32)
           for name in ("f_micro", "f_chunk", "f_slot", "b_micro", "b_chunk", "b_slot", "b_grad", "loss_grad")}
  inputs, grads = [[] for _ in range(S)], [[] for _ in range(S)]  # per stage: (start, end, key)
  for (m, v), t_f in f_tick.items():
    t_b, (s, r) = b_tick[m, v], place[v]
    sent = f_tick[m, v - 1] if v else None
    after = b_tick[m, v + 1] if v < V - 1 else None
    if (sent is not None and sent >= t_f) or (after is not None and after >= t_b) or t_b < t_f:
      raise AssertionError(f"microbatch {m} at virtual stage {v} runs before its input or cotangent arrives")
    for kind, t in (("f", t_f), ("b", t_b)):
      if steps[f"{kind}_micro"][t, s] >= 0:
        raise AssertionError(f"two {kind} at stage {s}, tick {t}")
      steps[f"{kind}_micro"][t, s], steps[f"{kind}_chunk"][t, s] = m, r
    if v:  # virtual stage 0 recomputes its input from the batch
      inputs[s].append((sent + LATE, t_b + READ, (m, v)))
    grads[s].append((t_f + LOSS if after is None else after + LATE, t_b + READ, (m, v)))
  slot, grad_slot = collections.defaultdict(int, _colour(inputs)), _colour(grads)
  links = {"f": {}, "b": {}}
  for (m, v), t_f in f_tick.items():
    s, t_b = place[v][0], b_tick[m, v]
    steps["f_slot"][t_f, s] = slot[m, v]
    steps["b_slot"][t_b, s], steps["b_grad"][t_b, s] = slot[m, v], grad_slot[m, v]
    if v == V - 1:
      steps["loss_grad"][t_f, s] = grad_slot[m, v]
    for kind, t, w, table in (("f", t_f, v + 1, slot), ("b", t_b, v - 1, grad_slot)):
      if 0 <= w < V:  # the output goes to virtual stage w, on stage `to`: stored there at the end of the tick
        to = place[w][0]
        d = (to - s) % S
        links[kind].setdefault(d, set()).add((s, to))
        column = steps.setdefault(f"{kind}_in{d}", np.full((ticks, S), -1, np.int32))
        column[t, to] = table[m, w]
  steps["fused"] = np.zeros((ticks, S), np.int32)
  for (m, v), t_b in b_tick.items() if fuse else ():
    s = place[v][0]
    if steps["f_micro"][t_b, s] >= 0 and not (v == V - 1 and f_tick[m, v] == t_b):
      steps["fused"][t_b, s] = 1
  links = {k: {d: tuple(sorted(p)) for d, p in sorted(by.items())} for k, by in links.items()}
  return Table(S, M, R, np.asarray(virtual, np.int32), steps, 1 + max(slot.values(), default=0),
               1 + max(grad_slot.values()), links)


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


def run(table: Table, first_fn: Callable, stage_fn: Callable, post_fn: Callable, stage_params, stage_consts,
        rest_params, batch_M, side_M, aux_cotangent: dict[str, float], per_row: tuple[str, ...],
        unsplit: tuple[bool, ...] | None = None):
  """The forward and backward of the whole model, its pipelined stack interleaved as `table` says.

  first_fn(rest_params, batch_b) → x_bTD is the model before the pipelined stack for one microbatch (embedding
  and the layers before it), run with virtual stage 0 on its stage; stage_fn(x_bTD, chunk_params, chunk_consts,
  side_b) → (y_bTD, aux) runs one chunk of C layers (`stage_params` and `stage_consts` leaves are [L, ...] in
  storage order, sharded on `pipeline`: stage s stores its chunks r = 0 … R − 1 in order; aux leaves lead with
  C); post_fn(rest_params, y_bTD, batch_b) → (value, stats) is the rest of the objective for one microbatch
  (already multiplied by the loss scale), run after the last virtual stage on its stage. `unsplit` marks the
  rest's leaves no automatic mesh axis splits (all when None): only those share the flat accumulator of
  `RestGrads` (a split one would be resharded to be laid into it). `batch_M` and `side_M`
  are per-microbatch trees [M, b, ...]. Each aux entry k enters the objective as aux_cotangent[k] · its sum (0
  when absent); entries named in `per_row` are per-sequence [C, b] and are summed over rows here.

  Returns (g_stage_params, g_rest_params, stats summed over microbatches, aux summed over microbatches
  [L, ...]). Virtual stage 0 keeps no hidden state for its backward: it recomputes first_fn from the batch.
  """
  R = table.repeats

  def per_stage(sp, sc, rp, batch_M, side_M, aux_cotangent):
    stage = _Stage(table, first_fn, stage_fn, post_fn, sp, sc, rp, batch_M, side_M, aux_cotangent, per_row,
                   unsplit)
    carry, _ = jax.lax.scan(stage.tick, stage.init(), jnp.arange(table.ticks))
    _, _, g_sp, g_rp, stats, aux_acc = carry
    shared = lambda tree: jax.tree.map(lambda a: a[None], tree)  # one stage holds each: summed outside
    rows = lambda tree: jax.tree.map(lambda a: a.reshape(R * a.shape[1], *a.shape[2:]), tree)  # [R, C] → rows
    return rows(g_sp), shared(stage.layout.tree(g_rp, stage.s)), shared(stats), rows(aux_acc)

  g_sp, g_rp, stats, aux = jax.shard_map(
      per_stage, in_specs=(P(AXIS), P(AXIS), P(), P(), P(), P()), out_specs=P(AXIS), axis_names={AXIS},
      check_vma=False)(stage_params, stage_consts, rest_params, batch_M, side_M, aux_cotangent)
  total = lambda tree: jax.tree.map(lambda a: a.sum(0), tree)
  return g_sp, total(g_rp), total(stats), aux


def used_leaves(fn: Callable, params, *args) -> tuple[bool, ...]:
  """For each leaf of `params`, whether fn(params, *args) reads it (traced once, abstractly)."""
  leaves, treedef = jax.tree.flatten(params)
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), (leaves, args))
  jaxpr = jax.make_jaxpr(lambda ls, rest: fn(jax.tree.unflatten(treedef, ls), *rest))(*abstract).jaxpr
  read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
  return tuple(id(v) in read for v in jaxpr.invars[:len(leaves)])


class RestGrads:
  """Where a stage accumulates the float32 gradients of the weights outside the pipelined stack (the rest).

  The first virtual stage's part (the embedding, the layers before the stack) runs on one stage and the last
  virtual stage's part (the layers after it, the head, MTP) on another, except in the V of DualPipeV, where
  both run on stage 0. Every stage holds the same buffers (one program), so the accumulator of the leaves only
  one part reads is one flat float32 buffer as long as the larger part: the first part's stage accumulates its
  leaves there and the last part's stage its own (at offsets of their own). Leaves both parts read (the
  embedding, which MTP reads too) keep a whole accumulator, as do leaves an automatic mesh axis splits (tensor,
  fsdp: laying them into the flat buffer would move data); leaves neither reads get none. With both parts on
  one stage every leaf keeps a whole accumulator."""

  def __init__(self, table: Table, rest_params, first_used: tuple[bool, ...], post_used: tuple[bool, ...],
               unsplit: tuple[bool, ...] | None = None):
    leaves, self.treedef = jax.tree.flatten(rest_params)
    unsplit = (True,) * len(leaves) if unsplit is None else unsplit
    self.shapes = [(a.shape, a.dtype) for a in leaves]
    V = table.stages * table.repeats
    self.first_stage = int(np.argwhere(table.virtual == 0)[0][0])
    self.post_stage = int(np.argwhere(table.virtual == V - 1)[0][0])
    self.first_used = [i for i, u in enumerate(first_used) if u]
    self.post_used = [i for i, u in enumerate(post_used) if u]
    split = self.first_stage != self.post_stage
    self.whole = [i for i in range(len(leaves)) if (first_used[i] or post_used[i]) and
                  ((first_used[i] and post_used[i]) or not split or not unsplit[i])]
    self.offset: dict[tuple[str, int], int] = {}  # (part, leaf) → offset in the flat buffer
    self.size = 0
    for part, used in (("first", first_used), ("post", post_used)):
      at = 0
      for i, u in enumerate(used):
        if u and i not in self.whole:
          self.offset[part, i] = at
          at += int(np.prod(self.shapes[i][0]))
      self.size = max(self.size, at)

  def init(self):
    return ([jnp.zeros(self.shapes[i][0], jnp.float32) for i in self.whole], jnp.zeros((self.size,), jnp.float32))

  def add(self, acc, part: str, grads: list[jax.Array]):
    """acc plus the gradients of the leaves `part` ("first" or "post") reads, in the order of `used(part)`."""
    whole, flat = acc
    whole = list(whole)
    for i, g in zip(self.used(part), grads):
      if i in self.whole:
        k = self.whole.index(i)
        whole[k] = whole[k] + g.astype(jnp.float32)
      else:
        at, n = self.offset[part, i], g.size
        flat = jax.lax.dynamic_update_slice(flat, jax.lax.dynamic_slice(flat, (at,), (n,)) +
                                            g.reshape(-1).astype(jnp.float32), (at,))
    return whole, flat

  def used(self, part: str) -> list[int]:
    return self.first_used if part == "first" else self.post_used

  def tree(self, acc, stage):
    """The gradient tree on `stage` (zeros where it ran neither part), float32."""
    whole, flat = acc
    out = []
    for i, (shape, _) in enumerate(self.shapes):
      g = jnp.zeros(shape, jnp.float32)
      if i in self.whole:
        g = whole[self.whole.index(i)]
      for part, on in (("first", self.first_stage), ("post", self.post_stage)):
        if (part, i) in self.offset:
          at = self.offset[part, i]
          g = jnp.where(stage == on, flat[at:at + int(np.prod(shape))].reshape(shape), g)
      out.append(g)
    return jax.tree.unflatten(self.treedef, out)

  def with_leaves(self, rest_params, part: str, values: list[jax.Array]):
    """`rest_params` with the leaves `part` reads replaced by `values` (the ones differentiated)."""
    leaves = list(jax.tree.leaves(rest_params))
    for i, v in zip(self.used(part), values):
      leaves[i] = v
    return jax.tree.unflatten(self.treedef, leaves)

  def read(self, rest_params, part: str) -> list[jax.Array]:
    leaves = jax.tree.leaves(rest_params)
    return [leaves[i] for i in self.used(part)]


def _zeros(tree):
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def _put(buf: jax.Array, i, value: jax.Array, when) -> jax.Array:
  return buf.at[i].set(jnp.where(when, value, buf[i]))


class _Stage:
  """What one stage runs inside `run`'s shard_map (its own parameters and the whole batch's microbatches): the
  tick of the schedule and its parts. The scan's carry is (stage-input buffer, cotangent buffer, chunk
  gradients [R, C, ...], gradients of the rest of the model, loss stats, aux [R, C, ...])."""

  def __init__(self, table: Table, first_fn, stage_fn, post_fn, sp, sc, rp, batch_M, side_M, aux_cotangent,
               per_row, unsplit=None):
    self.table, self.first_fn, self.stage_fn, self.post_fn = table, first_fn, stage_fn, post_fn
    self.rp, self.batch_M, self.side_M, self.aux_cotangent = rp, batch_M, side_M, aux_cotangent
    self.s = jax.lax.axis_index(AXIS)
    self.steps = {k: jnp.asarray(v) for k, v in table.steps.items()}
    self.virtual = jnp.asarray(table.virtual)
    self.fusing = bool(table.steps["fused"].any())
    by_chunk = lambda tree: jax.tree.map(lambda a: a.reshape(table.repeats, -1, *a.shape[1:]), tree)
    self.sp_R, self.sc_R = by_chunk(sp), by_chunk(sc)
    self.x_shape = jax.eval_shape(lambda: first_fn(rp, _at(batch_M, 0)))
    self.y_shape, self.aux_shape = jax.eval_shape(self.forward, jnp.zeros(self.x_shape.shape, self.x_shape.dtype),
                                                  0, 0)
    self.rows = {k: k in per_row for k in self.aux_shape}
    self.stats_shape = jax.eval_shape(
        lambda: post_fn(rp, jnp.zeros(self.y_shape.shape, self.y_shape.dtype), _at(batch_M, 0))[1])
    y = jax.ShapeDtypeStruct(self.y_shape.shape, self.y_shape.dtype)
    self.layout = RestGrads(table, rp, used_leaves(first_fn, rp, _at(batch_M, 0)),
                            used_leaves(lambda p, h, mb: post_fn(p, h, mb)[0], rp, y, _at(batch_M, 0)), unsplit)

  def chunk(self, x, p, r, m):
    return self.stage_fn(x, p, _at(self.sc_R, r), _at(self.side_M, m))

  def first(self, m):
    return self.first_fn(self.rp, _at(self.batch_M, m))

  def forward(self, x, r, m):
    """Chunk r on microbatch m; on virtual stage 0 from the batch (first_fn), else from `x`."""
    with jax.named_scope("pipeline_forward"):  # names the ops in HLO and profiles
      return jax.lax.cond(self.virtual[self.s, r] == 0, lambda: self.chunk(self.first(m), _at(self.sp_R, r), r, m),
                          lambda: self.chunk(x, _at(self.sp_R, r), r, m))

  def backward(self, x, r, m, g_y, g_rp):
    """(cotangent of the chunk's input, the chunk's gradient, g_rp plus first_fn's gradient on virtual stage 0),
    the chunk recomputed from its kept input (or from the batch)."""
    def vjp(f, *primals):
      (_, aux), pull = jax.vjp(f, *primals)
      return pull((g_y, {k: _cotangent(a, self.aux_cotangent.get(k, 0.0)) for k, a in aux.items()}))

    def first():
      mb, lay = _at(self.batch_M, m), self.layout
      g_first, g_chunk = vjp(lambda q, p: self.chunk(self.first_fn(lay.with_leaves(self.rp, "first", q), mb), p, r, m),
                             lay.read(self.rp, "first"), _at(self.sp_R, r))
      return jnp.zeros(self.y_shape.shape, self.y_shape.dtype), g_chunk, lay.add(g_rp, "first", g_first)

    def later():
      return (*vjp(lambda x, p: self.chunk(x, p, r, m), x, _at(self.sp_R, r)), g_rp)

    with jax.named_scope("pipeline_backward"):
      return jax.lax.cond(self.virtual[self.s, r] == 0, first, later)

  def post_grad(self, y, m, g_rp):
    """The loss of microbatch m after the last virtual stage: (its cotangent, g_rp plus its gradient, stats)."""
    lay = self.layout
    (_, stats), vjp = _vjp_with_aux(lambda q, h, mb: self.post_fn(lay.with_leaves(self.rp, "post", q), h, mb),
                                    lay.read(self.rp, "post"), y, _at(self.batch_M, m))
    g, g_y = vjp(jnp.ones((), jnp.float32))
    return g_y, lay.add(g_rp, "post", g), stats

  def send(self, kind: str, value: jax.Array, buf: jax.Array, t) -> jax.Array:
    """`value` to every stage that receives by a link of `kind`, stored in the slot the table names."""
    for d, pairs in self.table.links[kind].items():
      got = value if d == 0 else jax.lax.ppermute(value, AXIS, list(pairs))
      slot = self.steps[f"{kind}_in{d}"][t, self.s]
      buf = _put(buf, jnp.maximum(slot, 0), got, slot >= 0)
    return buf

  def init(self):
    summed = jax.eval_shape(lambda: self.summed(_zeros(self.aux_shape)))
    table, x = self.table, self.x_shape
    return (jnp.zeros((table.slots, *x.shape), x.dtype), jnp.zeros((table.grad_slots, *x.shape), x.dtype),
            _zeros(self.sp_R), self.layout.init(),
            _zeros(self.stats_shape), jax.tree.map(lambda a: jnp.zeros((table.repeats, *a.shape), a.dtype), summed))

  def summed(self, aux):
    return {k: a.sum(-1) if self.rows[k] else a for k, a in aux.items()}

  def tick(self, carry, t):
    """One tick: the forward (with the backward when the table fuses them), the loss where a microbatch leaves
    the last virtual stage, the backward, then the sends."""
    buf, grads, g_sp, g_rp, stats, aux_acc = carry
    fm, fr, fs, bm, br, bs, bg, lg, fused = (self.steps[k][t, self.s] for k in (
        "f_micro", "f_chunk", "f_slot", "b_micro", "b_chunk", "b_slot", "b_grad", "loss_grad", "fused"))
    has_f, has_b, has_loss, fused = fm >= 0, bm >= 0, lg >= 0, fused > 0
    fm, fr, fs, bm, br, bs, bg, lg = (jnp.maximum(v, 0) for v in (fm, fr, fs, bm, br, bs, bg, lg))
    no_f = lambda: _zeros((self.y_shape, self.aux_shape))
    no_b = lambda g_rp: (*_zeros((self.y_shape, _at(self.sp_R, 0))), g_rp)
    run_f = lambda: self.forward(buf[fs], fr, fm)
    # reads the buffers as they are when called: before this tick's writes in the fused branch, after them alone
    run_b = lambda g_rp: self.backward(buf[bs], br, bm, grads[bg], g_rp)
    if self.fusing:  # independent F and B in one branch (one computation XLA schedules as a whole)
      (y, aux), (g_xb, g_chunk, g_rp) = jax.lax.switch(
          jnp.where(fused, 2, has_f.astype(jnp.int32)),
          [lambda g: (no_f(), no_b(g)), lambda g: (run_f(), no_b(g)), lambda g: (run_f(), run_b(g))], g_rp)
    else:
      y, aux = jax.lax.cond(has_f, run_f, no_f)
    aux_acc = jax.tree.map(lambda acc, a: acc.at[fr].add(jnp.where(has_f, a, jnp.zeros((), a.dtype))), aux_acc,
                           self.summed(aux))
    # the microbatch leaves the last virtual stage: its loss, and the cotangent its backward starts from
    g_y, g_rp, stats_m = jax.lax.cond(has_loss, lambda g: self.post_grad(y, fm, g),
                                      lambda g: (_zeros(self.y_shape), g, _zeros(self.stats_shape)), g_rp)
    grads = _put(grads, lg, g_y, has_loss)
    stats = jax.tree.map(jnp.add, stats, stats_m)
    if self.fusing:  # the backwards not run with the forward (those that read this tick's loss, or alone)
      late = jax.lax.cond(has_b & ~fused, run_b, no_b, g_rp)
      g_xb, g_chunk, g_rp = jax.tree.map(lambda a, b: jnp.where(fused, a, b), (g_xb, g_chunk, g_rp), late)
    else:
      g_xb, g_chunk, g_rp = jax.lax.cond(has_b, run_b, no_b, g_rp)
    g_sp = jax.tree.map(lambda acc, g: acc.at[br].add(g), g_sp, g_chunk)
    buf, grads = self.send("f", y, buf, t), self.send("b", g_xb, grads, t)
    return (buf, grads, g_sp, g_rp, stats, aux_acc), None


def _at(tree, i):
  return jax.tree.map(lambda a: a[i], tree)


def _vjp_with_aux(fn, params, h, inputs):
  """((value, stats), vjp) of fn(params, h, inputs) → (value, stats), differentiating value in params and h.
  The stats are outputs of the differentiated function with zero cotangents, not auxiliary outputs: the SPMD
  partitioner fails on a tensor-parallel sum that leaves a vjp as aux inside the pipeline's shard_map."""
  (value, stats), vjp = jax.vjp(lambda p, x: fn(p, x, inputs), params, h)
  zero = jax.tree.map(lambda a: _cotangent(a, 0.0), stats)
  return (value, stats), lambda g: vjp((g, zero))


def _cotangent(a: jax.Array, scale: float):
  """The cotangent of an aux output that enters the objective as scale · its sum."""
  if not jnp.issubdtype(a.dtype, jnp.floating):
    return np.zeros(a.shape, jax.dtypes.float0)
  return jnp.full(a.shape, scale, a.dtype)
