"""Mixture of experts: the router, the routed experts on every token shard, the shared experts, the balance loss.

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

The routed copies reach the experts and come back through `sharding/experts.py` (fixed or ragged
dispatch on the expert axis, capacity, FP8 rows); the grouped SwiGLU itself is `kernels/grouped.py`.

The correction bias b is not trained: after each optimiser step b += rate · sign(mean(load) − load), with
loads summed over the whole global batch (train.py).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxseek.config import ModelConfig
from jaxseek.errors import UserError
from jaxseek.kernels import fp8
from jaxseek.model.layers import MLP, param
from jaxseek.sharding import experts, rules


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


class ExpertWeights(NamedTuple):
  """One MoE layer's routed-expert arrays, in the compute dtype (the router and its bias in float32)."""

  router_DE: jax.Array
  bias_E: jax.Array
  gate_EDM: jax.Array
  up_EDM: jax.Array
  down_EMD: jax.Array


def routed_experts(x_BTD, valid_BT, w: ExpertWeights, routing: Routing, settings: experts.Settings,
                   fp8_inputs: bool = False):
  """Routing and expert computation on every token shard inside `jax.shard_map`, experts split on `expert`.

  Only the statistics and the expert-axis exchange (`sharding/experts.py`, as `settings` say) cross shards:
  expert loads and dropped copies are summed over the whole batch, per-sequence balance sums over the length
  axis, tensor-parallel partial outputs are all-reduced (model.moe_tensor=split; with experts each tensor rank
  takes its share of the length, and its experts whole). Returns y [B, T, D], load [E] (tokens per expert over
  the global batch), balance loss per sequence [B], dropped (token copies over capacity, summed over the global
  batch) [], extra (token copies that went in extra rounds of the exchange, summed likewise) []. `fp8_inputs`: the tokens the experts see are rounded to FP8 (1×128 tiles); the router sees them
  unrounded.
  """
  mesh = rules.has_mesh()
  batch_axes, length_axes = rules.mesh_axes("batch"), rules.mesh_axes("expert_length")
  tensor_axes, shards = rules.mesh_axes("expert_mlp"), experts.shard_count()
  psum = lambda x, axes: jax.lax.psum(x, axes) if mesh and axes else x

  def local(x_btD, valid_bt, w):
    b, t, D = x_btD.shape
    E, K = w.router_DE.shape[1], routing.num_experts_per_tok
    x_xD = x_btD.reshape(b * t, D)
    logits_xE = jnp.einsum("xD,DE->xE", x_xD.astype(jnp.float32), w.router_DE)
    idx_xK, weights_xK, scores_xE = route(logits_xE, w.bias_E, routing, shards)
    valid_x = valid_bt.reshape(-1).astype(jnp.float32)
    y_xD, dropped, extra = experts.routed(fp8.tiles(x_xD) if fp8_inputs else x_xD, idx_xK, weights_xK,
                                   (w.gate_EDM, w.up_EDM, w.down_EMD), valid_x, settings, shards)
    y_btD = psum(y_xD.reshape(b, t, D), tensor_axes)
    chosen_xE = jax.nn.one_hot(idx_xK, E, dtype=jnp.float32).sum(-2) * valid_x[:, None]
    load_E, dropped, extra = psum((chosen_xE.sum(0), dropped, extra), batch_axes + length_axes)
    sums = (chosen_xE.reshape(b, t, E).sum(1),
            (scores_xE / scores_xE.sum(-1, keepdims=True) * valid_x[:, None]).reshape(b, t, E).sum(1),
            valid_bt.astype(jnp.float32).sum(1))
    return y_btD, load_E, balance_loss(*psum(sums, length_axes), K), dropped, extra

  if not mesh:
    return local(x_BTD, valid_BT, w)
  spec = rules.activation_spec
  w_in, w_out = spec(("experts", None, "expert_mlp")), spec(("experts", "expert_mlp", None))
  w_specs = ExpertWeights(spec(()), spec(()), w_in, w_in, w_out)
  tokens = ("batch", "expert_length")  # with model.moe_tensor=experts the length is split over tensor too
  return jax.shard_map(local, in_specs=(spec((*tokens, None)), spec(tokens), w_specs),
                       out_specs=(spec((*tokens, None)), spec(()), spec(("batch",)), spec(()), spec(())),
                       check_vma=experts.typed_axes_hold(settings, w.gate_EDM))(x_BTD, valid_BT, w)


def balance_loss(counts_BE: jax.Array, score_sums_BE: jax.Array, tokens_B: jax.Array, k: int) -> jax.Array:
  """Sequence-wise balance loss (V3 eq. 17-20) per sequence [B]: Σ_e f_e · P_e, from per-sequence sums.

  f_e = E / (K · T) · #{t: e ∈ topK(t)},  P_e = mean_t s'_{t,e} with s' the scores normalised over experts.
  """
  E = counts_BE.shape[-1]
  tokens_B1 = jnp.maximum(tokens_B, 1.0)[:, None]
  return (counts_BE * E / (k * tokens_B1) * (score_sums_BE / tokens_B1)).sum(-1)


class MoE(nnx.Module):
  """Routed experts (dropless unless a capacity factor is set) plus always-on shared experts."""

  def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs, fp8: str | None = None,
               exchange: experts.Settings | None = None):
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
    self.fp8 = fp8  # a train.fp8 recipe: the routed experts' inputs rounded as DeepSeek's blockwise recipe does
    self.routing = Routing.from_config(cfg)
    exchange = exchange or experts.Settings.from_config(cfg)  # the mesh's nodes: step.py's
    self.exchange = dataclasses.replace(exchange, fp8=fp8)
    self.dtype = dtype

  def __call__(self, x_BTD: jax.Array, valid_BT: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Returns y [B, T, D] and aux: `load` [E], `balance` [B], `dropped` [], `extra` [] (see routed_experts)."""
    emulated = self.fp8 == "blockwise"  # the other recipes run the grouped GEMMs in FP8 (exchange.fp8)
    w = lambda p: fp8.blocks(p[...].astype(self.dtype)) if emulated else p[...].astype(self.dtype)
    bias_E = self.bias_E[...] if self.bias_E is not None else jnp.zeros(self.w_router_DE.shape[1:], jnp.float32)
    weights = ExpertWeights(self.w_router_DE[...], bias_E, w(self.w_gate_EDM), w(self.w_up_EDM), w(self.w_down_EMD))
    y_BTD, load_E, balance_B, dropped, extra = routed_experts(x_BTD, valid_BT, weights, self.routing, self.exchange, emulated)
    if self.shared is not None:
      y_BTD = y_BTD + self.shared(x_BTD)
    return y_BTD, {"load": load_E, "balance": balance_B, "dropped": dropped, "extra": extra}
