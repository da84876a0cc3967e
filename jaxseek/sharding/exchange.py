"""The pieces the expert exchange is built of (sharding/experts.py puts them together): the capacity rule and
send slots of the fixed exchange, the send order, plans and rounds of the exact-size ragged one, the device
groups of the node-limited one, and `dispatch`, an exchange with its own transpose and float8 rows.

Shape key as in sharding/experts.py: J = K·X token copies, P expert-axis shards, E experts (e per shard),
C buffer rows per shard pair, R receive rows.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxseek.kernels import fp8, grouped


def capacity(tokens: int, k: int, shards: int, local_experts: int, factor: float | None) -> int:
  """Buffer rows per (source, destination) shard pair: factor × the balanced load, at most the worst case."""
  worst = tokens * min(k, local_experts)
  if factor is None:
    return worst
  return max(1, min(worst, math.ceil(factor * tokens * k / shards)))


def group_reach(experts: int, n_group: int, topk_group: int, P: int, g: int) -> tuple[int, int]:
  """(shards, nodes) one token's experts can lie on under group-limited routing (the `topk_group` best of
  `n_group` groups of `experts`, laid out in order on P expert shards of g to a node). DeepSeek-V3 on 64 shards
  of 8 to a node: a group's 32 experts fill one node's 8 shards, so a token reaches at most 4 nodes."""
  per_group, per_shard = experts // n_group, experts // P
  spans = []  # (shards, nodes) group k's experts lie on
  for k in range(n_group):
    lo, hi = k * per_group // per_shard, ((k + 1) * per_group - 1) // per_shard
    spans.append((hi - lo + 1, hi // g - lo // g + 1))
  return min(P, topk_group * max(spans)[0]), min(max(1, P // g), topk_group * max(n for _, n in spans))


def send_slots(dest_J: jax.Array, shards: int, cap: int, valid_J: jax.Array | None = None) -> jax.Array:
  """Buffer slot of each copy: destination · C + its rank among that destination's copies; dropped: P·C. Copies
  of padding tokens (valid_J false) are dropped and rank after every real copy, so they take no capacity."""
  J = dest_J.shape[0]
  order_J = jnp.argsort(dest_J if valid_J is None else dest_J * 2 + (1 - valid_J.astype(dest_J.dtype)), stable=True)
  count_P = jnp.bincount(dest_J, length=shards)
  rank_sorted_J = jnp.arange(J) - (jnp.cumsum(count_P) - count_P)[dest_J[order_J]]
  rank_J = jnp.zeros((J,), jnp.int32).at[order_J].set(rank_sorted_J.astype(jnp.int32))
  keep_J = rank_J < cap if valid_J is None else (rank_J < cap) & valid_J.astype(bool)
  return jnp.where(keep_J, dest_J * cap + rank_J, shards * cap)


def receive_rows(tokens: int, k: int, shards: int, cap: int, factor: float) -> int:
  """R, the rows of a device's ragged receive buffer: ⌈factor · K·x⌉, at most all that can arrive (P · C)."""
  return max(1, min(shards * cap, math.ceil(factor * tokens * k)))


class RaggedPlan(NamedTuple):
  """One device's side of both `ragged_all_to_all` calls. Slice i = peer · e + local expert (E slices, e per
  peer); the forward call sends (send_offsets, send_sizes) to (out_offsets) and receives recv_sizes, the return
  call sends (recv_offsets, recv_sizes) to (back_offsets) and receives send_sizes."""

  send_offsets_E: jax.Array  # start of slice i in this device's send buffer (sorted by global expert; 0 if empty)
  send_sizes_E: jax.Array  # rows of slice i sent to peer i // e (the kept ones)
  out_offsets_E: jax.Array  # where slice i lands in peer i // e's receive buffer
  recv_sizes_E: jax.Array  # rows received from source i // e for local expert i % e
  recv_offsets_E: jax.Array  # where those rows lie in this device's receive buffer
  back_offsets_E: jax.Array  # where they return to in source i // e's send buffer
  group_sizes_e: jax.Array  # rows of each local expert in the receive buffer (expert-major, from offset 0)


def ragged_plan(count_PE: jax.Array, me: jax.Array | int, rows: int, first: jax.Array | int = 0) -> RaggedPlan:
  """Device `me`'s plan for one round from every source's copy counts per global expert [P (source), E], the
  receive rows R and the round's first receive position (round r: r·R).

  Receive order of destination q, expert-major: local expert 0's rows from source 0, 1, ..., P-1, then local
  expert 1's, ...; slice (l, s) spans positions [start, start + count) with start[q, l, s] = Σ of the slices
  before it. A round carries the positions [first, first + R) into a buffer of R rows: slice (l, s) sends the
  part of its span inside them, at receive offset lo − first (lo = clip(start, first, first + R)), from its send
  offset plus lo − start. Round 0 alone is the single-buffer plan: copies past R are the tail of the
  (destination, expert, source) order. Slices that send nothing in the round get offset 0.
  """
  P, E = count_PE.shape
  e = E // P
  count_PPe = count_PE.reshape(P, P, e)  # [source, destination, local expert]
  arrive_PeP = count_PPe.transpose(1, 2, 0)  # [destination, local expert, source]: each receive buffer's order
  flat_PR = arrive_PeP.reshape(P, e * P)
  start_PeP = (jnp.cumsum(flat_PR, axis=1) - flat_PR).reshape(P, e, P)
  lo_PeP = jnp.clip(start_PeP, first, first + rows)
  kept_PeP = jnp.clip(start_PeP + arrive_PeP, first, first + rows) - lo_PeP
  skip_PeP = lo_PeP - start_PeP  # the slice's rows sent in earlier rounds
  recv_PeP = jnp.where(kept_PeP > 0, lo_PeP - first, 0)  # an empty slice at 0, never past the end of a buffer
  send_start_PPe = (jnp.cumsum(count_PE, axis=1) - count_PE).reshape(P, P, e) + skip_PeP.transpose(2, 0, 1)
  send_start_PPe = jnp.where(kept_PeP.transpose(2, 0, 1) > 0, send_start_PPe, 0)
  mine_eP = kept_PeP[me]
  return RaggedPlan(send_offsets_E=send_start_PPe[me].reshape(E),
                    send_sizes_E=kept_PeP[:, :, me].reshape(E),
                    out_offsets_E=recv_PeP[:, :, me].reshape(E),
                    recv_sizes_E=mine_eP.T.reshape(E),
                    recv_offsets_E=recv_PeP[me].T.reshape(E),
                    back_offsets_E=send_start_PPe[:, me].reshape(E),
                    group_sizes_e=mine_eP.sum(-1))


def rounds_needed(count_PE: jax.Array, rows: int) -> jax.Array:
  """The rounds of R = `rows` receive rows that carry every copy to the busiest destination (the same on every
  device: all read the all-gathered counts)."""
  P, E = count_PE.shape
  arrive_P = count_PE.reshape(P, P, E // P).sum((0, 2))
  return jnp.maximum(-(-arrive_P.max() // rows), 1)


def rank_in_group(axes: tuple[str, ...], groups) -> jax.Array:
  """This device's index within its group of `axes` (`groups`: axis_index_groups; None: the whole axes)."""
  me = jax.lax.axis_index(axes)
  if groups is None:
    return me
  rank = np.zeros(sum(len(g) for g in groups), np.int32)
  for group in groups:
    rank[list(group)] = np.arange(len(group))
  return jnp.asarray(rank)[me]


def node_groups(shards: int, node: int) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
  """(within each node, across nodes at one local rank): the axis_index_groups of the expert axis's `shards`
  devices, `node` consecutive ones per node."""
  nodes = shards // node
  within = tuple(tuple(n * node + g for g in range(node)) for n in range(nodes))
  across = tuple(tuple(n * node + g for n in range(nodes)) for g in range(node))
  return within, across


def send_order(idx_XK: jax.Array, shards: int, local_experts: int, cap: int, valid_X: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The ragged send buffer's order: copies (j = k·X + x) sorted by global expert, so by destination and within
  one by local expert, k-major within one expert; copies the capacity rule drops go last (key E, never sent), as
  do the copies `valid_X` leaves out (per token [X], or per copy [X, K]). Returns the copy at each position [J], its key [J] and the copies per expert within capacity [E]."""
  E = shards * local_experts
  idx_J = idx_XK.T.reshape(-1)
  valid_J = None if valid_X is None else (valid_X.T.reshape(-1) if valid_X.ndim == 2 else
                                          jnp.tile(valid_X, idx_XK.shape[1]))
  key_J = jnp.where(send_slots(idx_J // local_experts, shards, cap, valid_J) < shards * cap, idx_J, E)
  order_J = jnp.argsort(key_J, stable=True)
  return order_J, key_J[order_J], jnp.bincount(key_J, length=E + 1)[:E].astype(jnp.int32)


def kept_sorted(key_J: jax.Array, plan: RaggedPlan) -> jax.Array:
  """Which positions of the send buffer a round's plan sends (each slice's send_sizes rows from its offset; key E:
  none). An empty slice's offset is 0, and it keeps no rank."""
  E = plan.send_sizes_E.shape[0]
  slice_J = jnp.minimum(key_J, E - 1)
  rank_J = jnp.arange(key_J.shape[0], dtype=jnp.int32) - plan.send_offsets_E[slice_J]
  return (key_J < E) & (rank_J >= 0) & (rank_J < plan.send_sizes_E[slice_J])


def zeros_like_round(send_JD, *weights) -> jax.Array:
  """A skipped round's returned rows: zeros [J, D] varying over every mesh axis a round's result varies over."""
  return jnp.zeros_like(send_JD) + grouped.varying_zero(send_JD, *weights).astype(send_JD.dtype)


def zero_rows(a: jax.Array, n: int) -> jax.Array:
  """n zero rows like `a`'s, varying over the mesh axes `a` varies over (the result of ragged_all_to_all keeps the
  varying axes of its `output` operand)."""
  return jnp.zeros((n, *a.shape[1:]), a.dtype) + grouped.varying_zero(a).astype(a.dtype)


def dispatch(send: Callable, back: Callable, x_ND: jax.Array, plan, fp8_out: bool = False,
             fp8_back: bool = False) -> jax.Array:
  """send(x, plan), whose transpose is back(dy, plan) (the gradient goes back by it without JAX's own transpose
  rule, which would all_to_all the ragged offsets again). `fp8_out` / `fp8_back`: the rows of the forward / the
  backward exchange travel as e4m3 with a float32 scale per 1×128 tile beside each, dequantised to their dtype on
  arrival; the gradient passes straight through the rounding. DeepSeek-V3's FP8 dispatch is both directions
  that carry rows to the experts: the tokens in the forward (the dispatch's fp8_out), the gradients of the
  expert outputs in the backward (the combine's fp8_back); what comes back from the experts stays in the compute
  dtype."""
  return _dispatch(send, back, fp8_out, fp8_back, x_ND, plan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _dispatch(send, back, fp8_out, fp8_back, x_ND, plan):
  return _exchange(send, x_ND, plan, fp8_out)


def _exchange(send: Callable, x_ND: jax.Array, plan, fp8_rows: bool) -> jax.Array:
  """send(x, plan), the rows as e4m3 and their scales in one exchange of bytes [N, D + 4·⌈D/128⌉] when
  `fp8_rows`."""
  if not fp8_rows:
    return send(x_ND, plan)
  q_ND, scale_NT = fp8.to_e4m3_tiles(x_ND)
  N, D = x_ND.shape
  T = scale_NT.shape[1]
  packed = jnp.concatenate([jax.lax.bitcast_convert_type(q_ND, jnp.uint8),
                            jax.lax.bitcast_convert_type(scale_NT, jnp.uint8).reshape(N, 4 * T)], axis=1)
  got = send(packed, plan)
  q_MD = jax.lax.bitcast_convert_type(got[:, :D], fp8.E4M3)
  scale_MT = jax.lax.bitcast_convert_type(got[:, D:].reshape(-1, T, 4), jnp.float32)
  return fp8.from_e4m3_tiles(q_MD, scale_MT, x_ND.dtype)


def _dispatch_fwd(send, back, fp8_out, fp8_back, x_ND, plan):
  return _dispatch(send, back, fp8_out, fp8_back, x_ND, plan), plan


def _dispatch_bwd(send, back, fp8_out, fp8_back, plan, dy_MD):
  return _exchange(back, dy_MD, plan, fp8_back), jax.tree.map(lambda _: None, plan)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)
