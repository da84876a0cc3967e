"""Attention: multi-head / grouped-query (DeepSeek LLM) and multi-head latent attention (V2, V3).

Both go through `attend`, the one softmax-attention function (causal, packed-segment aware).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxseek.config import ModelConfig
from jaxseek.model.layers import RMSNorm, param
from jaxseek.model.rope import apply_rope, inverse_frequencies, softmax_scale_factor
from jaxseek.sharding.rules import shard


def rope_tables(dim: int, cfg: ModelConfig) -> tuple[tuple[float, ...], float]:
  """Inverse frequencies as a hashable tuple (a static module attribute) and the cos/sin factor."""
  inv_freq, factor = inverse_frequencies(dim, cfg.rope_theta, cfg.rope_scaling)
  return tuple(inv_freq.tolist()), factor


def attend(q_BTNH: jax.Array, k_BSGH: jax.Array, v_BSGP: jax.Array, segment_ids_BT: jax.Array | None,
           scale: float) -> jax.Array:
  """softmax(q·kᵀ · scale + mask) · v with G ≤ N key/value heads (N/G query heads share one, "n" below).

  The mask is causal and, with packed sequences, keeps each token inside its own segment.
  """
  B, T, N, H = q_BTNH.shape
  G = k_BSGH.shape[2]
  q_BTGnH = q_BTNH.reshape(B, T, G, N // G, H)
  scores_BGnTS = jnp.einsum("BTGnH,BSGH->BGnTS", q_BTGnH, k_BSGH, preferred_element_type=jnp.float32) * scale
  S = k_BSGH.shape[1]
  mask_BTS = jnp.tril(jnp.ones((T, S), bool))[None]
  if segment_ids_BT is not None:
    mask_BTS = mask_BTS & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])
  scores_BGnTS = jnp.where(mask_BTS[:, None, None], scores_BGnTS, jnp.finfo(jnp.float32).min)
  probs_BGnTS = jax.nn.softmax(scores_BGnTS, axis=-1).astype(v_BSGP.dtype)
  out_BTGnP = jnp.einsum("BGnTS,BSGP->BTGnP", probs_BGnTS, v_BSGP)
  # named for the remat policies (model/remat.py): the attention output is the costliest tensor to recompute
  return checkpoint_name(out_BTGnP.reshape(B, T, N, v_BSGP.shape[-1]), "attn_context")


class Attention(nnx.Module):
  """Multi-head (G = N) or grouped-query (G < N) attention with RoPE on the whole head."""

  def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs):
    D, N, G, H = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.dense_head_dim
    std = cfg.initializer_range
    self.w_q_DNH = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), param_dtype, std)
    self.w_k_DGH = param(rngs, (D, G, H), ("embed", "kv_heads", "head_dim"), param_dtype, std)
    self.w_v_DGH = param(rngs, (D, G, H), ("embed", "kv_heads", "head_dim"), param_dtype, std)
    self.w_o_NHD = param(rngs, (N, H, D), ("heads", "head_dim", "embed"), param_dtype, std)
    self.inv_freq, self.rope_factor = rope_tables(H, cfg)
    self.scale = H**-0.5
    self.dtype = dtype

  def __call__(self, x_BTD, positions_BT, segment_ids_BT):
    w = lambda p: p[...].astype(self.dtype)
    q_BTNH = jnp.einsum("BTD,DNH->BTNH", x_BTD, w(self.w_q_DNH))
    k_BTGH = jnp.einsum("BTD,DGH->BTGH", x_BTD, w(self.w_k_DGH))
    v_BTGH = jnp.einsum("BTD,DGH->BTGH", x_BTD, w(self.w_v_DGH))
    q_BTNH = shard(apply_rope(q_BTNH, positions_BT, self.inv_freq, self.rope_factor), ("batch", "length", "heads", None))
    k_BTGH = shard(apply_rope(k_BTGH, positions_BT, self.inv_freq, self.rope_factor), ("batch", "length", "kv_heads", None))
    out_BTNH = attend(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT, self.scale)
    return jnp.einsum("BTNH,NHD->BTD", out_BTNH, w(self.w_o_NHD))


class MLA(nnx.Module):
  """Multi-head latent attention (DeepSeek-V2 §2.1).

  q = W_uq · norm(W_dq · x) (or W_q · x without q compression), split into a no-position part H and a RoPE
  part R per head. Keys and values come from one compressed latent c_kv = norm(W_dkv · x) [C] plus one RoPE
  key k_r = RoPE(W_kr · x) [R] shared by all heads: k = [W_uk · c_kv ; k_r], v = W_uv · c_kv.
  Softmax scale = (H + R)^-½ · mscale² (YaRN).
  """

  def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs):
    D, N = cfg.hidden_size, cfg.num_attention_heads
    H, R, P, C, Q = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    std, eps = cfg.initializer_range, cfg.rms_norm_eps
    if Q:
      self.w_dq_DQ = param(rngs, (D, Q), ("embed", "q_lora"), param_dtype, std)
      self.q_norm = RMSNorm(Q, eps, param_dtype=param_dtype, rngs=rngs, name="q_lora")
      self.w_uq_QNH = param(rngs, (Q, N, H), ("q_lora", "heads", "head_dim"), param_dtype, std)
      self.w_uqr_QNR = param(rngs, (Q, N, R), ("q_lora", "heads", "head_dim"), param_dtype, std)
    else:
      self.w_q_DNH = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), param_dtype, std)
      self.w_qr_DNR = param(rngs, (D, N, R), ("embed", "heads", "head_dim"), param_dtype, std)
    self.w_dkv_DC = param(rngs, (D, C), ("embed", "kv_lora"), param_dtype, std)
    self.w_kr_DR = param(rngs, (D, R), ("embed", "head_dim"), param_dtype, std)
    self.kv_norm = RMSNorm(C, eps, param_dtype=param_dtype, rngs=rngs, name="kv_lora")
    self.w_uk_CNH = param(rngs, (C, N, H), ("kv_lora", "heads", "head_dim"), param_dtype, std)
    self.w_uv_CNP = param(rngs, (C, N, P), ("kv_lora", "heads", "head_dim"), param_dtype, std)
    self.w_o_NPD = param(rngs, (N, P, D), ("heads", "head_dim", "embed"), param_dtype, std)
    self.inv_freq, self.rope_factor = rope_tables(R, cfg)
    self.scale = (H + R) ** -0.5 * softmax_scale_factor(cfg.rope_scaling)
    self.q_lora = bool(Q)
    self.dtype = dtype

  def __call__(self, x_BTD, positions_BT, segment_ids_BT):
    w = lambda p: p[...].astype(self.dtype)
    if self.q_lora:
      cq_BTQ = checkpoint_name(self.q_norm(jnp.einsum("BTD,DQ->BTQ", x_BTD, w(self.w_dq_DQ))), "q_latent")
      q_BTNH = jnp.einsum("BTQ,QNH->BTNH", cq_BTQ, w(self.w_uq_QNH))
      qr_BTNR = jnp.einsum("BTQ,QNR->BTNR", cq_BTQ, w(self.w_uqr_QNR))
    else:
      q_BTNH = jnp.einsum("BTD,DNH->BTNH", x_BTD, w(self.w_q_DNH))
      qr_BTNR = jnp.einsum("BTD,DNR->BTNR", x_BTD, w(self.w_qr_DNR))
    ckv_BTC = checkpoint_name(self.kv_norm(jnp.einsum("BTD,DC->BTC", x_BTD, w(self.w_dkv_DC))), "kv_latent")
    kr_BT1R = jnp.einsum("BTD,DR->BTR", x_BTD, w(self.w_kr_DR))[:, :, None, :]
    qr_BTNR = apply_rope(qr_BTNR, positions_BT, self.inv_freq, self.rope_factor)
    kr_BT1R = apply_rope(kr_BT1R, positions_BT, self.inv_freq, self.rope_factor)
    # Context parallelism (queries split on length over `context`): every query needs every key, so the keys
    # and values' source is gathered over the axis: the compressed latent and the shared rope key, C + R
    # numbers per token, and the heads are expanded from them locally (S: the whole length).
    ckv_BSC = shard(ckv_BTC, ("batch", None, None))
    kr_BS1R = shard(kr_BT1R, ("batch", None, None, None))
    k_BSNH = jnp.einsum("BSC,CNH->BSNH", ckv_BSC, w(self.w_uk_CNH))
    v_BSNP = shard(jnp.einsum("BSC,CNP->BSNP", ckv_BSC, w(self.w_uv_CNP)), ("batch", None, "heads", None))
    kr_BSNR = jnp.broadcast_to(kr_BS1R, (*k_BSNH.shape[:3], kr_BS1R.shape[-1]))
    q_BTNK = shard(jnp.concatenate([q_BTNH, qr_BTNR], -1), ("batch", "length", "heads", None))
    k_BSNK = shard(jnp.concatenate([k_BSNH, kr_BSNR], -1), ("batch", None, "heads", None))
    out_BTNP = attend(q_BTNK, k_BSNK, v_BSNP, segment_ids_BT, self.scale)
    return jnp.einsum("BTNP,NPD->BTD", out_BTNP, w(self.w_o_NPD))


def make_attention(cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs) -> nnx.Module:
  cls = MLA if cfg.is_mla else Attention
  return cls(cfg, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
