"""The executor of a schedule table (pipeline/tables.py): the whole model's forward and backward, its pipelined
stack run chunk by chunk on the stages as the table says, in one `lax.scan` over ticks inside a `jax.shard_map`
manual over `pipeline`. A split table's b and W run the two parts of a chunk's traced backward
(pipeline/wsplit.py); the weights outside the stack accumulate their gradients as pipeline/restgrads.py lays
them out.
"""

from __future__ import annotations

import functools

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.xla_metadata import set_xla_metadata
from jax.sharding import PartitionSpec as P

from jaxseek.kernels.gpu import platform
from jaxseek.pipeline import wsplit
from jaxseek.pipeline.restgrads import RestGrads, used_leaves
from jaxseek.pipeline.tables import Table
from jaxseek.sharding.rules import PIPELINE_AXIS as AXIS

PAIRED, SERIAL = "pipeline_paired", "pipeline_serial"  # the scopes of a paired tick's branches
# the share of ticks a branch of the tick's conditional runs, on its ops in the compiled program, where the HLO's
# readers weigh them by it (explore/overlap.py)
SHARE = "jaxseek_share"


class Parts(NamedTuple):
  """The model cut around its pipelined stack, for one microbatch (`run`): first_fn before it, stage_fn one
  chunk of it, post_fn the rest of the objective after it."""

  first_fn: Callable
  stage_fn: Callable
  post_fn: Callable


def run(table: Table, parts: Parts, stage_params, stage_consts, rest_params, batch_M, side_M, *,
        aux_cotangent: dict[str, float], per_row: tuple[str, ...], unsplit: tuple[bool, ...] | None = None,
        pair: bool = False, layers: np.ndarray | None = None):
  """The forward and backward of the whole model, its pipelined stack interleaved as `table` says.

  `parts`: first_fn(rest_params, batch_b) → x_bTD is the model before the pipelined stack for one microbatch
  (embedding and the layers before it), run with virtual stage 0 on its stage; stage_fn(x_bTD, chunk_params,
  chunk_consts, side_b[, unroll=True in paired ticks]) → (y_bTD, aux) runs one chunk of C layers (`stage_params`
  and `stage_consts` leaves are [L, ...] in storage order, sharded on `pipeline`: stage s stores its chunks
  r = 0 … R − 1 in order; aux leaves lead with C); post_fn(rest_params, y_bTD, batch_b) → (value, stats) is the rest of the objective for one microbatch
  (already multiplied by the loss scale), run after the last virtual stage on its stage. `unsplit` marks the
  rest's leaves no automatic mesh axis splits (all when None): only those share the flat accumulator of
  `RestGrads` (a split one would be resharded to be laid into it). `batch_M` and `side_M`
  are per-microbatch trees [M, b, ...]. Each aux entry k enters the objective as aux_cotangent[k] · its sum (0
  when absent); entries named in `per_row` are per-sequence [C, b] and are summed over rows here. `pair`
  (train.pipeline_overlap): a tick whose forward and backward do not wait for each other (`Table.paired`) runs
  both in one branch with the chunks outside any conditional, so XLA can schedule each one's collectives beside
  the other's compute (DualPipe's pairing); other ticks run as without it. `layers` [S, R]: how many of chunk
  r's layers stage s runs (the rest identity padding, skipped: stage_fn gets layers=that count), None: all.

  Returns (g_stage_params, g_rest_params, stats summed over microbatches, aux summed over microbatches
  [L, ...]). Virtual stage 0 keeps no hidden state for its backward: it recomputes first_fn from the batch.
  """
  R = table.repeats

  def per_stage(sp, sc, rp, batch_M, side_M, aux_cotangent):
    stage = _Stage(table, parts, sp, sc, rp, batch_M, side_M, aux_cotangent=aux_cotangent, per_row=per_row,
                   unsplit=unsplit, pair=pair, layers=layers)
    carry, _ = jax.lax.scan(stage.tick, stage.init(), jnp.arange(table.ticks))
    _, _, _, _, g_sp, g_rp, stats, aux_acc = carry
    shared = lambda tree: jax.tree.map(lambda a: a[None], tree)  # one stage holds each: summed outside
    rows = lambda tree: jax.tree.map(lambda a: a.reshape(R * a.shape[1], *a.shape[2:]), tree)  # [R, C] → rows
    return rows(g_sp), shared(stage.layout.tree(g_rp, stage.s)), shared(stats), rows(aux_acc)

  g_sp, g_rp, stats, aux = jax.shard_map(
      per_stage, in_specs=(P(AXIS), P(AXIS), P(), P(), P(), P()), out_specs=P(AXIS), axis_names={AXIS},
      check_vma=False)(stage_params, stage_consts, rest_params, batch_M, side_M, aux_cotangent)
  total = lambda tree: jax.tree.map(lambda a: a.sum(0), tree)
  return g_sp, total(g_rp), total(stats), aux


def _zeros(tree):
  return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def _put(buf: jax.Array, i, value: jax.Array, when) -> jax.Array:
  """buf with `value` in slot i where `when`. A dynamic slice and update rather than `.at[i].set`: an indexed
  update lowers to a scatter, whose bounds checks are ops of their own, run in every tick."""
  old = jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)
  return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(when, value, old), i, 0)


def _add(acc: jax.Array, i, value: jax.Array) -> jax.Array:
  """acc with `value` added to acc[i] (as `_put`, without a scatter). On CPU one pass over every slot (XLA:CPU
  runs the slice read and the in-place update as two ops, ~2 µs each at these sizes; an accumulator has a slot a
  chunk, 2 on the V); elsewhere the slot alone."""
  if platform() == "cpu":
    hit = (jnp.arange(acc.shape[0]) == i).reshape(-1, *[1] * value.ndim)
    return acc + jnp.where(hit, value[None], jnp.zeros((), value.dtype))
  return jax.lax.dynamic_update_index_in_dim(acc, jax.lax.dynamic_index_in_dim(acc, i, 0, keepdims=False) + value,
                                             i, 0)


class _Stage:
  """What one stage runs inside `run`'s shard_map (its own parameters and the whole batch's microbatches): the
  tick of the schedule and its parts. The scan's carry is (stage-input buffer, cotangent buffer, what the last
  tick received, stash buffers, chunk gradients [R, C, ...], gradients of the rest of the model, loss stats,
  aux [R, C, ...])."""

  def __init__(self, table: Table, parts: Parts, sp, sc, rp, batch_M, side_M, *, aux_cotangent, per_row,
               unsplit=None, pair=False, layers=None):
    first_fn, stage_fn, post_fn = parts
    # the layer counts chunks hold where padding is skipped (a program each, `chunk`), and each chunk's one
    self.counts = None if layers is None else tuple(int(k) for k in np.unique(layers))
    self.count_of = None if layers is None else jnp.asarray(np.searchsorted(self.counts, layers), jnp.int32)
    self.table, self.first_fn, self.stage_fn, self.post_fn = table, first_fn, stage_fn, post_fn
    self.rp, self.batch_M, self.side_M, self.aux_cotangent = rp, batch_M, side_M, aux_cotangent
    self.s = jax.lax.axis_index(AXIS)
    # the table's columns as one [ticks, S, 2K] array, read with one dynamic slice a tick (`lookup`): each entry
    # with −1 read as 0 (an index), then whether it is set. A slice of each column, its clamp and its test were
    # a dozen ops a tick of their own
    names = sorted(table.steps)
    columns = np.stack([table.steps[k] for k in names], axis=-1)
    now = np.concatenate([np.maximum(columns, 0), columns >= 0], axis=-1).astype(np.int32)
    self.entries = jnp.asarray(np.concatenate([now, np.concatenate([np.zeros_like(now[:1]), now[:-1]])], axis=-1))
    self.column = {k: i for i, k in enumerate(names)}
    self.virtual = jnp.asarray(table.virtual)
    self.routes = table.routes()
    self.pairs = jnp.asarray(table.paired()) if pair and table.paired().any() else None
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
    self.n_p = len(jax.tree.leaves(self.sp_R))
    self.b_leaves, self.w_leaves, self.f_leaves, self.stash_shape, self.residual_shape = (
        list(range(self.n_p)), [], [], [], [])
    self.keep = table.split and table.residual_slots > 0
    if self.keep:
      self._split_kept()
    elif table.split:
      self.wsplit = self._split()
      self.b_leaves = [i - 1 for i in self.wsplit.b_outputs[1:]]
      self.w_leaves = [i - 1 for i in self.wsplit.w_outputs]
      self.stash_shape = jax.eval_shape(lambda *a: self.wsplit.b(*a)[1], *self._flat(
          self.x_shape, _at(self.sp_R, 0), _at(self.sc_R, 0), _at(self.side_M, 0), self.y_shape))

  def _flat(self, x, p, c, side, g_y):
    """The arguments of the traced chunk backward: x, the chunk's weights, its consts, the microbatch's side
    inputs, the output's cotangent, the aux cotangents."""
    return [x, *jax.tree.leaves((p, c, side)), g_y, *jax.tree.leaves(self.aux_cotangent)]

  def _traced(self, forward_outputs: bool):
    """The chunk's forward and vjp traced once on a chunk's shapes, as a function of `_flat`'s arguments:
    (closed jaxpr, its abstract arguments, the index of g_y among them, n_p). Its outputs are [g_x, g_p...],
    led by [y, aux...] with `forward_outputs`."""
    p0, c0, side0 = _at(self.sp_R, 0), _at(self.sc_R, 0), _at(self.side_M, 0)
    n_p, n_c, n_side = (len(jax.tree.leaves(t)) for t in (p0, c0, side0))
    trees, cot_tree = jax.tree.structure((p0, c0, side0)), jax.tree.structure(self.aux_cotangent)
    g_y_arg = 1 + n_p + n_c + n_side

    def both(x, *rest):
      p, c, side = jax.tree.unflatten(trees, rest[:g_y_arg - 1])
      g_y, cot = rest[g_y_arg - 1], jax.tree.unflatten(cot_tree, rest[g_y_arg:])
      (y, aux), pull = jax.vjp(lambda x, p: self.stage_fn(x, p, c, side), x, p)
      g_x, g_p = pull((g_y, {k: _cotangent(a, cot.get(k, 0.0)) for k, a in aux.items()}))
      return ([y, *jax.tree.leaves(aux)] if forward_outputs else []) + [g_x, *jax.tree.leaves(g_p)]

    args = self._flat(self.x_shape, p0, c0, side0, self.y_shape)
    abstract = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args]
    return jax.make_jaxpr(both)(*abstract), abstract, g_y_arg, n_p

  def _split(self) -> wsplit.Split:
    """b and W of one chunk's backward (forward recomputed from its input)."""
    closed, abstract, g_y_arg, n_p = self._traced(False)
    w_args = [i for i in range(len(abstract)) if i not in (0, g_y_arg)]  # all but x and g_y
    return wsplit.split(closed, [True] + [False] * n_p, w_args)

  def _split_kept(self) -> None:
    """F, b and W of one chunk that keeps its forward's residuals (train.pipeline_recompute=false): the chunk's
    forward and vjp traced once, F what its output and aux need (stashing every value of it the backward reads:
    the residuals), and the rest split again into b and W. Each equation runs once, in one of the three."""
    self.aux_tree = jax.tree.structure(self.aux_shape)
    n_out = 1 + self.aux_tree.num_leaves
    closed, abstract, g_y_arg, n_p = self._traced(True)
    f = wsplit.split(closed, [True] * n_out + [False] * (1 + n_p),
                     [i for i in range(len(abstract)) if i])  # the rest is given all but x again
    if n_out in f.b_outputs:
      raise AssertionError("the chunk input's cotangent does not depend on the output's")
    self.residual_shape = jax.eval_shape(lambda *a: f.b(*a)[1], *abstract)
    leaves, self.residual_tree = jax.tree.flatten(self.residual_shape)
    n_s = len(leaves)

    def rest(*a):
      return f.w(jax.tree.unflatten(self.residual_tree, a[:n_s]), *a[n_s:])

    rest_args = [*leaves, *[abstract[i] for i in f.w_args]]
    outs = f.w_outputs  # indices into both's outputs: n_out is the input's cotangent, the weights' after it
    w = wsplit.split(jax.make_jaxpr(rest)(*rest_args), [k == n_out for k in outs],
                     [n_s + j for j, i in enumerate(f.w_args) if i != g_y_arg])
    self.fsplit, self.wsplit, self.n_out, self.n_residual = f, w, n_out, n_s
    self.f_leaves = [k - n_out - 1 for k in f.b_outputs[n_out:]]
    self.b_leaves = [outs[j] - n_out - 1 for j in w.b_outputs if outs[j] != n_out]
    self.w_leaves = [outs[j] - n_out - 1 for j in w.w_outputs]
    self.stash_shape = jax.eval_shape(lambda *a: w.b(*a)[1], *rest_args)

  def _rest_args(self, residuals, flat):
    """The arguments of the backward after a kept forward (`_split_kept`): the residuals, then what F's split
    gives the rest again."""
    return [*(jax.tree.leaves(residuals) if residuals is not None else [None] * self.n_residual),
            *[flat[i] for i in self.fsplit.w_args]]

  def forward_kept(self, x, r, m):
    """F of chunk r on microbatch m, keeping its residuals: (y, aux, residuals, the gradients of `f_leaves`)."""
    def run(x):
      flat = self._flat(x, _at(self.sp_R, r), _at(self.sc_R, r), _at(self.side_M, m), _zeros(self.y_shape))
      outs, residuals = self.fsplit.b(*flat)
      return outs[0], jax.tree.unflatten(self.aux_tree, outs[1:self.n_out]), residuals, outs[self.n_out:]

    with jax.named_scope("pipeline_forward"):
      return jax.lax.cond(self.virtual[self.s, r] == 0, lambda: run(self.first(m)), lambda: run(x))

  def chunk(self, x, p, r, m, layers=None, **unroll):
    """Chunk r's layers on microbatch m; where chunks skip their padding, the program of its layer count (or of
    `layers`)."""
    run = lambda k: self.stage_fn(x, p, _at(self.sc_R, r), _at(self.side_M, m), **unroll,
                                  **({} if k is None else {"layers": k}))
    if layers is not None or self.counts is None:
      return run(layers)
    return jax.lax.switch(self.count_of[self.s, r], [functools.partial(run, k) for k in self.counts])

  def _pulled(self, x, r, m, g_y, layers=None):
    """The whole backward of chunk r (its forward recomputed): (the input's cotangent, the weights')."""
    (_, aux), pull = jax.vjp(lambda x, p: self.chunk(x, p, r, m, layers), x, _at(self.sp_R, r))
    g_x, g_p = pull((g_y, {k: _cotangent(a, self.aux_cotangent.get(k, 0.0)) for k, a in aux.items()}))
    return g_x, jax.tree.leaves(g_p)

  def first(self, m):
    return self.first_fn(self.rp, _at(self.batch_M, m))

  def forward(self, x, r, m):
    """Chunk r on microbatch m; on virtual stage 0 from the batch (first_fn), else from `x`."""
    with jax.named_scope("pipeline_forward"):  # names the ops in HLO and profiles
      return jax.lax.cond(self.virtual[self.s, r] == 0, lambda: self.chunk(self.first(m), _at(self.sp_R, r), r, m),
                          lambda: self.chunk(x, _at(self.sp_R, r), r, m))

  def backward(self, x, r, m, g_y, g_rp, residuals=None):
    """(cotangent of the chunk's input, the chunk's gradients of the leaves `b_leaves`, g_rp plus first_fn's
    gradient on virtual stage 0, the stash W reads (split tables)), the chunk recomputed from its kept input (or
    from the batch): the whole backward, or b of `wsplit`."""
    def chunk_b(x):
      if self.keep:
        flat = self._flat(None, _at(self.sp_R, r), _at(self.sc_R, r), _at(self.side_M, m), g_y)
        outs, stash = self.wsplit.b(*self._rest_args(residuals, flat))
        return outs[0], outs[1:], stash
      if self.table.split:
        outs, stash = self.wsplit.b(*self._flat(x, _at(self.sp_R, r), _at(self.sc_R, r), _at(self.side_M, m), g_y))
        return outs[0], outs[1:], stash
      if self.counts is None:
        return (*self._pulled(x, r, m, g_y), [])
      # the layer count chosen outside the vjp: each program keeps its own residuals (a conditional inside the vjp
      # would keep every branch's)
      return (*jax.lax.switch(self.count_of[self.s, r], [functools.partial(self._pulled, x, r, m, g_y, layers=k)
                                                          for k in self.counts]), [])

    def first():
      lay = self.layout
      x, pull = jax.vjp(lambda q: self.first_fn(lay.with_leaves(self.rp, "first", q), _at(self.batch_M, m)),
                        lay.read(self.rp, "first"))
      g_x, g_chunk, stash = chunk_b(x)
      g_first, = pull(g_x)
      return jnp.zeros(self.y_shape.shape, self.y_shape.dtype), g_chunk, lay.add(g_rp, "first", g_first), stash

    def later():
      g_x, g_chunk, stash = chunk_b(x)
      return g_x, g_chunk, g_rp, stash

    with jax.named_scope("pipeline_backward"):
      return jax.lax.cond(self.virtual[self.s, r] == 0, first, later)

  def weights(self, stash, r, m):
    """W of chunk r on microbatch m: the gradients of the leaves `w_leaves`, from b's stash."""
    with jax.named_scope("pipeline_weights"):
      flat = self._flat(None, _at(self.sp_R, r), _at(self.sc_R, r), _at(self.side_M, m), None)
      if self.keep:
        flat = self._rest_args(None, flat)
      return self.wsplit.w(stash, *[flat[i] for i in self.wsplit.w_args])

  def post_grad(self, y, m, g_rp):
    """The loss of microbatch m after the last virtual stage: (its cotangent, g_rp plus its gradient, stats)."""
    lay = self.layout
    (_, stats), vjp = _vjp_with_aux(lambda q, h, mb: self.post_fn(lay.with_leaves(self.rp, "post", q), h, mb),
                                    lay.read(self.rp, "post"), y, _at(self.batch_M, m))
    g, g_y = vjp(jnp.ones((), jnp.float32))
    return g_y, lay.add(g_rp, "post", g), stats

  def lookup(self, t) -> tuple[Callable, Callable]:
    """Stage s's entries of the table at tick t: (at, has), at(k) the entry of column k (0 where unset) and
    has(k) whether it is set; at(k, True) and has(k, True) those of tick t − 1 (unset at t = 0)."""
    row, K = self.entries[t, self.s], len(self.column)
    return (lambda k, before=False: row[2 * K * before + self.column[k]]), \
        (lambda k, before=False: row[2 * K * before + K + self.column[k]] > 0)

  def send(self, y: jax.Array, g_x: jax.Array, t) -> list:
    """The tick's forward output y and input cotangent g_x moved to the stages that receive them: per route
    (Table.routes), what it delivers ([kinds, ...]), which the next tick stores first (`store`). One ppermute a
    route, carrying y and g_x together where both go by it, and only in the ticks in which some stage receives by
    it: each ppermute is a rendezvous of every stage, and on CPU, where simulated devices share the cores, ZB-V at
    S = 4, M = 16 ran 300 a step (one per kind and offset in each of its 75 ticks; 1F1B 44), now 134 (1F1B 36)."""
    sent = {"f": y, "b": g_x}
    return [self._permute(route, jnp.stack([sent[k] for k in route.kinds]), t) if route.offset else
            [sent[k] for k in route.kinds] for route in self.routes]

  def store(self, buf: jax.Array, grads: jax.Array, inbox: list, lookup) -> tuple[jax.Array, jax.Array]:
    """(buf, grads) with what the previous tick received (`send`) in the slots the table puts it in. Stored at
    the start of the tick that reads the slots, not at the end of the one that received them: there a write
    followed the tick's reads with no data dependence on the backward's read, and XLA copied the whole buffer
    twice a tick to keep them apart (ZB-V's 9 stage-input slots at S = 4)."""
    kept, (at, has) = {"f": buf, "b": grads}, lookup
    for route, payload in zip(self.routes, inbox):
      for i, kind in enumerate(route.kinds):
        column = f"{kind}_in{route.offset}"
        kept[kind] = _put(kept[kind], at(column, True), payload[i], has(column, True))
    return kept["f"], kept["b"]

  def _permute(self, route, payload: jax.Array, t) -> jax.Array:
    """`payload` moved over the route's pairs; skipped in a tick in which nobody receives by it. The predicate is
    the tick's alone, so every stage takes the same branch and the collective runs on all stages or on none."""
    move = lambda p: jax.lax.ppermute(p, AXIS, list(route.pairs))
    if route.active.all():
      return move(payload)

    def run(p):
      with set_xla_metadata(**{SHARE: f"{route.active.mean():.6g}"}):  # the HLO's readers weigh it by its ticks
        return move(p)

    return jax.lax.cond(jnp.asarray(route.active)[t], run, lambda p: p, payload)

  def init(self):
    summed = jax.eval_shape(lambda: self.summed(_zeros(self.aux_shape)))
    table, x = self.table, self.x_shape
    stash = jax.tree.map(lambda a: jnp.zeros((table.stash_slots, *a.shape), a.dtype), self.stash_shape)
    residuals = jax.tree.map(lambda a: jnp.zeros((table.residual_slots, *a.shape), a.dtype), self.residual_shape)
    stash = (stash, residuals)
    y = jnp.zeros(self.y_shape.shape, self.y_shape.dtype)
    received = [jnp.stack([y] * len(r.kinds)) if r.offset else [y] * len(r.kinds) for r in self.routes]  # `send`'s
    return (jnp.zeros((table.slots, *x.shape), x.dtype), jnp.zeros((table.grad_slots, *x.shape), x.dtype), received,
            stash, _zeros(self.sp_R), self.layout.init(), _zeros(self.stats_shape),
            jax.tree.map(lambda a: jnp.zeros((table.repeats, *a.shape), a.dtype), summed))

  def summed(self, aux):
    return {k: a.sum(-1) if self.rows[k] else a for k, a in aux.items()}

  def tick(self, carry, t):
    """One tick: what the last one received stored, its work (side by side where the table pairs it, else one op
    after the other), then the sends."""
    lookup = self.lookup(t)
    buf, grads, inbox, *rest = carry
    carry = (*self.store(buf, grads, inbox, lookup), *rest)
    if self.pairs is None:
      carry, y, g_xb = self.serial(carry, lookup)
    else:
      share = float(self.table.paired().mean())  # of a stage's ticks, over the stages

      def serial(carry):
        with jax.named_scope(SERIAL), set_xla_metadata(**{SHARE: f"{1 - share:.6g}"}):
          return self.serial(carry, lookup)

      def paired(carry):
        with jax.named_scope(PAIRED), set_xla_metadata(**{SHARE: f"{share:.6g}"}):
          return self.paired(carry, lookup)

      carry, y, g_xb = jax.lax.cond(self.pairs[t, self.s], paired, serial, carry)
    buf, grads, *rest = carry
    return (buf, grads, self.send(y, g_xb, t), *rest), None

  def serial(self, carry, lookup):
    """A tick's work one op after the other: the forward, the loss where a microbatch leaves the last virtual
    stage, the backward (b in a split table, its stash kept), W (split tables). (carry, forward output, the
    backward's input cotangent) for the sends."""
    buf, grads, (stash, res), g_sp, g_rp, stats, aux_acc = carry
    # each entry is read in the branch that uses it: one read outside them is an op in every tick
    at, has = lookup
    has_f, has_b, has_loss = has("f_micro"), has("b_micro"), has("loss_grad")
    if self.keep:  # F keeps its residuals (in place, in the branch that runs) for b
      def run_f(kept):
        (g_sp, res), fr = kept, at("f_chunk")
        y, aux, new, early = self.forward_kept(_at(buf, at("f_slot")), fr, at("f_micro"))
        res = jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, at("f_residual"), 0), res, new)
        return (y, aux), self._accumulate(g_sp, fr, self.f_leaves, early), res

      (y, aux), g_sp, res = jax.lax.cond(has_f, run_f, lambda kept: (_zeros((self.y_shape, self.aux_shape)), *kept),
                                         (g_sp, res))
    else:
      y, aux = jax.lax.cond(has_f, lambda: self.forward(_at(buf, at("f_slot")), at("f_chunk"), at("f_micro")),
                            lambda: _zeros((self.y_shape, self.aux_shape)))
    aux_acc = jax.tree.map(lambda acc, a: _add(acc, at("f_chunk"), jnp.where(has_f, a, jnp.zeros((), a.dtype))),
                           aux_acc, self.summed(aux))
    # the microbatch leaves the last virtual stage: its loss, and the cotangent its backward starts from
    g_y, g_rp, stats_m = jax.lax.cond(has_loss, lambda g: self.post_grad(y, at("f_micro"), g),
                                      lambda g: (_zeros(self.y_shape), g, _zeros(self.stats_shape)), g_rp)
    grads = _put(grads, at("loss_grad"), g_y, has_loss)
    stats = jax.tree.map(jnp.add, stats, stats_m)
    # the gradients accumulate, and the stash is written and read, inside the branches that run (in place): a
    # tick without a backward or a W touches none of them

    def run_b(kept):
      (g_sp, g_rp, stash), br = kept, at("b_chunk")
      g_x, g_early, g_rp, new = self.backward(_at(buf, at("b_slot")), br, at("b_micro"), _at(grads, at("b_grad")),
                                              g_rp, _at(res, at("b_residual")) if self.keep else None)
      stash = jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, at("b_stash"), 0), stash, new)
      return g_x, self._accumulate(g_sp, br, self.b_leaves, g_early), g_rp, stash

    g_xb, g_sp, g_rp, stash = jax.lax.cond(has_b, run_b, lambda kept: (_zeros(self.y_shape), *kept),
                                           (g_sp, g_rp, stash))
    if self.table.split:  # the W of this tick, from its stash
      def run_w(g):
        wr = at("w_chunk")
        return self._accumulate(g, wr, self.w_leaves, self.weights(_at(stash, at("w_stash")), wr, at("w_micro")))

      g_sp = jax.lax.cond(has("w_micro"), run_w, lambda g: g, g_sp)
    return (buf, grads, (stash, res), g_sp, g_rp, stats, aux_acc), y, g_xb

  def paired(self, carry, lookup):
    """A tick whose forward and backward do not wait for each other (Table.paired; never a split table): both
    chunks outside any conditional and unrolled, so their collectives and compute interleave (only first_fn is
    under one, on virtual stage 0, where the backward's gradient of first_fn runs its forward again). The
    cotangent is read before the loss writes its slot, and the loss waits only for the forward."""
    buf, grads, stash_res, g_sp, g_rp, stats, aux_acc = carry
    at, has = lookup
    fm, fr, fs, bm, br, bs, bg, lg = (at(k) for k in ("f_micro", "f_chunk", "f_slot", "b_micro", "b_chunk", "b_slot",
                                                      "b_grad", "loss_grad"))
    g_in = _at(grads, bg)
    with jax.named_scope("pipeline_forward"):
      y, aux = self.chunk(self.entering(_at(buf, fs), fr, fm), _at(self.sp_R, fr), fr, fm, unroll=True)
    aux_acc = jax.tree.map(lambda acc, a: _add(acc, fr, a), aux_acc, self.summed(aux))
    with jax.named_scope("pipeline_backward"):
      x = self.entering(_at(buf, bs), br, bm)
      (_, aux_b), pull = jax.vjp(lambda x, p: self.chunk(x, p, br, bm, unroll=True), x, _at(self.sp_R, br))
      g_x, g_p = pull((g_in, {k: _cotangent(a, self.aux_cotangent.get(k, 0.0)) for k, a in aux_b.items()}))
    g_y, g_rp, stats_m = jax.lax.cond(has("loss_grad"), lambda g: self.post_grad(y, fm, g),
                                      lambda g: (_zeros(self.y_shape), g, _zeros(self.stats_shape)), g_rp)
    grads = _put(grads, lg, g_y, has("loss_grad"))
    first_b = self.virtual[self.s, br] == 0
    with jax.named_scope("pipeline_backward"):
      g_rp = jax.lax.cond(first_b, lambda g: self.add_first_grad(g, bm, g_x), lambda g: g, g_rp)
    g_sp = self._accumulate(g_sp, br, self.b_leaves, jax.tree.leaves(g_p))
    stats = jax.tree.map(jnp.add, stats, stats_m)
    return (buf, grads, stash_res, g_sp, g_rp, stats, aux_acc), y, jnp.where(first_b, jnp.zeros_like(g_x), g_x)

  def entering(self, x, r, m):
    """Chunk r's input on microbatch m: on virtual stage 0 first_fn of the batch, else `x`."""
    return jax.lax.cond(self.virtual[self.s, r] == 0, lambda: self.first(m), lambda: x)

  def add_first_grad(self, g_rp, m, g_x):
    """g_rp plus first_fn's gradient on microbatch m for its output's cotangent g_x (its forward run again)."""
    lay = self.layout
    _, pull = jax.vjp(lambda q: self.first_fn(lay.with_leaves(self.rp, "first", q), _at(self.batch_M, m)),
                      lay.read(self.rp, "first"))
    return lay.add(g_rp, "first", pull(g_x)[0])

  def _accumulate(self, g_sp, r, leaves: list[int], values: list):
    """g_sp with `values` (the gradients of the chunk's leaves `leaves`) added to chunk r's."""
    flat, treedef = jax.tree.flatten(g_sp)
    for i, g in zip(leaves, values):
      flat[i] = _add(flat[i], r, g)
    return jax.tree.unflatten(treedef, flat)


def _at(tree, i):
  """Entry i of every leaf (a dynamic slice: indexing with a traced integer adds the wrap of negative indices)."""
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


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
