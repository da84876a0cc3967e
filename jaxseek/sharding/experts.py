"""The expert-parallel exchange: token copies to the devices that hold their experts and back, put together
from the plans and collectives of `sharding/exchange.py`.

Shape key (see jaxseek.model): X tokens of a shard flattened (B·T), E routed experts, K experts per token,
D model size; J = K·X token copies, P expert-axis shards, C buffer rows per shard pair, R receive rows. Inside
`jax.shard_map` a lowercase letter is the local shard (e = E/P experts, m = M/|tensor|, x = local tokens).

Dispatch on the expert axis (P shards), `model.moe_dispatch` as `choice.dispatch_kind` resolves it:
  fixed (CPU, and the reference)  each device sends every token copy to the shard that holds its expert through
      a fixed buffer of C rows per (source, destination) pair, with `all_to_all`; the destination runs its e
      experts over what it received (grouped matmul) and sends the results back the same way.
        C = min(⌈capacity_factor · J / P⌉, X · min(K, e))     (capacity_factor None: C = X · min(K, e), dropless)
      Copies fill their destination's C slots in k-major order (every token's first choice, then every second
      choice, ...; tokens in order within one k); copies past C are dropped, contribute zero and are counted.
  ragged (GPU, TPU; XLA:CPU has no ragged-all-to-all)  the copies within C are sorted by global expert (so by
      destination, then local expert); every device all-gathers the counts count[s, q, l] (source, destination,
      local expert) and computes the same plan (`ragged_plan`). Destination q's one receive buffer of R rows is
      expert-major: local expert 0's rows from sources 0, 1, ..., then local expert 1's, ...
        start[q, l, s] = Σ over the slices (l', s') before (l, s) of count[s', q, l'],
        kept[q, l, s] = clip(R − start, 0, count[s, q, l]),   R = min(⌈moe_recv_factor · J⌉, P · C)  (round 0)
      One `ragged_all_to_all` (E slices, e per peer) sends exactly the kept copies; the grouped matmul runs over
      the groups Σ_s kept[q, l, s] (no padding rows); a second one returns the results to the senders' sorted
      positions. Copies past R go in further rounds of R rows (`ragged_plan`'s `first`), never dropped, and are
      counted in `extra`; with moe_recv_factor ≥ min(P, E/K) one round holds the worst case, P · X · min(K, e).
  moe_dispatch_dtype=float8_e4m3fn  the exchanges that carry rows to the experts travel as e4m3 with a float32
      scale per 1×128 tile (amax / 448): D + 4·⌈D/128⌉ bytes a row instead of 2·D in bfloat16, dequantised to the
      compute dtype on arrival. Forward: the dispatched tokens in e4m3, the expert results back in the compute
      dtype. Backward: the cotangents of the expert results go to the experts in e4m3 (the combine's transpose),
      the tokens' cotangents come back in the compute dtype. Each rounding is straight-through: its gradient is
      the identity (`dispatch`).
Compiled for 8 H200s (bench-v3-1b, 4 layers, batch 8 × 1024 on expert=8; docs/moe.md): fixed, every all_to_all
bf16[8, 4096, 2048] (32,768 rows for 4,096 copies), temp 3.99 GiB; ragged, 4,096 rows out into R = 8,192,
temp 1.64 GiB (1.61 with FP8 dispatch, 2,112 bytes a row) in one round, 1.89 GiB with the further rounds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.xla_metadata import set_xla_metadata

from jaxseek.config import ModelConfig
from jaxseek.errors import UserError
from jaxseek.kernels import choice, grouped
from jaxseek.kernels.grouped import expert_ffn, experts_local
from jaxseek.sharding import rules
from jaxseek.sharding.exchange import (RaggedPlan, capacity, dispatch, group_reach, kept_sorted, node_groups,
                                      ragged_plan, rank_in_group, receive_rows, rounds_needed, send_order,
                                      send_slots, zero_rows, zeros_like_round)

# marks the ops of the further rounds (and windows) that run only when a shard receives more than its buffer, in
# the compiled program: explore/overlap.py counts what runs every step without them
FURTHER = {"jaxseek_round": "further"}


@dataclasses.dataclass(frozen=True)
class Settings:
  """How routed copies reach the experts: the model's moe_capacity_factor, moe_matmul, moe_dispatch,
  moe_recv_factor and moe_dispatch_dtype=float8_e4m3fn."""

  capacity_factor: float | None = None  # None: dropless
  matmul: str = "auto"
  dispatch: str = "auto"
  recv_factor: float = 2.0
  fp8_dispatch: bool = False
  node: int | None = None  # expert shards per node where the expert axis spans nodes (None: one node)
  chunks: int = 1  # model.moe_overlap_chunks
  # group-limited routing (experts, n_group, topk_group): bounds the nodes a token reaches; None: K bounds them
  groups: tuple[int, int, int] | None = None
  fp8: str | None = None  # the train.fp8 recipe of the grouped GEMMs (kernels/fp8_grouped.py; blockwise: emulated)

  @property
  def ffn(self) -> str | tuple[str, str, tuple[str, ...]]:
    """What the grouped SwiGLU runs (grouped.expert_ffn's `matmul`): model.moe_matmul, with FP8 GEMMs the
    recipe beside it and the mesh axes the expert hidden width is split over (the scales of the GEMMs that
    contract it span the whole width, as on one device). Read inside the MoE's shard_map."""
    if self.fp8 in (None, "blockwise"):
      return self.matmul
    return self.matmul, self.fp8, tuple(a for a in rules.split_axes("expert_mlp") if a in _manual_axes())

  @classmethod
  def from_config(cls, cfg: ModelConfig, node: int | None = None) -> "Settings":
    if cfg.moe_capacity_factor is not None and cfg.moe_capacity_factor <= 0:
      raise UserError(f"config key model.moe_capacity_factor: {cfg.moe_capacity_factor} must be > 0, or null "
                      f"for dropless dispatch")
    limited = cfg.topk_method != "greedy" and cfg.n_group > 1
    return cls(cfg.moe_capacity_factor, cfg.moe_matmul, cfg.moe_dispatch, cfg.moe_recv_factor,
               cfg.moe_dispatch_dtype == "float8_e4m3fn", node, cfg.moe_overlap_chunks,
               (cfg.n_routed_experts, cfg.n_group, cfg.topk_group) if limited else None)

  def nodes_reached(self, shards: int, k: int) -> int:
    """The most nodes one token's k experts lie on (two-stage dispatch on `shards` expert shards)."""
    nodes = shards // self.node
    bound = group_reach(*self.groups, shards, self.node)[1] if self.groups else nodes
    return max(1, min(nodes, k, bound))

  def node_rows(self, tokens: int, shards: int, reach: int) -> int:
    """The first stage's receive rows a round in the two-stage exchange: model.moe_recv_factor times the rows a
    device receives when each of `tokens` tokens reaches `reach` nodes, at most all that can arrive (one row per
    token from each of the nodes' devices at its local rank)."""
    return receive_rows(tokens, reach, shards // self.node, tokens, self.recv_factor)

  def chunk_count(self, tokens: int) -> int:
    """How many independent exchanges a shard's `tokens` go through: model.moe_overlap_chunks, only for dropless
    dispatch (a capacity applies per exchange: chunks would drop other copies) and at most one per token."""
    return max(1, min(self.chunks, tokens)) if self.capacity_factor is None else 1

  def two_stage(self, shards: int, where: str | None = None) -> bool:
    """Whether token copies go by the node-limited two-stage exchange on `shards` expert shards: a ragged
    dispatch (model.moe_dispatch=two_stage, or auto where ragged runs), no capacity factor, and the expert axis
    spanning whole nodes."""
    kind = choice.dispatch_kind(self.dispatch, where)
    return self.spans_nodes(shards) and self.capacity_factor is None and (
        kind == "two_stage" or (self.dispatch == "auto" and kind == "ragged"))

  def spans_nodes(self, shards: int) -> bool:
    """Whether the `shards` expert shards lie on whole nodes of `node` shards each, more than one."""
    return self.node is not None and 1 < self.node < shards and shards % self.node == 0


def expert_axes(cfg: ModelConfig) -> tuple[str, ...]:
  """The mesh axes the routed experts are split over: expert, and tensor with model.moe_tensor=experts."""
  return ("expert", "tensor") if cfg.moe_tensor == "experts" else ("expert",)


def node_shards(mesh: jax.sharding.Mesh, devices_per_node: int | None = None,
                axes: tuple[str, ...] = ("expert",)) -> int | None:
  """The expert shards per node of `mesh` (consecutive along the expert axes `axes`, in order), None where every
  expert group stays in one node. Nodes: `devices_per_node` consecutive devices in the mesh's order
  (mesh.devices_per_node), else the processes' hosts (sharding/mesh.py)."""
  from jaxseek.sharding import mesh as mesh_lib

  grid = mesh.devices
  names = list(mesh.axis_names)
  P = math.prod(grid.shape[names.index(a)] for a in axes)
  if devices_per_node:
    node_of = {d.id: i // devices_per_node for i, d in enumerate(grid.flat)}
  else:
    nodes = mesh_lib.process_nodes()
    node_of = {d.id: nodes.get(d.process_index, d.process_index) for d in grid.flat}
  groups = np.moveaxis(grid, [names.index(a) for a in axes], list(range(-len(axes), 0))).reshape(-1, P)
  runs = {tuple(np.unique([node_of[d.id] for d in group], return_counts=True)[1]) for group in groups}
  if len(runs) != 1 or len(set(next(iter(runs)))) != 1:
    return None  # nodes cut the expert groups unevenly: one stage
  per = int(next(iter(runs))[0])
  return per if per < P else None


def shard_count() -> int:
  """P, the expert-axis shards of the active mesh (the expert axes an enclosing shard_map handles by hand,
  gradsum's, count too: the weights arrive as their block); 1 without a mesh."""
  if not rules.has_mesh():
    return 1
  return math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in rules.split_axes("experts"))


def routed(x_xD, idx_xK, weights_xK, w_eDm: tuple, valid_x: jax.Array, settings: Settings,
           shards: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One token shard's routed-expert output [x, D] (partial if m < M), its dropped copies [] and its copies sent
  in extra rounds of the exchange []: on the shard itself when every expert is local (`shards` = 1) and nothing
  can drop, else through the fixed or ragged exchange. `w_eDm`: the local experts' (gate, up, down) weights."""
  x, K = idx_xK.shape
  E = w_eDm[0].shape[0] * shards
  cap = capacity(x, K, shards, E // shards, settings.capacity_factor)
  choice.dispatch_kind(settings.dispatch)  # refused where it cannot run, even unused
  if shards == 1 and cap == capacity(x, K, 1, E, None):
    none = jnp.zeros((), jnp.float32)
    return experts_local(x_xD, idx_xK, weights_xK, *w_eDm, settings.ffn), none, none
  chunks = settings.chunk_count(x)
  one_stage_ragged = choice.dispatch_kind(settings.dispatch) != "fixed" and not settings.two_stage(shards)
  if chunks == 1 or one_stage_ragged:  # the ragged exchange runs its chunks in the same rounds itself
    return exchanged(x_xD, idx_xK, weights_xK, w_eDm, valid_x, settings, shards, chunks)
  # the chunks' exchanges are independent: XLA schedules one chunk's dispatch and combine beside another's GEMMs
  ends = np.linspace(0, x, chunks + 1).astype(int)
  parts = [exchanged(x_xD[a:b], idx_xK[a:b], weights_xK[a:b], w_eDm, valid_x[a:b], settings, shards)
           for a, b in zip(ends[:-1], ends[1:])]
  y, dropped, extra = zip(*parts)
  return jnp.concatenate(y), sum(dropped), sum(extra)


def exchanged(x_xD, idx_xK, weights_xK, w_eDm: tuple, valid_x: jax.Array, settings: Settings, shards: int,
              chunks: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`routed` for a shard's tokens (or one chunk of them) through the expert-parallel exchange."""
  x, K = idx_xK.shape
  E = w_eDm[0].shape[0] * shards
  cap = capacity(x, K, shards, E // shards, settings.capacity_factor)
  ragged = choice.dispatch_kind(settings.dispatch) != "fixed"
  none = jnp.zeros((), jnp.float32)
  axes, valid_X = rules.split_axes("experts"), valid_x > 0
  if settings.two_stage(shards):
    rows, reach = receive_rows(x, K, shards, cap, settings.recv_factor), settings.nodes_reached(shards, K)
    y_xD, extra = experts_two_stage(x_xD, idx_xK, weights_xK, w_eDm, axes, shards, settings.node, rows,
                                    matmul=settings.ffn, fp8_dispatch=settings.fp8_dispatch, valid_X=valid_X,
                                    reach=reach, node_rows=settings.node_rows(x, shards, reach))
    return y_xD, none, extra
  if ragged and shards > 1:
    rows = receive_rows(x, K, shards, cap, settings.recv_factor)
    y_xD, kept_Kx, extra_Kx = experts_parallel_ragged(x_xD, idx_xK, weights_xK, *w_eDm, axes, shards, cap, rows,
                                            matmul=settings.ffn, fp8_dispatch=settings.fp8_dispatch,
                                            valid_X=valid_X, chunks=chunks)
  else:
    y_xD, kept_Kx, extra_Kx = experts_parallel(x_xD, idx_xK, weights_xK, *w_eDm, axes, shards, cap,
                                     matmul=settings.ffn, fp8_dispatch=settings.fp8_dispatch, valid_X=valid_X)
  count = lambda a_Kx: (a_Kx.astype(jnp.float32) * valid_x).sum()
  return y_xD, count(~kept_Kx), count(extra_Kx)


def typed_axes_hold(settings: Settings, w_gate_EDM: jax.Array) -> bool:
  """Whether JAX's varying-axes check can hold over the MoE's shard_map (its `check_vma`). Under the vmap over data
  shards of train.grad_compression (spmd_axis_name="data") the per-shard values count as varying over data, which
  no spec may name; tokamax's kernels give weight gradients without varying-axes types; inside gradsum's
  shard_map manual over `expert` values vary there without a type that says so. The check is off in those."""
  mesh = jax.sharding.get_abstract_mesh()
  outer = set(mesh.manual_axes) & set(rules.split_axes("experts"))
  tensor = math.prod(mesh.shape[a] for a in rules.mesh_axes("expert_mlp"))
  kind = choice.matmul_kind(settings.matmul, dtype=w_gate_EDM.dtype,
                            dims=(w_gate_EDM.shape[1], w_gate_EDM.shape[2] // tensor))
  return not rules.reserved_axes() and not outer and kind not in choice.GPU_MATMUL and settings.ffn == settings.matmul


def experts_parallel(x_XD, idx_XK, weights_XK, w_gate_eDm, w_up_eDm, w_down_emD, axes: tuple[str, ...],
                     shards: int, cap: int, *, matmul: str = "auto", fp8_dispatch: bool = False,
                     valid_X: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Expert-parallel computation with fixed buffers: all_to_all out, grouped matmuls, all_to_all back.

  Tokens with valid_X false (padding) are not sent and take no capacity (their output is zero). Returns the
  (partial, if m < M) output [X, D] and which copies were kept [K, X] (k-major, as buffered).
  """
  X, K = idx_XK.shape
  D, e = x_XD.shape[1], w_gate_eDm.shape[0]
  idx_J = idx_XK.T.reshape(-1)  # copy j = k·X + x: first choices fill the buffers first
  slot_J = send_slots(idx_J // e, shards, cap, None if valid_X is None else jnp.tile(valid_X, K))
  rows = shards * cap
  copy_R = jnp.full((rows,), K * X, jnp.int32).at[slot_J].set(jnp.arange(K * X, dtype=jnp.int32), mode="drop")
  filled_R = copy_R < K * X
  send_RD = jnp.where(filled_R[:, None], x_XD[copy_R % X], 0)
  local_R = jnp.where(filled_R, idx_J.at[copy_R].get(mode="clip") % e, e)  # e: an empty row, no expert

  def exchange(a, plan=()):
    if shards == 1:
      return a
    return jax.lax.all_to_all(a.reshape(shards, cap, *a.shape[1:]), axes, 0, 0).reshape(a.shape)

  y_RD = experts_local(dispatch(exchange, exchange, send_RD, (), fp8_out=fp8_dispatch), exchange(local_R)[:, None],
                       jnp.ones((rows, 1), jnp.float32), w_gate_eDm, w_up_eDm, w_down_emD, matmul, padded=True)
  y_JD = dispatch(exchange, exchange, y_RD, (), fp8_back=fp8_dispatch).at[slot_J].get(mode="fill", fill_value=0)
  weights_KX = weights_XK.T.astype(y_JD.dtype)
  y_XD = jnp.einsum("KXD,KX->XD", y_JD.reshape(K, X, D), weights_KX)
  sent_KX = (slot_J < rows).reshape(K, X)
  return y_XD, sent_KX, jnp.zeros_like(sent_KX)


def experts_parallel_ragged(x_XD, idx_XK, weights_XK, w_gate_eDm, w_up_eDm, w_down_emD, axes: tuple[str, ...],
                            shards: int, cap: int, rows: int, *, matmul: str = "auto", fp8_dispatch: bool = False,
                            exchange: Callable = jax.lax.ragged_all_to_all, valid_X: jax.Array | None = None,
                            groups: tuple[tuple[int, ...], ...] | None = None, chunks: int = 1
                            ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Expert-parallel computation with exact sizes: counts all-gathered, `ragged_all_to_all` of the routed copies
  into R = `rows` rows grouped by local expert, grouped matmuls, `ragged_all_to_all` back, weighted combine.

  The capacity rule (`cap` per destination, k-major) applies first, as in `experts_parallel` (dropless at the
  worst-case `cap`); padding tokens' copies (valid_X false) are never sent. Where a destination receives more
  than R copies, the rest go in further rounds of R rows (`rounds_needed`, at most ⌈P·C / R⌉; each extra round
  recomputed in the backward, so memory stays at one round's): no copy is dropped for want of receive rows.
  `chunks` (dropless only): the tokens split into that many consecutive chunks, each with its own exchanges and
  a receive buffer of its share of R, all in the same rounds; the chunks are independent, so XLA can run one
  chunk's dispatch or combine beside another chunk's grouped matmuls.
  `exchange` has `jax.lax.ragged_all_to_all`'s signature (tests emulate it on CPU, where XLA has none).
  `groups`: the exchange runs inside each group of devices of `axes` (axis_index_groups; `shards` = its size),
  as the second stage of `experts_two_stage` does within a node. Returns the (partial, if m < M) output [X, D],
  which copies were sent [K, X] and which went after the first round [K, X].
  """
  X, K = idx_XK.shape
  e, w_eDm = w_gate_eDm.shape[0], (w_gate_eDm, w_up_eDm, w_down_emD)
  ends = np.linspace(0, X, chunks + 1).astype(int)
  parts = [_Chunk.of(x_XD[a:b], idx_XK[a:b], None if valid_X is None else valid_X[a:b], shards, e,
                     min(cap, (b - a) * min(K, e)), -(-rows * (b - a) // X)) for a, b in zip(ends[:-1], ends[1:])]
  count_cPE = jnp.moveaxis(jax.lax.all_gather(jnp.stack([c.count_E for c in parts]), axes,
                                              axis_index_groups=groups), 0, 1).reshape(len(parts), shards, -1)
  me, grouped_kw = rank_in_group(axes, groups), {} if groups is None else {"axis_index_groups": groups}
  rounds = functools.reduce(jnp.maximum, [rounds_needed(n_PE, c.rows) for n_PE, c in zip(count_cPE, parts)])

  def one_round(r):
    return _overlapped_round(parts, count_cPE, me, r, w_eDm, exchange=functools.partial(
        exchange, axis_name=axes, **grouped_kw), matmul=matmul, fp8_dispatch=fp8_dispatch)

  extra = max(-(-shards * c.cap // c.rows) for c in parts) - 1  # the most further rounds any routing can need
  skipped = tuple(zeros_like_round(c.send_JD, *w_eDm) for c in parts)
  back = _further_rounds(one_round, one_round(0), rounds, extra, skipped)
  out = [c.combined(back_JD, weights_XK[a:b], ragged_plan(n_PE, me, c.rows))
         for c, back_JD, n_PE, a, b in zip(parts, back, count_cPE, ends[:-1], ends[1:])]
  y, sent, later_sent = zip(*out)
  return jnp.concatenate(y), jnp.concatenate(sent, 1), jnp.concatenate(later_sent, 1)


def _overlapped_round(parts, count_cPE, me, r, w_eDm: tuple, *, exchange: Callable, matmul: str,
                      fp8_dispatch: bool) -> tuple[jax.Array, ...]:
  """One round of every chunk's exchange, the rows each returns at its send positions [J, D] (rows not sent this
  round stay zero), traced in the order a schedule that hides them would run: chunk i+1's dispatch before chunk
  i's expert GEMMs, the first chunk's combine before the last chunk's GEMMs. The chunks share no data, so XLA's
  scheduler is free to run a collective beside another chunk's compute (one collective in flight at a time)."""
  n = len(parts)
  senders = [c.sender(n_PE, me, r * c.rows, exchange, fp8_dispatch) for c, n_PE in zip(parts, count_cPE)]
  (first_out, first_back), _ = senders[0]
  recv, y, back = [first_out()], [], [None] * n
  for i, (_, plan) in enumerate(senders):
    if i + 1 < n:
      recv.append(senders[i + 1][0][0]())  # the next chunk's dispatch before this chunk's GEMMs
    elif n > 1:
      back[0] = first_back(y[0])  # the first chunk's combine before the last chunk's GEMMs
    y.append(expert_ffn(recv[i], plan.group_sizes_e, *w_eDm, matmul))
  return tuple(b if b is not None else senders[i][0][1](y[i]) for i, b in enumerate(back))


class _Chunk(NamedTuple):
  """One chunk of a shard's tokens in the ragged exchange: its send buffer in expert order, the copies each
  expert gets from it, and its receive rows a round."""

  send_JD: jax.Array
  order_J: jax.Array
  key_J: jax.Array
  count_E: jax.Array
  cap: int
  rows: int

  @classmethod
  def of(cls, x_XD, idx_XK, valid_X, shards: int, e: int, cap: int, rows: int) -> "_Chunk":
    order_J, key_J, count_E = send_order(idx_XK, shards, e, cap, valid_X)
    return cls(x_XD[order_J % x_XD.shape[0]], order_J, key_J, count_E, cap, rows)

  def sender(self, count_PE, me, first, exchange: Callable, fp8_dispatch: bool):
    """(dispatch, combine) of the round that receives positions [first, first + R), and its plan."""
    plan = ragged_plan(count_PE, me, self.rows, first)

    def send(a, plan):
      return exchange(a, zero_rows(a, self.rows), plan.send_offsets_E, plan.send_sizes_E, plan.out_offsets_E,
                      plan.recv_sizes_E)

    def back(a, plan):
      return exchange(a, zero_rows(a, self.send_JD.shape[0]), plan.recv_offsets_E, plan.recv_sizes_E,
                      plan.back_offsets_E, plan.send_sizes_E)

    return (lambda: dispatch(send, back, self.send_JD, plan, fp8_out=fp8_dispatch),
            lambda y_RD: dispatch(back, send, y_RD, plan, fp8_back=fp8_dispatch)), plan

  def combined(self, back_JD, weights_XK, plan: RaggedPlan):
    """The chunk's weighted output [X, D], which copies were sent [K, X], and which after the first round."""
    X, K = weights_XK.shape
    J = K * X
    position_J = jnp.zeros((J,), jnp.int32).at[self.order_J].set(jnp.arange(J, dtype=jnp.int32))
    y_XD = jnp.einsum("KXD,KX->XD", back_JD[position_J].reshape(K, X, -1), weights_XK.T.astype(back_JD.dtype))
    sent_J = self.key_J < plan.send_sizes_E.shape[0]
    first_J = kept_sorted(self.key_J, plan)
    return y_XD, sent_J[position_J].reshape(K, X), (sent_J & ~first_J)[position_J].reshape(K, X)


def experts_two_stage(x_XD, idx_XK, weights_XK, w_eDm: tuple, axes: tuple[str, ...], shards: int, node: int,
                      rows: int, *, matmul: str = "auto", fp8_dispatch: bool = False,
                      exchange: Callable = jax.lax.ragged_all_to_all, valid_X: jax.Array | None = None,
                      reach: int | None = None, node_rows: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Node-limited dispatch on an expert axis of `shards` devices, `node` per node. Stage 1 (across nodes):
  each token's hidden state goes once to every node holding one of its experts, to the device of this device's
  local rank there, with its expert ids and gate weights on that node (`ragged_all_to_all` among the devices of
  one local rank; at most one row per token and node, so N·X rows hold any routing). A device sends at most
  `reach`·X rows (`reach`: the most nodes one token's experts lie on, which the routing guarantees; None: N), so
  its send and return buffers hold that many. It receives in rounds of `node_rows` rows (None: N·X, one round):
  where its senders' rows exceed them, further rounds carry the rest (run only where some device of the axis
  needs them, recomputed in the backward), so the buffer follows the rows a device expects, not all that could
  arrive. Stage 2 (within the node, on each round's rows): `experts_parallel_ragged` over the node's devices,
  which runs the experts and sums each row's weighted expert outputs there. The sums come back by stage 1's
  reverse, one row per token and node, and are added. With `fp8_dispatch` both stages send the tokens as e4m3
  (the second rounding is exact: the same tiles and scales), the combine comes back in the compute dtype.
  Returns the (partial, if m < M) output [X, D] and the copies sent after the first round of either stage []
  (nothing is dropped)."""
  X, K = idx_XK.shape
  e, N = w_eDm[0].shape[0], shards // node
  within, across = node_groups(shards, node)
  S = min(N, reach or N) * X  # what one device can send: the slots sorted by node hold every sent row first
  R = N * X if node_rows is None else max(1, min(node_rows, N * X))
  token_S, sent_S, meta_SK2, count_N = _node_sends(idx_XK, weights_XK, valid_X, e * node, N, S)
  count_NN = jax.lax.all_gather(count_N, axes, axis_index_groups=across)
  me, x_SD = rank_in_group(axes, across), x_XD[token_S]

  def send(a, plan):
    return exchange(a, zero_rows(a, R), plan.send_offsets_E, plan.send_sizes_E, plan.out_offsets_E,
                    plan.recv_sizes_E, axis_name=axes, axis_index_groups=across)

  def back(a, plan):
    return exchange(a, zero_rows(a, S), plan.recv_offsets_E, plan.recv_sizes_E, plan.back_offsets_E,
                    plan.send_sizes_E, axis_name=axes, axis_index_groups=across)

  def one_round(r):
    plan = ragged_plan(count_NN, me, R, r * R)
    recv_RD = dispatch(send, back, x_SD, plan, fp8_out=fp8_dispatch)
    meta_RK2 = dispatch(send, back, meta_SK2, plan)
    ids_RK = jax.lax.stop_gradient(meta_RK2[:, :K]).astype(jnp.int32)
    valid_RK = ids_RK >= 0  # rows past what arrived hold zeros: id 0, weight 0, and are left out here
    valid_RK = valid_RK & (jnp.arange(R) < plan.group_sizes_e.sum())[:, None]
    y_RD, extra = _within_node(recv_RD, jnp.where(valid_RK, ids_RK, 0), meta_RK2[:, K:], valid_RK, w_eDm, axes,
                               node, rows, within, matmul=matmul, fp8_dispatch=fp8_dispatch, exchange=exchange)
    later = valid_RK.astype(jnp.float32).sum()  # a further round's copies all go after the first
    return dispatch(back, send, y_RD, plan), jnp.where(r > 0, later, extra)  # one row per token and node

  back_SD, extra = one_round(0)
  # the rounds the busiest receiver of the whole axis needs: its node's devices exchange together in stage 2
  rounds = jax.lax.pmax(rounds_needed(count_NN, R), axes) if R < N * X else 1
  back_SD, extra = _further_rounds(one_round, (back_SD, extra), rounds, -(-N * X // R) - 1,
                                  (zeros_like_round(back_SD, *w_eDm), jnp.zeros((), jnp.float32)))
  y_XD = jnp.zeros_like(x_XD).at[token_S].add(jnp.where(sent_S, back_SD, 0))
  return y_XD, extra


def _node_sends(idx_XK, weights_XK, valid_X, per_node: int, N: int, S: int):
  """Stage 1's send side of `experts_two_stage`: slot n·X + t holds token t for node n where one of its experts
  lies there, sorted by node and cut to the S slots that can be sent. Returns each slot's token [S], whether it
  is sent [S, 1], its expert ids on that node (−1 elsewhere) and gate weights [S, 2K], and the rows for each
  node [N] (`per_node`: the experts a node holds)."""
  X, K = idx_XK.shape
  node_XK = idx_XK // per_node
  reach_XN = (jax.nn.one_hot(node_XK, N, dtype=jnp.bool_) & (True if valid_X is None else valid_X[:, None, None])
              ).any(1)
  key_S = jnp.where(reach_XN.T, jnp.arange(N)[:, None], N).reshape(-1)
  order_S = jnp.argsort(key_S, stable=True)[:S]
  sent_S, token_S, node_S = (key_S[order_S] < N)[:, None], order_S % X, order_S // X
  mine_SK = (node_XK[token_S] == node_S[:, None]) & sent_S
  local_SK = idx_XK[token_S] - node_S[:, None] * per_node  # expert ids within the receiving node
  meta_SK2 = jnp.concatenate([jax.lax.stop_gradient(jnp.where(mine_SK, local_SK, -1).astype(jnp.float32)),
                              jnp.where(mine_SK, weights_XK[token_S], 0).astype(jnp.float32)], axis=1)
  return token_S, sent_S, meta_SK2, jnp.bincount(key_S, length=N + 1)[:N].astype(jnp.int32)


def _further_rounds(one_round: Callable, first, rounds, last: int, skipped):
  """`first` (round 0's result) plus one_round(r) for r = 1 … `last`, each run only while r < `rounds` (the same
  on every device that exchanges together; `skipped` stands for the others) and recomputed in the backward, so
  memory stays at one round's; their ops carry FURTHER."""
  if last < 1:
    return first
  later = jax.checkpoint(lambda r: jax.lax.cond(r < rounds, one_round, lambda _: skipped, r))
  with set_xla_metadata(**FURTHER):
    total, _ = jax.lax.scan(lambda acc, r: (jax.tree.map(jnp.add, acc, later(r)), None), first,
                            jnp.arange(1, last + 1))
  return total


def _within_node(recv_RD, ids_RK, weights_RK, valid_RK, w_eDm: tuple, axes: tuple[str, ...], node: int,
                 rows: int, within, **kw) -> tuple[jax.Array, jax.Array]:
  """Stage 2 of `experts_two_stage`: the weighted sum of each received row's expert outputs on this node [R, D]
  and the copies sent after the first round []. The valid copies (row r, its k-th expert here) go through
  `experts_parallel_ragged` among the node's devices in windows of W = min(R·K, `rows`) copies, one copy a
  token: memory follows the W copies of one window, not the R·K a node could receive in the worst case.
  Further windows run (recomputed in the backward, as further rounds are) only while some device of the axis
  has copies left; their copies count as sent after the first round."""
  R, K = ids_RK.shape
  W, e = min(R * K, rows), w_eDm[0].shape[0]
  valid_C = valid_RK.reshape(-1)
  order_C = jnp.argsort(~valid_C, stable=True)  # the valid copies first, in row order
  have = valid_C.sum()
  windows = jnp.maximum(-(-jax.lax.all_gather(have, axes).max() // W), 1)  # the same on every device of the axis

  def window(w):
    position_W = w * W + jnp.arange(W)
    copy_W = order_C[jnp.minimum(position_W, R * K - 1)]
    live_W = (position_W < have) & valid_C[copy_W]
    y_WD, _, extra_1W = experts_parallel_ragged(
        recv_RD[copy_W // K], ids_RK.reshape(-1)[copy_W, None], weights_RK.reshape(-1)[copy_W, None], *w_eDm, axes,
        node, capacity(W, 1, node, e, None), rows, valid_X=live_W, groups=within, **kw)
    y_RD = jnp.zeros_like(recv_RD, dtype=y_WD.dtype).at[copy_W // K].add(jnp.where(live_W[:, None], y_WD, 0))
    return y_RD, extra_1W.astype(jnp.float32).sum()

  y_RD, extra = window(0)
  if -(-R * K // W) > 1:
    skip = lambda _: (jnp.zeros_like(y_RD) + grouped.varying_zero(recv_RD, *w_eDm).astype(y_RD.dtype),
                      jnp.zeros((), jnp.float32))
    later = jax.checkpoint(lambda w: jax.lax.cond(w < windows, window, skip, w))

    def step(acc, w):
      y, n = later(w)
      return (acc[0] + y, acc[1] + n), None

    with set_xla_metadata(**FURTHER):
      (y_RD, extra), _ = jax.lax.scan(step, (y_RD, extra), jnp.arange(1, -(-R * K // W)))
    extra = extra + jnp.maximum(have - W, 0).astype(jnp.float32)
  return y_RD, extra


def dispatch_summary(cfg, sizes: dict[str, int], where: str | None = None, node: int | None = None) -> str:
  """One line for the start-up summary (cfg: the run's Config, sizes: the mesh's axis sizes, node: expert shards
  per node): how routed tokens reach the expert shards and the rows one MoE layer sends per device (x local
  tokens per microbatch)."""
  m, t = cfg.model, cfg.train
  if not m.is_moe:
    return "MoE dispatch: none (dense model)"
  on_tensor = sizes.get("tensor", 1) if "tensor" in expert_axes(m) else 1  # tensor ranks as expert shards
  P, K = sizes.get("expert", 1) * on_tensor, m.num_experts_per_tok
  if P == 1:
    return f"MoE dispatch: none (mesh.expert=1: all {m.n_routed_experts} experts on every device)"
  x = (t.batch_size // t.microbatches // (sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("expert", 1))
       * t.seq_len // sizes.get("context", 1) // on_tensor)
  over = f"expert × tensor = {P} (model.moe_tensor=experts)" if on_tensor > 1 else f"expert={P}"
  cap = capacity(x, K, P, m.n_routed_experts // P, m.moe_capacity_factor)
  rows = f"{m.moe_dispatch_dtype} rows with float32 scales per 128 channels" if m.moe_dispatch_dtype else \
      f"{t.compute_dtype} rows"
  if choice.dispatch_kind(m.moe_dispatch, where) == "fixed":
    return (f"MoE dispatch: fixed all_to_all over {over}, {P} × {cap} = {P * cap} rows per device for "
            f"K·x = {K * x} token copies; {rows}, results back in {t.compute_dtype}")
  recv, settings = receive_rows(x, K, P, cap, m.moe_recv_factor), Settings.from_config(m, node)
  chunks = settings.chunk_count(x)
  split = (f"; each device's {x} tokens in {chunks} chunks with their own exchanges, so one chunk's dispatch "
           f"and combine can run beside another's expert GEMMs (model.moe_overlap_chunks)") if chunks > 1 else ""
  if settings.two_stage(P, where):
    reach = settings.nodes_reached(P, K)
    why = (f" (model.moe_dispatch=auto: the expert axis spans {P // node} nodes and the exchange is dropless; "
           f"ragged keeps one stage)") if m.moe_dispatch == "auto" else ""
    return (f"MoE dispatch: two-stage (node-limited) over {over} as {P // node} nodes × {node}: each token's "
            f"row crosses to a node at most once (≤ {reach} rows a token instead of its {K} copies) into a receive "
            f"buffer of {settings.node_rows(x, P, reach)} rows a round, then fans out within the node into a "
            f"receive buffer of {recv} rows a round (further rounds past either, none dropped); the node's sums "
            f"come back one row per token and node; {rows}, results back in {t.compute_dtype}{split}{why}")
  instead = ""
  if settings.spans_nodes(P) and m.moe_capacity_factor is not None and m.moe_dispatch != "ragged":
    instead = (f" (the expert axis spans {P // node} nodes, but model.moe_capacity_factor applies per pair of "
               f"devices: model.moe_dispatch={m.moe_dispatch} runs as this one-stage exchange; null for two stages)")
  elif m.moe_dispatch == "two_stage":  # asked for, but there is no second level to fan out in
    spans = f"the expert axis's {P} shards lie within one node" if node is None or node >= P else \
        f"{node} devices a node do not split the expert axis's {P} shards into whole nodes"
    instead = f" (model.moe_dispatch=two_stage runs as this one-stage exchange: {spans})"
  return (f"MoE dispatch: ragged_all_to_all over {over}, exactly the K·x = {K * x} token copies per device "
          f"into a receive buffer of {recv} rows a round (model.moe_recv_factor={m.moe_recv_factor:g}: one round "
          f"from {min(P, m.n_routed_experts / K):g}, further rounds past it, none dropped); {rows}, results back in "
          f"{t.compute_dtype}{split}{instead}")


def _manual_axes() -> tuple[str, ...]:
  mesh = jax.sharding.get_abstract_mesh()
  return () if mesh.empty else tuple(mesh.manual_axes)
