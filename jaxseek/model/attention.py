"""Attention: multi-head / grouped-query (DeepSeek LLM) and multi-head latent attention (V2, V3).

Both go through `attend` (kernels/attention.py), the one softmax-attention function (causal, packed-segment
aware), which runs the implementation `model.attention_impl` resolves to; its `dense_attention` is the reference
every other implementation is tested against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxseek.config import ModelConfig
from jaxseek.kernels import fp8_gemm
from jaxseek.kernels.attention import attend
from jaxseek.model.layers import RMSNorm, param
from jaxseek.model.rope import apply_rope, inverse_frequencies, rotary, softmax_scale_factor
from jaxseek.sharding import context
from jaxseek.sharding.rules import shard


def rope_tables(dim: int, cfg: ModelConfig) -> tuple[tuple[float, ...], float]:
  """Inverse frequencies as a hashable tuple (a static module attribute) and the cos/sin factor."""
  inv_freq, factor = inverse_frequencies(dim, cfg.rope_theta, cfg.rope_scaling)
  return tuple(inv_freq.tolist()), factor


class Attention(nnx.Module):
  """Multi-head (G = N) or grouped-query (G < N) attention with RoPE on the whole head."""

  def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs, fp8: str | None = None):
    D, N, G, H = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.dense_head_dim
    std = cfg.initializer_range
    self.w_q_DNH = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), param_dtype, std)
    self.w_k_DGH = param(rngs, (D, G, H), ("embed", "kv_heads", "head_dim"), param_dtype, std)
    self.w_v_DGH = param(rngs, (D, G, H), ("embed", "kv_heads", "head_dim"), param_dtype, std)
    self.w_o_NHD = param(rngs, (N, H, D), ("heads", "head_dim", "embed"), param_dtype, std)
    self.inv_freq, self.rope_factor = rope_tables(H, cfg)
    self.scale = H**-0.5
    self.ring, self.zigzag = cfg.context_attention in ("ring", "zigzag"), cfg.context_attention == "zigzag"
    self.impl = cfg.attention_impl
    self.dtype = dtype
    self.fp8 = fp8  # the projections' GEMMs under this train.fp8 recipe (kernels/fp8_gemm.py)

  def proj(self, spec: str, x: jax.Array, p) -> jax.Array:
    """A projection of x by the weight `p` in the compute dtype, its GEMMs in FP8 under a train.fp8 recipe."""
    return fp8_gemm.einsum(spec, x, p[...].astype(self.dtype), self.fp8)

  def project(self, x_BTD, positions_BT):
    """Queries [B, T, N, H] and keys [B, T, G, H] (both with RoPE) and values [B, T, G, H]."""
    q_BTNH = self.proj("BTD,DNH->BTNH", x_BTD, self.w_q_DNH)
    k_BTGH = self.proj("BTD,DGH->BTGH", x_BTD, self.w_k_DGH)
    v_BTGH = self.proj("BTD,DGH->BTGH", x_BTD, self.w_v_DGH)
    rope = rotary(positions_BT, self.inv_freq, self.rope_factor)
    q_BTNH = shard(apply_rope(q_BTNH, rope), ("batch", "length", "heads", None))
    k_BTGH = shard(apply_rope(k_BTGH, rope), ("batch", "length", "kv_heads", None))
    return q_BTNH, k_BTGH, v_BTGH

  def __call__(self, x_BTD, positions_BT, segment_ids_BT):
    q_BTNH, k_BTGH, v_BTGH = self.project(x_BTD, positions_BT)
    if self.ring and context.split_over_context():
      out_BTNH = context.gqa_ring_attention(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT, self.scale, self.zigzag)
    else:
      out_BTNH = attend(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT, self.scale, impl=self.impl)
    return self.proj("BTNH,NHD->BTD", out_BTNH, self.w_o_NHD)


LATENT_NORM_EPS = 1e-6  # DeepSeek's RMSNorm default, used for MLA's q and kv latents


class MLA(nnx.Module):
  """Multi-head latent attention (DeepSeek-V2 §2.1).

  q = W_uq · norm(W_dq · x) (or W_q · x without q compression), split into a no-position part H and a RoPE
  part R per head. Keys and values come from one compressed latent c_kv = norm(W_dkv · x) [C] plus one RoPE
  key k_r = RoPE(W_kr · x) [R] shared by all heads: k = [W_uk · c_kv ; k_r], v = W_uv · c_kv.
  Softmax scale = (H + R)^-½ · mscale² (YaRN).

  The two latent norms use eps = 1e-6 whatever `rms_norm_eps` says, as DeepSeek's reference code and
  transformers build them (`LATENT_NORM_EPS`).
  """

  def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs, fp8: str | None = None):
    D, N = cfg.hidden_size, cfg.num_attention_heads
    H, R, P, C, Q = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    std, eps = cfg.initializer_range, LATENT_NORM_EPS
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
    self.ring, self.zigzag = cfg.context_attention in ("ring", "zigzag"), cfg.context_attention == "zigzag"
    self.impl = cfg.attention_impl
    self.dtype = dtype
    self.fp8 = fp8  # the projections' GEMMs under this train.fp8 recipe (kernels/fp8_gemm.py)

  proj = Attention.proj

  def project(self, x_BTD, positions_BT):
    """The no-position queries [B, T, N, H], RoPE queries [B, T, N, R], the latent c_kv [B, T, C] and the shared
    RoPE key [B, T, 1, R]."""
    if self.q_lora:
      cq_BTQ = checkpoint_name(self.q_norm(self.proj("BTD,DQ->BTQ", x_BTD, self.w_dq_DQ)), "q_latent")
      q_BTNH = self.proj("BTQ,QNH->BTNH", cq_BTQ, self.w_uq_QNH)
      qr_BTNR = self.proj("BTQ,QNR->BTNR", cq_BTQ, self.w_uqr_QNR)
    else:
      q_BTNH = self.proj("BTD,DNH->BTNH", x_BTD, self.w_q_DNH)
      qr_BTNR = self.proj("BTD,DNR->BTNR", x_BTD, self.w_qr_DNR)
    ckv_BTC = checkpoint_name(self.kv_norm(self.proj("BTD,DC->BTC", x_BTD, self.w_dkv_DC)), "kv_latent")
    kr_BT1R = self.proj("BTD,DR->BTR", x_BTD, self.w_kr_DR)[:, :, None, :]
    rope = rotary(positions_BT, self.inv_freq, self.rope_factor)
    qr_BTNR, kr_BT1R = apply_rope(qr_BTNR, rope), apply_rope(kr_BT1R, rope)
    return q_BTNH, qr_BTNR, ckv_BTC, kr_BT1R

  def __call__(self, x_BTD, positions_BT, segment_ids_BT):
    w = lambda p: p[...].astype(self.dtype)
    q_BTNH, qr_BTNR, ckv_BTC, kr_BT1R = self.project(x_BTD, positions_BT)
    q_BTNK = shard(jnp.concatenate([q_BTNH, qr_BTNR], -1), ("batch", "length", "heads", None))
    if context.split_over_context():
      out_BTNP = context.latent_attention(q_BTNK, (ckv_BTC, kr_BT1R), (w(self.w_uk_CNH), w(self.w_uv_CNP)),
                                          functools.partial(expand_latent, fp8=self.fp8), segment_ids_BT,
                                          self.scale, ring=self.ring, zigzag=self.zigzag, impl=self.impl)
      return self.proj("BTNP,NPD->BTD", out_BTNP, self.w_o_NPD)
    # (S: the whole length; without a context axis it is T)
    ckv_BSC = shard(ckv_BTC, ("batch", None, None))
    kr_BS1R = shard(kr_BT1R, ("batch", None, None, None))
    k_BSNK, v_BSNP = expand_latent(ckv_BSC, kr_BS1R, w(self.w_uk_CNH), w(self.w_uv_CNP), self.fp8)
    k_BSNK, v_BSNP = (shard(a, ("batch", None, "heads", None)) for a in (k_BSNK, v_BSNP))
    out_BTNP = attend(q_BTNK, k_BSNK, v_BSNP, segment_ids_BT, self.scale, impl=self.impl)
    return self.proj("BTNP,NPD->BTD", out_BTNP, self.w_o_NPD)


def expand_latent(ckv_BSC, kr_BS1R, w_uk_CNH, w_uv_CNP, fp8: str | None = None) -> tuple[jax.Array, jax.Array]:
  """MLA's keys [B, S, N, H + R] (the up-projected latent and the shared rope key) and values [B, S, N, P];
  `fp8`: the up-projections' train.fp8 recipe."""
  k_BSNH = fp8_gemm.einsum("BSC,CNH->BSNH", ckv_BSC, w_uk_CNH, fp8)
  kr_BSNR = jnp.broadcast_to(kr_BS1R, (*k_BSNH.shape[:3], kr_BS1R.shape[-1]))
  return jnp.concatenate([k_BSNH, kr_BSNR], -1), fp8_gemm.einsum("BSC,CNP->BSNP", ckv_BSC, w_uv_CNP, fp8)


def make_attention(cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs, fp8: str | None = None) -> nnx.Module:
  cls = MLA if cfg.is_mla else Attention
  return cls(cfg, param_dtype=param_dtype, dtype=dtype, rngs=rngs, fp8=fp8)
