"""Mixture of experts: router, shared experts, expert-parallel dispatch (sort by expert + grouped matmul).

Shape key (see jaxseek.model): X tokens of a shard flattened (B·T), E routed experts, K experts per token,
M expert hidden size, D model size; J = K·X token copies, P expert-axis shards, R buffer rows. Inside
`jax.shard_map` a lowercase letter is the local shard (e = E/P experts, m = M/|tensor|, x = local tokens).

Routing (float32):
  s = softmax(x·W_r) or sigmoid(x·W_r)
  device-limited        (optional) keep the `moe_max_expert_shards` expert shards with the largest sum of
                        their top-⌈K/M⌉ choice scores (P contiguous expert ranges, one per expert-axis shard)
  greedy                top-K of s
  group_limited_greedy  (V2) keep the `topk_group` groups with the largest max(s), then top-K
  noaux_tc              (V3) choose with s + b: keep the groups with the largest sum of their top-2, then
                        top-K; gate weights come from the unbiased s
  weights are renormalised (norm_topk_prob) and scaled by routed_scaling_factor.

Dispatch on the expert axis (P shards), `model.moe_dispatch` as `kernels.dispatch_kind` resolves it:
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
        kept[q, l, s] = clip(R − start, 0, count[s, q, l]),   R = min(⌈moe_recv_factor · J⌉, P · C)
      One `ragged_all_to_all` (E slices, e per peer) sends exactly the kept copies; the grouped matmul runs over
      the groups Σ_s kept[q, l, s] (no padding rows); a second one returns the results to the senders' sorted
      positions. Copies past R are dropped like copies past C and counted in the same `dropped`; with
      moe_recv_factor ≥ min(P, E/K) nothing is (R then holds the worst case, P · X · min(K, e)).
  moe_dispatch_dtype=float8_e4m3fn  the exchanges that carry rows to the experts travel as e4m3 with a float32
      scale per 1×128 tile (amax / 448): D + 4·⌈D/128⌉ bytes a row instead of 2·D in bfloat16, dequantised to the
      compute dtype on arrival. Forward: the dispatched tokens in e4m3, the expert results back in the compute
      dtype. Backward: the cotangents of the expert results go to the experts in e4m3 (the combine's transpose),
      the tokens' cotangents come back in the compute dtype. Each rounding is straight-through: its gradient is
      the identity (`dispatch`).
Compiled for 8 H200s (bench-v3-1b, 4 layers, batch 8 × 1024 on expert=8; docs/moe.md): fixed, every all_to_all
bf16[8, 4096, 2048] (32,768 rows for 4,096 copies), temp 3.99 GiB; ragged, 4,096 rows out into R = 8,192,
temp 1.64 GiB (1.61 with FP8 dispatch, 2,112 bytes a row).

The correction bias b is not trained: after each optimiser step b += rate · sign(mean(load) − load), with
loads summed over the whole global batch (train.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxseek.config import ModelConfig
from jaxseek.errors import UserError
from jaxseek.model import fp8, kernels
from jaxseek.model.layers import MLP, param
from jaxseek.sharding import rules


class RouterBias(nnx.Variable):
  """The aux-loss-free correction bias: updated from expert loads, never by the optimiser."""


@dataclasses.dataclass(frozen=True)
class Routing:
  """The router's settings (Hugging Face names, then jaxseek's device limit)."""

  scoring_func: str
  topk_method: str
  n_group: int
  topk_group: int
  num_experts_per_tok: int
  norm_topk_prob: bool
  routed_scaling_factor: float
  scale_after_norm: bool  # V3 renormalises and then scales; DeepSeek-MoE / V2 do one or the other
  max_expert_shards: int | None = None  # device-limited routing: at most this many expert shards per token
  expert_shards: int | None = None  # contiguous expert ranges for the limit; None: the mesh's expert axis

  @classmethod
  def from_config(cls, cfg: ModelConfig) -> "Routing":
    if cfg.moe_max_expert_shards is not None and cfg.moe_max_expert_shards < 1:
      raise UserError(f"config key model.moe_max_expert_shards: {cfg.moe_max_expert_shards} must be ≥ 1, "
                      f"or null for no device limit")
    return cls(cfg.scoring_func, cfg.topk_method, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok,
               cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.model_type == "deepseek_v3",
               max_expert_shards=cfg.moe_max_expert_shards)


def limit_shards(choice_XE: jax.Array, shards: int, max_shards: int, k: int) -> jax.Array:
  """Device-limited routing: -inf outside the `max_shards` expert ranges with the largest top-⌈k/max⌉ sums."""
  X, E = choice_XE.shape
  if E % shards or k > max_shards * (E // shards):
    raise UserError(f"config key model.moe_max_expert_shards: {max_shards} shards of the {shards} expert shards "
                    f"(n_routed_experts={E}) cannot hold num_experts_per_tok={k} experts per token; raise it")
  per_shard_XPe = choice_XE.reshape(X, shards, E // shards)
  top = min(-(-k // max_shards), E // shards)
  shard_score_XP = jax.lax.top_k(per_shard_XPe, top)[0].sum(-1)
  _, keep = jax.lax.top_k(shard_score_XP, max_shards)
  keep_XP = jax.nn.one_hot(keep, shards, dtype=jnp.bool_).any(axis=-2)
  return jnp.where(keep_XP[..., None], per_shard_XPe, -jnp.inf).reshape(X, E)


def route(logits_XE: jax.Array, bias_E: jax.Array | None, cfg: Routing,
          expert_shards: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Returns (expert ids [X, K], gate weights [X, K], scores [X, E]), all computed in float32."""
  logits_XE = logits_XE.astype(jnp.float32)
  scores_XE = jax.nn.sigmoid(logits_XE) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits_XE, axis=-1)
  choice_XE = scores_XE + bias_E if bias_E is not None else scores_XE
  X, E = choice_XE.shape
  shards = cfg.expert_shards or expert_shards
  if cfg.max_expert_shards is not None and cfg.max_expert_shards < shards:
    choice_XE = limit_shards(choice_XE, shards, cfg.max_expert_shards, cfg.num_experts_per_tok)
  if cfg.topk_method != "greedy" and cfg.n_group > 1:
    grouped_XGe = choice_XE.reshape(X, cfg.n_group, E // cfg.n_group)
    if cfg.topk_method == "noaux_tc":
      group_score_XG = jax.lax.top_k(grouped_XGe, 2)[0].sum(-1)
    else:
      group_score_XG = grouped_XGe.max(-1)
    _, top_groups = jax.lax.top_k(group_score_XG, cfg.topk_group)
    keep_XG = jax.nn.one_hot(top_groups, cfg.n_group, dtype=jnp.bool_).any(axis=-2)
    choice_XE = jnp.where(keep_XG[..., None], grouped_XGe, -jnp.inf).reshape(X, E)
  _, idx_XK = jax.lax.top_k(choice_XE, cfg.num_experts_per_tok)
  weights_XK = jnp.take_along_axis(scores_XE, idx_XK, axis=-1)
  if cfg.scale_after_norm:
    if cfg.norm_topk_prob:
      weights_XK = weights_XK / (weights_XK.sum(-1, keepdims=True) + 1e-20)
    weights_XK = weights_XK * cfg.routed_scaling_factor
  elif cfg.num_experts_per_tok > 1 and cfg.norm_topk_prob:  # DeepSeek-MoE / V2: renormalise or scale, not both
    weights_XK = weights_XK / (weights_XK.sum(-1, keepdims=True) + 1e-20)
  else:
    weights_XK = weights_XK * cfg.routed_scaling_factor
  return idx_XK, weights_XK, scores_XE


def ffn_ragged(x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD):
  """SwiGLU per expert group with `lax.ragged_dot` (a grouped GEMM on accelerators)."""
  gate_Rm = jax.lax.ragged_dot(x_RD, w_gate_EDm, sizes_E)
  up_Rm = jax.lax.ragged_dot(x_RD, w_up_EDm, sizes_E)
  return jax.lax.ragged_dot(jax.nn.silu(gate_Rm) * up_Rm, w_down_EmD, sizes_E)


def ffn_blocked(x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD):
  """SwiGLU per expert group over row blocks, each block padded to one expert (the CPU grouped matmul).

  XLA:CPU lowers `ragged_dot` to a dense product with every group (E× the work). Here each group is padded to a
  multiple of the block size n and a loop visits the blocks in use, each block one expert's matmuls with that
  expert's weights read in place, so the work is at most R + E·n rows and nothing E-sized is materialised.
  """
  R, D = x_RD.shape
  E = w_gate_EDm.shape[0]
  n = 2 ** int(math.log2(min(max(R // (4 * E), 8), 256)))
  blocks = -(-(R + E * (n - 1)) // n)
  padded_E = -(-sizes_E // n) * n
  ends_E, padded_ends_E = jnp.cumsum(sizes_E), jnp.cumsum(padded_E)
  row_R = jnp.arange(R)
  group_R = _count_at_most(ends_E, row_R)  # E past the last group: rows outside every group
  dest_R = jnp.where(group_R < E, (padded_ends_E - padded_E).at[group_R].get(mode="clip") + row_R
                     - (ends_E - sizes_E).at[group_R].get(mode="clip"), blocks * n)
  x_NnD = jnp.zeros((blocks * n, D), x_RD.dtype).at[dest_R].set(x_RD, mode="drop").reshape(blocks, n, D)
  expert_N = jnp.minimum(_count_at_most(padded_ends_E, jnp.arange(blocks) * n), E - 1)
  # Under shard_map, give every operand the same varying mesh axes here, where autodiff turns that broadcast's
  # transpose into the reductions the gradients need, so the custom backward below works on equal types.
  zero = _zero(x_NnD, w_gate_EDm, w_up_EDm, w_down_EmD)
  x_NnD, w_gate_EDm, w_up_EDm, w_down_EmD = (a + zero.astype(a.dtype)
                                             for a in (x_NnD, w_gate_EDm, w_up_EDm, w_down_EmD))
  y_NnD = _swiglu_blocks(x_NnD, expert_N, padded_ends_E[-1] // n, w_gate_EDm, w_up_EDm, w_down_EmD)
  return y_NnD.reshape(blocks * n, D).at[dest_R].get(mode="fill", fill_value=0)


def _count_at_most(sorted_E: jax.Array, query_Q: jax.Array) -> jax.Array:
  """searchsorted(sorted, query, side="right") as one comparison [Q, E]: jnp.searchsorted's vmap fails inside a
  shard_map under an enclosing vmap with spmd_axis_name (train.grad_compression)."""
  return (query_Q[:, None] >= sorted_E[None, :]).sum(-1, dtype=jnp.int32)


@jax.custom_vjp
def _swiglu_blocks(x_NnD, expert_N, used, w_gate_EDm, w_up_EDm, w_down_EmD):
  """y[i] = SwiGLU of block i with expert expert_N[i]'s weights for i < used, zeros after."""
  return _swiglu_blocks_fwd(x_NnD, expert_N, used, w_gate_EDm, w_up_EDm, w_down_EmD)[0]


def _zero(*arrays) -> jax.Array:
  """A scalar 0 that varies over every manual mesh axis any of `arrays` varies over (inside shard_map, operands,
  the two branches of a cond and a scan's carry must agree on that). No gradient flows back through it: the
  empty sums would tie each operand's cotangent to the others' (an input's to the weights'), which would keep a
  zero-bubble pipeline's W from running apart from its b."""
  return jax.lax.stop_gradient(sum(a.reshape(-1)[:0].sum().astype(jnp.float32) for a in arrays))


def _swiglu_blocks_fwd(x_NnD, expert_N, used, w_gate_EDm, w_up_EDm, w_down_EmD):
  def block(_, inputs):
    x_nD, e, i = inputs
    swiglu = lambda: ((jax.nn.silu(x_nD @ w_gate_EDm[e]) * (x_nD @ w_up_EDm[e])) @ w_down_EmD[e]).astype(x_nD.dtype)
    return None, jax.lax.cond(i < used, swiglu, lambda: jnp.zeros_like(x_nD))

  _, y_NnD = jax.lax.scan(block, None, (x_NnD, expert_N, jnp.arange(x_NnD.shape[0])))
  return y_NnD, (x_NnD, expert_N, used, w_gate_EDm, w_up_EDm, w_down_EmD)


def _swiglu_blocks_bwd(residuals, dy_NnD):
  """Two loops over the blocks: the first recomputes each block's hidden activations and gives the input's
  cotangent, with the hidden cotangents and activations the weight gradients need; the second accumulates each
  expert's weight gradients in place from those, in float32 (cast to the weights' dtype at the end). Each matmul
  runs once; a zero-bubble pipeline's W (sharding/wsplit.py) runs the second loop apart from the first."""
  x_NnD, expert_N, used, w_gate_EDm, w_up_EDm, w_down_EmD = residuals
  zero = _zero(dy_NnD, x_NnD)  # dy may vary over fewer axes than the operands
  blocks = jnp.arange(x_NnD.shape[0])

  def input_block(_, inputs):
    x_nD, dy_nD, e, i = inputs

    def backward():
      gate_nm, up_nm = x_nD @ w_gate_EDm[e], x_nD @ w_up_EDm[e]
      sig_nm = jax.nn.sigmoid(gate_nm)
      act_nm = gate_nm * sig_nm
      dh_nm = dy_nD @ w_down_EmD[e].T
      dup_nm = dh_nm * act_nm
      dgate_nm = dh_nm * up_nm * sig_nm * (1 + gate_nm * (1 - sig_nm))
      dx_nD = (dgate_nm @ w_gate_EDm[e].T + dup_nm @ w_up_EDm[e].T).astype(x_nD.dtype)
      return dx_nD, dgate_nm, dup_nm, act_nm * up_nm

    def skipped():
      m = w_gate_EDm.shape[-1]
      hidden = jnp.zeros((x_nD.shape[0], m), jnp.result_type(x_nD, w_gate_EDm)) + zero.astype(x_nD.dtype)
      return jnp.zeros_like(x_nD) + zero.astype(x_nD.dtype), hidden, hidden, hidden

    return None, jax.lax.cond(i < used, backward, skipped)

  _, (dx_NnD, dgate_Nnm, dup_Nnm, h_Nnm) = jax.lax.scan(input_block, None, (x_NnD, dy_NnD, expert_N, blocks))

  def weight_block(grads, inputs):
    x_nD, dy_nD, dgate_nm, dup_nm, h_nm, e, i = inputs
    product = lambda a, b: jnp.matmul(a.T, b, preferred_element_type=jnp.float32)

    def add(dw_gate, dw_up, dw_down):
      return (dw_gate.at[e].add(product(x_nD, dgate_nm)), dw_up.at[e].add(product(x_nD, dup_nm)),
              dw_down.at[e].add(product(h_nm, dy_nD)))

    return jax.lax.cond(i < used, add, lambda *g: g, *grads), None

  # accumulated over the blocks in float32 (in the compute dtype each block's addition would round the sum)
  weights = (w_gate_EDm, w_up_EDm, w_down_EmD)
  zeros = tuple(jnp.zeros(w.shape, jnp.float32) + zero for w in weights)
  grads, _ = jax.lax.scan(weight_block, zeros, (x_NnD, dy_NnD, dgate_Nnm, dup_Nnm, h_Nnm, expert_N, blocks))
  return (dx_NnD, None, None, *(g.astype(w.dtype) for g, w in zip(grads, weights)))


_swiglu_blocks.defvjp(_swiglu_blocks_fwd, _swiglu_blocks_bwd)


def ffn_tokamax(x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD, implementation="mosaic", pad_to=None):
  """SwiGLU per expert group with tokamax's grouped GEMM kernels (GPU): gate and up as one [D, 2m] product. The
  rows are padded to whole Mosaic tiles (the weight gradient's kernel takes R in multiples of 64); padded rows lie
  past the groups and give zeros."""
  R = x_RD.shape[0]
  pad = -R % (pad_to or (kernels.MOSAIC_GEMM_TILE if implementation == "mosaic" else 1))
  x_RD = jnp.pad(x_RD, ((0, pad), (0, 0))) if pad else x_RD
  w_in_ED2m = jnp.concatenate([w_gate_EDm, w_up_EDm], axis=-1)
  gate_up_R2m = kernels.tokamax_ragged_dot(x_RD, w_in_ED2m, sizes_E, implementation)
  gate_Rm, up_Rm = jnp.split(gate_up_R2m, 2, axis=-1)
  return kernels.tokamax_ragged_dot(jax.nn.silu(gate_Rm) * up_Rm, w_down_EmD, sizes_E, implementation)[:R]


def expert_ffn(x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD, matmul: str = "auto") -> jax.Array:
  """SwiGLU of rows sorted by expert (group e has sizes_E[e] rows; rows past the groups give zeros), by the
  grouped matmul `matmul` (model.moe_matmul) resolves to (`kernels.matmul_kind`)."""
  kind = kernels.matmul_kind(matmul, dtype=x_RD.dtype, dims=(x_RD.shape[-1], w_gate_EDm.shape[-1]))
  if kind in kernels.GPU_MATMUL:
    return ffn_tokamax(x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD, kernels.GPU_MATMUL[kind])
  ffn = ffn_blocked if kind == "blocked" else ffn_ragged
  return ffn(x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD)


def experts_local(x_XD, idx_XK, weights_XK, w_gate_EDm, w_up_EDm, w_down_EmD, matmul: str = "auto",
                  padded: bool = False) -> jax.Array:
  """Dropless expert computation on one shard: sort token copies by expert, grouped matmuls, weighted unsort.

  With `padded`, an id ≥ E selects no expert (zero output). Returns the (partial, if m < M) output [X, D].
  """
  X, K = idx_XK.shape
  E = w_gate_EDm.shape[0]
  flat_e = idx_XK.reshape(-1)
  order = jnp.argsort(flat_e, stable=True)
  token_of = order // K
  sizes_E = jnp.bincount(flat_e, length=E).astype(jnp.int32)
  y_sorted = expert_ffn(x_XD[token_of], sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD, matmul)
  y_sorted = y_sorted * weights_XK.reshape(-1)[order][:, None].astype(y_sorted.dtype)
  if padded:  # rows past the groups are undefined on some backends (a [R, D] mask, kept for the backward)
    y_sorted = jnp.where((flat_e[order] < E)[:, None], y_sorted, 0)
  return jnp.zeros_like(x_XD).at[token_of].add(y_sorted)


def capacity(tokens: int, k: int, shards: int, local_experts: int, factor: float | None) -> int:
  """Buffer rows per (source, destination) shard pair: factor × the balanced load, at most the worst case."""
  worst = tokens * min(k, local_experts)
  if factor is None:
    return worst
  return max(1, min(worst, math.ceil(factor * tokens * k / shards)))


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


def experts_parallel(x_XD, idx_XK, weights_XK, w_gate_eDm, w_up_eDm, w_down_emD, axes: tuple[str, ...],
                     shards: int, cap: int, matmul: str = "auto", fp8_dispatch: bool = False,
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
  return y_XD, (slot_J < rows).reshape(K, X)


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


def ragged_plan(count_PE: jax.Array, me: jax.Array | int, rows: int) -> RaggedPlan:
  """Device `me`'s plan from every source's copy counts per global expert [P (source), E] and the receive rows R.

  Receive buffer of destination q, expert-major: local expert 0's rows from source 0, 1, ..., P-1, then local
  expert 1's, ...; slice (l, s) starts at start[q, l, s] = Σ of the slices before it, and keeps
  clip(R − start, 0, count) rows: the copies past R are the tail of the (destination, expert, source) order.
  Slices that send nothing get offset 0.
  """
  P, E = count_PE.shape
  e = E // P
  count_PPe = count_PE.reshape(P, P, e)  # [source, destination, local expert]
  arrive_PeP = count_PPe.transpose(1, 2, 0)  # [destination, local expert, source]: each receive buffer's order
  flat_PR = arrive_PeP.reshape(P, e * P)
  start_PeP = (jnp.cumsum(flat_PR, axis=1) - flat_PR).reshape(P, e, P)
  kept_PeP = jnp.clip(rows - start_PeP, 0, arrive_PeP)
  start_PeP = jnp.where(kept_PeP > 0, start_PeP, 0)  # an empty slice at 0, never past the end of a buffer
  send_start_PPe = (jnp.cumsum(count_PE, axis=1) - count_PE).reshape(P, P, e)
  send_start_PPe = jnp.where(kept_PeP.transpose(2, 0, 1) > 0, send_start_PPe, 0)
  mine_eP = kept_PeP[me]
  return RaggedPlan(send_offsets_E=send_start_PPe[me].reshape(E),
                    send_sizes_E=kept_PeP[:, :, me].reshape(E),
                    out_offsets_E=start_PeP[:, :, me].reshape(E),
                    recv_sizes_E=mine_eP.T.reshape(E),
                    recv_offsets_E=start_PeP[me].T.reshape(E),
                    back_offsets_E=send_start_PPe[:, me].reshape(E),
                    group_sizes_e=mine_eP.sum(-1))


def experts_parallel_ragged(x_XD, idx_XK, weights_XK, w_gate_eDm, w_up_eDm, w_down_emD, axes: tuple[str, ...],
                            shards: int, cap: int, rows: int, matmul: str = "auto", fp8_dispatch: bool = False,
                            exchange: Callable = jax.lax.ragged_all_to_all, valid_X: jax.Array | None = None
                            ) -> tuple[jax.Array, jax.Array]:
  """Expert-parallel computation with exact sizes: counts all-gathered, `ragged_all_to_all` of the routed copies
  into R = `rows` rows grouped by local expert, grouped matmuls, `ragged_all_to_all` back, weighted combine.

  The capacity rule (`cap` per destination, k-major) applies first, as in `experts_parallel`; copies past R on
  their receiver are dropped too, and padding tokens' (valid_X false) are never sent. `exchange` has `jax.lax.ragged_all_to_all`'s signature (tests emulate it on
  CPU, where XLA has none). Returns the (partial, if m < M) output [X, D] and which copies were kept [K, X].
  """
  X, K = idx_XK.shape
  D, e = x_XD.shape[1], w_gate_eDm.shape[0]
  J = K * X
  order_J, key_J, count_E = send_order(idx_XK, shards, e, cap, valid_X)
  count_PE = jax.lax.all_gather(count_E, axes).reshape(shards, shards * e)
  plan = ragged_plan(count_PE, jax.lax.axis_index(axes), rows)

  def send(a, plan):
    return exchange(a, _buffer(a, rows), plan.send_offsets_E, plan.send_sizes_E, plan.out_offsets_E,
                    plan.recv_sizes_E, axis_name=axes)

  def back(a, plan):
    return exchange(a, _buffer(a, J), plan.recv_offsets_E, plan.recv_sizes_E, plan.back_offsets_E,
                    plan.send_sizes_E, axis_name=axes)

  recv_RD = dispatch(send, back, x_XD[order_J % X], plan, fp8_out=fp8_dispatch)
  y_RD = expert_ffn(recv_RD, plan.group_sizes_e, w_gate_eDm, w_up_eDm, w_down_emD, matmul)
  back_JD = dispatch(back, send, y_RD, plan, fp8_back=fp8_dispatch)  # rows of dropped copies stay zero
  position_J = jnp.zeros((J,), jnp.int32).at[order_J].set(jnp.arange(J, dtype=jnp.int32))
  weights_KX = weights_XK.T.astype(back_JD.dtype)
  y_XD = jnp.einsum("KXD,KX->XD", back_JD[position_J].reshape(K, X, D), weights_KX)
  return y_XD, kept_sorted(key_J, plan)[position_J].reshape(K, X)


def send_order(idx_XK: jax.Array, shards: int, local_experts: int, cap: int, valid_X: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The ragged send buffer's order: copies (j = k·X + x) sorted by global expert, so by destination and within
  one by local expert, k-major within one expert; copies the capacity rule drops go last (key E, never sent).
  Returns the copy at each position [J], its key [J] and the copies per expert within capacity [E]."""
  E = shards * local_experts
  idx_J = idx_XK.T.reshape(-1)
  valid_J = None if valid_X is None else jnp.tile(valid_X, idx_XK.shape[1])
  key_J = jnp.where(send_slots(idx_J // local_experts, shards, cap, valid_J) < shards * cap, idx_J, E)
  order_J = jnp.argsort(key_J, stable=True)
  return order_J, key_J[order_J], jnp.bincount(key_J, length=E + 1)[:E].astype(jnp.int32)


def kept_sorted(key_J: jax.Array, plan: RaggedPlan) -> jax.Array:
  """Which positions of the send buffer are sent (each slice's first send_sizes rows; key E: none). An empty
  slice's offset is 0, and it keeps no rank."""
  E = plan.send_sizes_E.shape[0]
  slice_J = jnp.minimum(key_J, E - 1)
  rank_J = jnp.arange(key_J.shape[0], dtype=jnp.int32) - plan.send_offsets_E[slice_J]
  return (key_J < E) & (rank_J < plan.send_sizes_E[slice_J])


def _buffer(a: jax.Array, n: int) -> jax.Array:
  """n zero rows like `a`'s, varying over the mesh axes `a` varies over (the result of ragged_all_to_all keeps the
  varying axes of its `output` operand)."""
  return jnp.zeros((n, *a.shape[1:]), a.dtype) + _zero(a).astype(a.dtype)


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


def routed_experts(x_BTD, valid_BT, w_router_DE, bias_E, w_gate_EDM, w_up_EDM, w_down_EMD, routing: Routing,
                   capacity_factor: float | None = None, fp8_inputs: bool = False, matmul: str = "auto",
                   moe_dispatch: str = "auto", recv_factor: float = 2.0, fp8_dispatch: bool = False):
  """Routing and expert computation on every token shard inside `jax.shard_map`, experts split on `expert`.

  Only the statistics and the expert-axis dispatch cross shards: expert loads and dropped copies are summed
  over the whole batch, per-sequence balance sums over the length axis, tensor-parallel partial outputs are
  all-reduced. Returns y [B, T, D], load [E] (tokens per expert over the global batch), balance loss per
  sequence [B], dropped (token copies over capacity, summed over the global batch) [].
  `fp8_inputs`: the tokens the experts see are rounded to FP8 (1×128 tiles); the router sees them unrounded.
  `matmul`: the grouped matmul (model.moe_matmul); `moe_dispatch`, `recv_factor`, `fp8_dispatch`: model.moe_dispatch,
  model.moe_recv_factor, model.moe_dispatch_dtype=float8_e4m3fn.
  """
  mesh = rules.has_mesh()
  batch_axes, length_axes = rules.mesh_axes("batch"), rules.mesh_axes("length")
  # the expert axes an enclosing shard_map handles by hand (gradsum's) count too: the weights arrive as their block
  tensor_axes, expert_axes = rules.mesh_axes("expert_mlp"), rules.split_axes("experts")
  shards = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in expert_axes) if mesh else 1
  psum = lambda x, axes: jax.lax.psum(x, axes) if mesh and axes else x
  ragged = kernels.dispatch_kind(moe_dispatch) == "ragged" and shards > 1

  def local(x_btD, valid_bt, w_router_DE, bias_E, w_gate_eDm, w_up_eDm, w_down_emD):
    b, t, D = x_btD.shape
    E, K = w_router_DE.shape[1], routing.num_experts_per_tok
    x_xD = x_btD.reshape(b * t, D)
    logits_xE = jnp.einsum("xD,DE->xE", x_xD.astype(jnp.float32), w_router_DE)
    idx_xK, weights_xK, scores_xE = route(logits_xE, bias_E, routing, shards)
    if fp8_inputs:
      x_xD = fp8.tiles(x_xD)
    cap = capacity(b * t, K, shards, E // shards, capacity_factor)
    valid_x = valid_bt.reshape(-1).astype(jnp.float32)
    if shards == 1 and cap == capacity(b * t, K, 1, E, None):
      y_xD = experts_local(x_xD, idx_xK, weights_xK, w_gate_eDm, w_up_eDm, w_down_emD, matmul)
      dropped = jnp.zeros((), jnp.float32)
    else:
      if ragged:
        rows = receive_rows(b * t, K, shards, cap, recv_factor)
        y_xD, kept_Kx = experts_parallel_ragged(x_xD, idx_xK, weights_xK, w_gate_eDm, w_up_eDm, w_down_emD,
                                                expert_axes, shards, cap, rows, matmul, fp8_dispatch,
                                                valid_X=valid_x > 0)
      else:
        y_xD, kept_Kx = experts_parallel(x_xD, idx_xK, weights_xK, w_gate_eDm, w_up_eDm, w_down_emD, expert_axes,
                                         shards, cap, matmul, fp8_dispatch, valid_X=valid_x > 0)
      dropped = ((1.0 - kept_Kx.astype(jnp.float32)) * valid_x).sum()
    y_btD = psum(y_xD.reshape(b, t, D), tensor_axes)
    chosen_xE = jax.nn.one_hot(idx_xK, E, dtype=jnp.float32).sum(-2) * valid_x[:, None]
    load_E, dropped = psum((chosen_xE.sum(0), dropped), batch_axes + length_axes)
    sums = (chosen_xE.reshape(b, t, E).sum(1),
            (scores_xE / scores_xE.sum(-1, keepdims=True) * valid_x[:, None]).reshape(b, t, E).sum(1),
            valid_bt.astype(jnp.float32).sum(1))
    return y_btD, load_E, balance_loss(*psum(sums, length_axes), K), dropped

  args = (x_BTD, valid_BT, w_router_DE, bias_E, w_gate_EDM, w_up_EDM, w_down_EMD)
  if not mesh:
    return local(*args)
  tokens, seqs = rules.activation_spec(("batch", "length", None)), rules.activation_spec(("batch", "length"))
  w_in = rules.activation_spec(("experts", None, "expert_mlp"))
  w_out = rules.activation_spec(("experts", "expert_mlp", None))
  replicated = rules.activation_spec(())
  # Under the vmap over data shards of train.grad_compression (spmd_axis_name="data"), JAX's varying-axes check
  # counts the per-shard values as varying over data, which no spec here may name: the check is off there. It is
  # off for tokamax's kernels too, whose backward gives weight gradients without varying-axes types.
  # Off too inside gradsum's shard_map manual over `expert` (its values vary there without a type that says so).
  outer = set(jax.sharding.get_abstract_mesh().manual_axes) & set(expert_axes)
  check = not rules.reserved_axes() and not outer and \
      kernels.matmul_kind(matmul, dtype=w_gate_EDM.dtype, dims=(w_gate_EDM.shape[1], w_gate_EDM.shape[2] // (
          math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in tensor_axes)))) not in kernels.GPU_MATMUL
  return jax.shard_map(local, in_specs=(tokens, seqs, replicated, replicated, w_in, w_in, w_out),
                       out_specs=(tokens, replicated, rules.activation_spec(("batch",)), replicated),
                       check_vma=check)(*args)


def balance_loss(counts_BE: jax.Array, score_sums_BE: jax.Array, tokens_B: jax.Array, k: int) -> jax.Array:
  """Sequence-wise balance loss (V3 eq. 17-20) per sequence [B]: Σ_e f_e · P_e, from per-sequence sums.

  f_e = E / (K · T) · #{t: e ∈ topK(t)},  P_e = mean_t s'_{t,e} with s' the scores normalised over experts.
  """
  E = counts_BE.shape[-1]
  tokens_B1 = jnp.maximum(tokens_B, 1.0)[:, None]
  return (counts_BE * E / (k * tokens_B1) * (score_sums_BE / tokens_B1)).sum(-1)


class MoE(nnx.Module):
  """Routed experts (dropless unless a capacity factor is set) plus always-on shared experts."""

  def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs, fp8: bool = False):
    D, E, M = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    std = cfg.initializer_range
    self.w_router_DE = param(rngs, (D, E), ("embed", None), jnp.float32, std)
    self.bias_E = RouterBias(jnp.zeros((E,), jnp.float32), logical_axes=(None,)) if cfg.topk_method == "noaux_tc" \
        else None
    self.w_gate_EDM = param(rngs, (E, D, M), ("experts", "embed", "expert_mlp"), param_dtype, std)
    self.w_up_EDM = param(rngs, (E, D, M), ("experts", "embed", "expert_mlp"), param_dtype, std)
    self.w_down_EMD = param(rngs, (E, M, D), ("experts", "expert_mlp", "embed"), param_dtype, std)
    self.shared = MLP(D, M * cfg.n_shared_experts, std, param_dtype=param_dtype, dtype=dtype, rngs=rngs,
                      fp8=fp8) if cfg.n_shared_experts else None
    self.fp8 = fp8
    self.routing = Routing.from_config(cfg)
    if cfg.moe_capacity_factor is not None and cfg.moe_capacity_factor <= 0:
      raise UserError(f"config key model.moe_capacity_factor: {cfg.moe_capacity_factor} must be > 0, or null "
                      f"for dropless dispatch")
    self.capacity_factor = cfg.moe_capacity_factor
    self.matmul = cfg.moe_matmul
    self.dispatch, self.recv_factor = cfg.moe_dispatch, cfg.moe_recv_factor
    self.fp8_dispatch = cfg.moe_dispatch_dtype == "float8_e4m3fn"
    self.dtype = dtype

  def __call__(self, x_BTD: jax.Array, valid_BT: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Returns y [B, T, D] and aux: `load` [E], `balance` [B], `dropped` [] (see routed_experts)."""
    w = lambda p: fp8.blocks(p[...].astype(self.dtype)) if self.fp8 else p[...].astype(self.dtype)
    bias_E = self.bias_E[...] if self.bias_E is not None else jnp.zeros(self.w_router_DE.shape[1:], jnp.float32)
    y_BTD, load_E, balance_B, dropped = routed_experts(
        x_BTD, valid_BT, self.w_router_DE[...], bias_E, w(self.w_gate_EDM), w(self.w_up_EDM), w(self.w_down_EMD),
        self.routing, self.capacity_factor, self.fp8, self.matmul, self.dispatch, self.recv_factor, self.fp8_dispatch)
    if self.shared is not None:
      y_BTD = y_BTD + self.shared(x_BTD)
    return y_BTD, {"load": load_E, "balance": balance_B, "dropped": dropped}
