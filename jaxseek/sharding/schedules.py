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
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxseek.sharding.pipeline import AXIS


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


def run_1f1b(table: Table, stage_fn: Callable, stage_params, stage_consts, x_MbTD: jax.Array, side_M,
             post_fn: Callable, post_params, post_M, aux_cotangent: dict[str, float], per_row: tuple[str, ...]):
  """The forward and backward of a pipelined stack and of the model after it, interleaved as `table` says.

  stage_fn(x_bTD, chunk_params, chunk_consts, side_b) → (y_bTD, aux) runs one chunk of C layers (`stage_params`
  and `stage_consts` leaves are [L, ...] in storage order, sharded on `pipeline`; aux leaves lead with C);
  post_fn(post_params, y_bTD, post_b) → (value, stats) is the rest of the objective for one microbatch (already
  multiplied by the loss scale). Each aux entry k enters the objective as aux_cotangent[k] · its sum (0 when
  absent); entries named in `per_row` are per-sequence [C, b] and are summed over rows here.

  Returns (g_x_MbTD, g_stage_params, g_post_params, stats summed over microbatches, aux summed over
  microbatches [L, ...]): the cotangent of the schedule's input, the gradients, and what the loss reported.
  """
  S, M, R = table.stages, table.microbatches, table.repeats
  steps = jnp.asarray(np.stack([table.f_micro, table.f_chunk, table.f_slot, table.b_micro, table.b_chunk,
                                table.b_slot]))  # [6, ticks, S]
  at = lambda tree, i: jax.tree.map(lambda a: a[i], tree)

  def per_stage(sp, sc, x_MbTD, side_M, pp, post_M):
    s = jax.lax.axis_index(AXIS)
    by_chunk = lambda tree: jax.tree.map(lambda a: a.reshape(R, a.shape[0] // R, *a.shape[1:]), tree)
    sp_R, sc_R = by_chunk(sp), by_chunk(sc)

    def forward(x, r, m):
      return stage_fn(x, at(sp_R, r), at(sc_R, r), at(side_M, m))

    y_shape, aux_shape = jax.eval_shape(forward, x_MbTD[0], 0, 0)
    rows = {k: k in per_row for k in aux_shape}
    summed = lambda aux: {k: a.sum(-1) if rows[k] else a for k, a in aux.items()}
    zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
    stats_shape = jax.eval_shape(lambda: post_fn(pp, x_MbTD[0], at(post_M, 0))[1])

    def post_grad(y, m):
      (_, stats), vjp = _vjp_with_aux(post_fn, pp, y, at(post_M, m))
      g_pp, g_y = vjp(jnp.ones((), jnp.float32))
      return g_y, g_pp, stats

    def backward(x, r, m, g_y):
      def f(x, p):
        return stage_fn(x, p, at(sc_R, r), at(side_M, m))

      (_, aux), vjp = jax.vjp(f, x, at(sp_R, r))
      g_aux = {k: _cotangent(a, aux_cotangent.get(k, 0.0)) for k, a in aux.items()}
      return vjp((g_y, g_aux))


    def tick(carry, t):
      held_f, held_b, buf, g_sp, g_pp, stats, aux_acc, g_x = carry
      fm, fr, fs, bm, br, bs = (steps[i, t, s] for i in range(6))
      has_f, has_b = fm >= 0, bm >= 0
      fm, fr, fs, bm, br, bs = (jnp.maximum(v, 0) for v in (fm, fr, fs, bm, br, bs))
      x_in = jnp.where((fr == 0) & (s == 0), x_MbTD[fm], held_f)
      y, aux = jax.lax.cond(has_f, lambda: forward(x_in, fr, fm), lambda: (zeros(y_shape), zeros(aux_shape)))
      buf = buf.at[fs].set(jnp.where(has_f, x_in, buf[fs]))
      aux_acc = jax.tree.map(lambda acc, a: acc.at[fr].add(jnp.where(has_f, a, jnp.zeros((), a.dtype))), aux_acc,
                             summed(aux))
      last = has_f & (fr == R - 1) & (s == S - 1)  # the microbatch leaves the stack: its loss, its backward
      g_y, g_pp_m, stats_m = jax.lax.cond(last, lambda: post_grad(y, fm),
                                          lambda: (zeros(y_shape), zeros(pp), zeros(stats_shape)))
      g_pp = jax.tree.map(jnp.add, g_pp, g_pp_m)
      stats = jax.tree.map(jnp.add, stats, stats_m)
      g_in = jnp.where((br == R - 1) & (s == S - 1), g_y, held_b)
      g_xb, g_chunk = jax.lax.cond(has_b, lambda: backward(buf[bs], br, bm, g_in),
                                   lambda: (zeros(y_shape), zeros(at(sp_R, 0))))
      g_sp = jax.tree.map(lambda acc, g: acc.at[br].add(g), g_sp, g_chunk)
      g_x = g_x.at[bm].set(jnp.where(has_b & (br == 0) & (s == 0), g_xb, g_x[bm]))
      held_f = jax.lax.ppermute(y, AXIS, [(i, (i + 1) % S) for i in range(S)])
      held_b = jax.lax.ppermute(g_xb, AXIS, [(i, (i - 1) % S) for i in range(S)])
      return (held_f, held_b, buf, g_sp, g_pp, stats, aux_acc, g_x), None

    x0 = jnp.zeros_like(x_MbTD[0])
    init = (x0, x0, jnp.zeros((table.slots, *x0.shape), x0.dtype), zeros(sp_R),
            jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), pp), zeros(stats_shape),
            zeros(jax.eval_shape(lambda: jax.tree.map(lambda a: jnp.zeros((R, *a.shape), a.dtype),
                                                      summed(zeros(aux_shape))))),
            jnp.zeros_like(x_MbTD))
    carry, _ = jax.lax.scan(tick, init, jnp.arange(table.ticks))
    _, _, _, g_sp, g_pp, stats, aux_acc, g_x = carry
    shared = lambda tree: jax.tree.map(lambda a: a[None], tree)  # one stage holds each: summed outside
    g_sp = jax.tree.map(lambda a: a.reshape(R * a.shape[1], *a.shape[2:]), g_sp)
    aux_acc = jax.tree.map(lambda a: a.reshape(R * a.shape[1], *a.shape[2:]), aux_acc)
    return shared(g_x), g_sp, shared(g_pp), shared(stats), aux_acc

  g_x, g_sp, g_pp, stats, aux = jax.shard_map(
      per_stage, in_specs=(P(AXIS), P(AXIS), P(), P(), P(), P()), out_specs=P(AXIS), axis_names={AXIS},
      check_vma=False)(stage_params, stage_consts, x_MbTD, side_M, post_params, post_M)
  total = lambda tree: jax.tree.map(lambda a: a.sum(0), tree)
  return total(g_x), g_sp, total(g_pp), total(stats), aux


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
