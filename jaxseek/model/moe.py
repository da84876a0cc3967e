"""Mixture of experts: router, shared experts, dropless dispatch (sort by expert + grouped matmul).

Shape key (see jaxseek.model): X tokens of a shard flattened (B·T), E routed experts, K experts per token,
M expert hidden size, D model size. Inside `jax.shard_map` a lowercase letter is the local shard (m = M/|tensor|).

Routing (float32):
  s = softmax(x·W_r) or sigmoid(x·W_r)
  greedy                top-K of s
  group_limited_greedy  (V2) keep the `topk_group` groups with the largest max(s), then top-K
  noaux_tc              (V3) choose with s + b: keep the groups with the largest sum of their top-2, then
                        top-K; gate weights come from the unbiased s
  weights are renormalised (norm_topk_prob) and scaled by routed_scaling_factor.

The correction bias b is not trained: after each optimiser step b += rate · sign(mean(load) − load), with
loads summed over the whole global batch (train.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxseek.config import ModelConfig
from jaxseek.model.layers import MLP, param
from jaxseek.sharding import rules


class RouterBias(nnx.Variable):
  """The aux-loss-free correction bias: updated from expert loads, never by the optimiser."""


@dataclasses.dataclass(frozen=True)
class Routing:
  """The router's settings (Hugging Face names)."""

  scoring_func: str
  topk_method: str
  n_group: int
  topk_group: int
  num_experts_per_tok: int
  norm_topk_prob: bool
  routed_scaling_factor: float
  scale_after_norm: bool  # V3 renormalises and then scales; DeepSeek-MoE / V2 do one or the other

  @classmethod
  def from_config(cls, cfg: ModelConfig) -> "Routing":
    return cls(cfg.scoring_func, cfg.topk_method, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok,
               cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.model_type == "deepseek_v3")


def route(logits_XE: jax.Array, bias_E: jax.Array | None, cfg: Routing) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Returns (expert ids [X, K], gate weights [X, K], scores [X, E]), all computed in float32."""
  logits_XE = logits_XE.astype(jnp.float32)
  scores_XE = jax.nn.sigmoid(logits_XE) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits_XE, axis=-1)
  choice_XE = scores_XE + bias_E if bias_E is not None else scores_XE
  X, E = choice_XE.shape
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


def experts_local(x_XD, idx_XK, weights_XK, w_gate_EDm, w_up_EDm, w_down_EmD) -> jax.Array:
  """Dropless expert computation on one shard: sort token copies by expert, grouped matmuls, weighted unsort.

  Returns the (partial, if m < M) output [X, D].
  """
  X, K = idx_XK.shape
  E = w_gate_EDm.shape[0]
  flat_e = idx_XK.reshape(-1)
  order = jnp.argsort(flat_e, stable=True)
  token_of = order // K
  group_sizes_E = jnp.bincount(flat_e, length=E).astype(jnp.int32)
  x_sorted = x_XD[token_of]
  gate = jax.lax.ragged_dot(x_sorted, w_gate_EDm, group_sizes_E)
  up = jax.lax.ragged_dot(x_sorted, w_up_EDm, group_sizes_E)
  y_sorted = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down_EmD, group_sizes_E)
  y_sorted = y_sorted * weights_XK.reshape(-1)[order][:, None].astype(y_sorted.dtype)
  return jnp.zeros_like(x_XD).at[token_of].add(y_sorted)


def routed_experts(x_BTD, valid_BT, w_router_DE, bias_E, w_gate_EDM, w_up_EDM, w_down_EMD, routing: Routing):
  """Routing and dropless expert computation, run on every token shard inside `jax.shard_map`.

  Per-token work (router, top-k, sort, grouped matmuls) stays on the shard that holds the token; only the
  statistics cross shards: expert loads are summed over the whole batch, per-sequence balance sums over the
  length axis, and tensor-parallel partial outputs are all-reduced.
  Returns y [B, T, D], load [E] (tokens per expert over the global batch), balance loss per sequence [B].
  """
  mesh = rules.has_mesh()
  batch_axes, length_axes = rules.mesh_axes("batch"), rules.mesh_axes("length")
  tensor_axes = rules.mesh_axes("expert_mlp")
  psum = lambda x, axes: jax.lax.psum(x, axes) if mesh and axes else x

  def local(x_btD, valid_bt, w_router_DE, bias_E, w_gate_EDm, w_up_EDm, w_down_EmD):
    b, t, D = x_btD.shape
    E = w_router_DE.shape[1]
    logits_xE = jnp.einsum("xD,DE->xE", x_btD.reshape(b * t, D).astype(jnp.float32), w_router_DE)
    idx_xK, weights_xK, scores_xE = route(logits_xE, bias_E, routing)
    y_xD = experts_local(x_btD.reshape(b * t, D), idx_xK, weights_xK, w_gate_EDm, w_up_EDm, w_down_EmD)
    y_btD = psum(y_xD.reshape(b, t, D), tensor_axes)
    valid_x = valid_bt.reshape(-1).astype(jnp.float32)
    chosen_xE = jax.nn.one_hot(idx_xK, E, dtype=jnp.float32).sum(-2) * valid_x[:, None]
    load_E = psum(chosen_xE.sum(0), batch_axes + length_axes)
    sums = (chosen_xE.reshape(b, t, E).sum(1),
            (scores_xE / scores_xE.sum(-1, keepdims=True) * valid_x[:, None]).reshape(b, t, E).sum(1),
            valid_bt.astype(jnp.float32).sum(1))
    return y_btD, load_E, balance_loss(*psum(sums, length_axes), idx_xK.shape[-1])

  args = (x_BTD, valid_BT, w_router_DE, bias_E, w_gate_EDM, w_up_EDM, w_down_EMD)
  if not mesh:
    return local(*args)
  tokens, seqs = rules.activation_spec(("batch", "length", None)), rules.activation_spec(("batch", "length"))
  w_in = rules.activation_spec((None, None, "expert_mlp"))
  w_out = rules.activation_spec((None, "expert_mlp", None))
  replicated = rules.activation_spec(())
  return jax.shard_map(local, in_specs=(tokens, seqs, replicated, replicated, w_in, w_in, w_out),
                       out_specs=(tokens, replicated, rules.activation_spec(("batch",))))(*args)


def balance_loss(counts_BE: jax.Array, score_sums_BE: jax.Array, tokens_B: jax.Array, k: int) -> jax.Array:
  """Sequence-wise balance loss (V3 eq. 17-20) per sequence [B]: Σ_e f_e · P_e, from per-sequence sums.

  f_e = E / (K · T) · #{t: e ∈ topK(t)},  P_e = mean_t s'_{t,e} with s' the scores normalised over experts.
  """
  E = counts_BE.shape[-1]
  tokens_B1 = jnp.maximum(tokens_B, 1.0)[:, None]
  return (counts_BE * E / (k * tokens_B1) * (score_sums_BE / tokens_B1)).sum(-1)


class MoE(nnx.Module):
  """Routed experts (dropless) plus always-on shared experts."""

  def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs):
    D, E, M = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    std = cfg.initializer_range
    self.w_router_DE = param(rngs, (D, E), ("embed", None), jnp.float32, std)
    self.bias_E = RouterBias(jnp.zeros((E,), jnp.float32), logical_axes=(None,)) if cfg.topk_method == "noaux_tc" \
        else None
    self.w_gate_EDM = param(rngs, (E, D, M), ("experts", "embed", "expert_mlp"), param_dtype, std)
    self.w_up_EDM = param(rngs, (E, D, M), ("experts", "embed", "expert_mlp"), param_dtype, std)
    self.w_down_EMD = param(rngs, (E, M, D), ("experts", "expert_mlp", "embed"), param_dtype, std)
    self.shared = MLP(D, M * cfg.n_shared_experts, std, param_dtype=param_dtype, dtype=dtype, rngs=rngs) \
        if cfg.n_shared_experts else None
    self.routing = Routing.from_config(cfg)
    self.dtype = dtype

  def __call__(self, x_BTD: jax.Array, valid_BT: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    w = lambda p: p[...].astype(self.dtype)
    bias_E = self.bias_E[...] if self.bias_E is not None else jnp.zeros(self.w_router_DE.shape[1:], jnp.float32)
    y_BTD, load_E, balance_B = routed_experts(x_BTD, valid_BT, self.w_router_DE[...], bias_E, w(self.w_gate_EDM),
                                              w(self.w_up_EDM), w(self.w_down_EMD), self.routing)
    if self.shared is not None:
      y_BTD = y_BTD + self.shared(x_BTD)
    return y_BTD, {"load": load_E, "balance": balance_B}
