"""Attention: multi-head / grouped-query (DeepSeek LLM) and multi-head latent attention (V2, V3).

Both go through `attend` (kernels/attention.py), the one softmax-attention function (causal, packed-segment
aware), which runs the implementation `model.attention_impl` resolves to; its `dense_attention` is the reference
every other implementation is tested against.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxseek.config import ModelConfig
from jaxseek.kernels import flash
from jaxseek.kernels.attention import attend
from jaxseek.model.layers import RMSNorm, param
from jaxseek.model.rope import apply_rope, inverse_frequencies, softmax_scale_factor
from jaxseek.sharding import rules
from jaxseek.sharding.rules import shard


def rope_tables(dim: int, cfg: ModelConfig) -> tuple[tuple[float, ...], float]:
  """Inverse frequencies as a hashable tuple (a static module attribute) and the cos/sin factor."""
  inv_freq, factor = inverse_frequencies(dim, cfg.rope_theta, cfg.rope_scaling)
  return tuple(inv_freq.tolist()), factor


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
    self.ring, self.zigzag = cfg.context_attention in ("ring", "zigzag"), cfg.context_attention == "zigzag"
    self.impl = cfg.attention_impl
    self.dtype = dtype

  def project(self, x_BTD, positions_BT):
    """Queries [B, T, N, H] and keys [B, T, G, H] (both with RoPE) and values [B, T, G, H]."""
    w = lambda p: p[...].astype(self.dtype)
    q_BTNH = jnp.einsum("BTD,DNH->BTNH", x_BTD, w(self.w_q_DNH))
    k_BTGH = jnp.einsum("BTD,DGH->BTGH", x_BTD, w(self.w_k_DGH))
    v_BTGH = jnp.einsum("BTD,DGH->BTGH", x_BTD, w(self.w_v_DGH))
    q_BTNH = shard(apply_rope(q_BTNH, positions_BT, self.inv_freq, self.rope_factor), ("batch", "length", "heads", None))
    k_BTGH = shard(apply_rope(k_BTGH, positions_BT, self.inv_freq, self.rope_factor), ("batch", "length", "kv_heads", None))
    return q_BTNH, k_BTGH, v_BTGH

  def __call__(self, x_BTD, positions_BT, segment_ids_BT):
    w = lambda p: p[...].astype(self.dtype)
    q_BTNH, k_BTGH, v_BTGH = self.project(x_BTD, positions_BT)
    if self.ring and split_over_context():
      out_BTNH = gqa_ring_attention(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT, self.scale, self.zigzag)
    else:
      out_BTNH = attend(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT, self.scale, impl=self.impl)
    return jnp.einsum("BTNH,NHD->BTD", out_BTNH, w(self.w_o_NHD))


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

  def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs):
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

  def project(self, x_BTD, positions_BT):
    """The no-position queries [B, T, N, H], RoPE queries [B, T, N, R], the latent c_kv [B, T, C] and the shared
    RoPE key [B, T, 1, R]."""
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
    return q_BTNH, qr_BTNR, ckv_BTC, kr_BT1R

  def __call__(self, x_BTD, positions_BT, segment_ids_BT):
    w = lambda p: p[...].astype(self.dtype)
    q_BTNH, qr_BTNR, ckv_BTC, kr_BT1R = self.project(x_BTD, positions_BT)
    q_BTNK = shard(jnp.concatenate([q_BTNH, qr_BTNR], -1), ("batch", "length", "heads", None))
    if split_over_context():
      out_BTNP = context_attention(q_BTNK, ckv_BTC, kr_BT1R, w(self.w_uk_CNH), w(self.w_uv_CNP), segment_ids_BT,
                                   self.scale, ring=self.ring, zigzag=self.zigzag, impl=self.impl)
      return jnp.einsum("BTNP,NPD->BTD", out_BTNP, w(self.w_o_NPD))
    # (S: the whole length; without a context axis it is T)
    ckv_BSC = shard(ckv_BTC, ("batch", None, None))
    kr_BS1R = shard(kr_BT1R, ("batch", None, None, None))
    k_BSNK, v_BSNP = expand_latent(ckv_BSC, kr_BS1R, w(self.w_uk_CNH), w(self.w_uv_CNP))
    k_BSNK, v_BSNP = (shard(a, ("batch", None, "heads", None)) for a in (k_BSNK, v_BSNP))
    out_BTNP = attend(q_BTNK, k_BSNK, v_BSNP, segment_ids_BT, self.scale, impl=self.impl)
    return jnp.einsum("BTNP,NPD->BTD", out_BTNP, w(self.w_o_NPD))


def expand_latent(ckv_BSC, kr_BS1R, w_uk_CNH, w_uv_CNP) -> tuple[jax.Array, jax.Array]:
  """MLA's keys [B, S, N, H + R] (the up-projected latent and the shared rope key) and values [B, S, N, P]."""
  k_BSNH = jnp.einsum("BSC,CNH->BSNH", ckv_BSC, w_uk_CNH)
  kr_BSNR = jnp.broadcast_to(kr_BS1R, (*k_BSNH.shape[:3], kr_BS1R.shape[-1]))
  return jnp.concatenate([k_BSNH, kr_BSNR], -1), jnp.einsum("BSC,CNP->BSNP", ckv_BSC, w_uv_CNP)


def split_over_context() -> bool:
  """Whether the active mesh splits the length over an automatic (not yet manual) axis of size > 1."""
  if not rules.has_mesh():
    return False
  mesh = jax.sharding.get_abstract_mesh()
  return math.prod(mesh.shape[a] for a in rules.mesh_axes("length")) > 1


def context_attention(q_BTNK, ckv_BTC, kr_BT1R, w_uk_CNH, w_uv_CNP, segment_ids_BT, scale, ring=False,
                      zigzag=False, impl="auto"):
  """MLA attention with the queries split over `context`, inside `jax.shard_map`: each device all-gathers the
  compressed latent and the rope key (C + R numbers per token), expands the key and value heads locally and
  attends its queries (a slice of the sequence at offset index · t) to the whole sequence. In the backward pass
  the all-gather's transpose reduce-scatters the latent's and rope key's gradients, at the same C + R size,
  where GSPMD alone would all-reduce the expanded keys' and values' gradients (N·(H + R + P) per token).
  With `ring`, the latent chunks travel round the context ring instead (`ring_attention`).
  Lowercase letters are local shards: t = T / context, n = N / tensor."""
  length = rules.mesh_axes("length")
  packed = segment_ids_BT is not None
  size = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in length)

  def local(q_btnK, ckv_btC, kr_bt1R, w_uk_CnH, w_uv_CnP, *segments):
    seg_bt = segments[0] if packed else None
    if ring:
      expand = lambda ckv_bsC, kr_bs1R: expand_latent(ckv_bsC, kr_bs1R, w_uk_CnH, w_uv_CnP)
      return ring_attention(q_btnK, (ckv_btC, kr_bt1R), expand, seg_bt, scale, length, size,
                            typed=(w_uk_CnH, w_uv_CnP), zigzag=zigzag)
    gathered = lambda a: jax.lax.all_gather(a, length, axis=1, tiled=True)
    ckv_bSC, kr_bS1R = gathered(ckv_btC), gathered(kr_bt1R)
    k_bSnK, v_bSnP = expand_latent(ckv_bSC, kr_bS1R, w_uk_CnH, w_uv_CnP)
    offset = jax.lax.axis_index(length) * q_btnK.shape[1]
    seg_bS = gathered(seg_bt) if packed else None
    return attend(q_btnK, k_bSnK, v_bSnP, seg_bt, scale, seg_bS, offset, impl=impl)

  spec = rules.activation_spec
  in_specs = (spec(("batch", "length", "heads", None)), spec(("batch", "length", None)),
              spec(("batch", "length", None, None)), spec((None, "heads", None)), spec((None, "heads", None)))
  args = (q_BTNK, ckv_BTC, kr_BT1R, w_uk_CNH, w_uv_CNP)
  if packed:
    in_specs, args = in_specs + (spec(("batch", "length")),), args + (segment_ids_BT,)
  return jax.shard_map(local, in_specs=in_specs, out_specs=spec(("batch", "length", "heads", None)))(*args)


def gqa_ring_attention(q_BTNH, k_BTGH, v_BTGH, segment_ids_BT, scale, zigzag=False):
  """Multi-head / grouped-query attention with the sequence split over `context`, inside `jax.shard_map`: the
  key and value chunks (G heads each) travel round the context ring (`ring_attention`), each chunk's heads
  repeated for the N / G query heads that share them only while that chunk is attended."""
  length = rules.mesh_axes("length")
  size = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in length)
  packed = segment_ids_BT is not None

  def local(q_btnH, k_btgH, v_btgH, *segments):
    share = q_btnH.shape[2] // k_btgH.shape[2]  # query heads per key/value head (local n / g = N / G)
    expand = lambda k_bsgH, v_bsgH: (jnp.repeat(k_bsgH, share, axis=2), jnp.repeat(v_bsgH, share, axis=2))
    return ring_attention(q_btnH, (k_btgH, v_btgH), expand, segments[0] if packed else None, scale, length, size,
                          zigzag=zigzag)

  spec = rules.activation_spec
  kv = spec(("batch", "length", "kv_heads", None))
  in_specs = (spec(("batch", "length", "heads", None)), kv, kv) + ((spec(("batch", "length")),) if packed else ())
  args = (q_BTNH, k_BTGH, v_BTGH) + ((segment_ids_BT,) if packed else ())
  return jax.shard_map(local, in_specs=in_specs, out_specs=spec(("batch", "length", "heads", None)))(*args)


NEG = flash.NEG  # the score of a masked key


def chunk_tokens(j, t: int, size: int, zigzag: bool) -> jax.Array:
  """Token positions in the sequence of the t stored tokens of context device j: one contiguous chunk, or under
  zigzag (`step.zigzag_order`) the early half-chunk j and the late half-chunk 2·size − 1 − j."""
  if zigzag:
    h = t // 2
    return jnp.concatenate([j * h + jnp.arange(h), (2 * size - 1 - j) * h + jnp.arange(h)])
  return j * t + jnp.arange(t)


def softmax_fold(state, q_bqnK, k_bsnK, v_bsnP, mask_bqs, scale):
  """The online softmax of queries q over keys k (mask None: all visible) added to state (out [b, n, q, P],
  running max [b, n, q], running sum [b, n, q])."""
  out_bnqP, max_bnq, sum_bnq = state
  scores_bnqs = jnp.einsum("bqnK,bsnK->bnqs", q_bqnK, k_bsnK, preferred_element_type=jnp.float32) * scale
  if mask_bqs is not None:
    scores_bnqs = jnp.where(mask_bqs[:, None], scores_bnqs, NEG)
  new_max = jnp.maximum(max_bnq, scores_bnqs.max(-1))
  probs_bnqs = jnp.exp(scores_bnqs - new_max[..., None])
  if mask_bqs is not None:
    probs_bnqs = probs_bnqs * mask_bqs[:, None]  # a fully masked row adds 0
  fade = jnp.exp(max_bnq - new_max)
  out_bnqP = out_bnqP * fade[..., None] + jnp.einsum("bnqs,bsnP->bnqP", probs_bnqs.astype(v_bsnP.dtype), v_bsnP,
                                                      preferred_element_type=jnp.float32)
  return out_bnqP, new_max, sum_bnq * fade + probs_bnqs.sum(-1)


def ring_attention(q_btnK, kv_chunk, expand, seg_bt, scale, axes, size, typed=(), zigzag=False):
  """Inside shard_map: `size` steps; at step r a device holds the key/value chunk (`kv_chunk`: MLA's latent and
  rope key, or keys and values) and segment ids that started on device (me − r) mod size, expands it to keys
  [b, s, n, K] and values [b, s, n, P] with `expand`, folds its scores into an online softmax (running max, sum
  and output), and passes the chunk on with a collective-permute. Each step is rematerialised in the backward
  pass, so only one chunk's keys, values and scores [b, n, t, t] are live at a time instead of the whole
  sequence's; the chunk gradients travel back round the ring at the chunk's size. `typed`: further arrays the
  output depends on (weights `expand` closes over), for the scan carry's varying mesh axes.

  `zigzag`: the sequence is stored in `step.zigzag_order` (device i holds the early half-chunk i and the late
  half-chunk 2·size − 1 − i, h = t/2 tokens each), and the ring computes only the visible blocks. At step 0 a
  device attends its own chunk causally; afterwards a chunk from an earlier device j < i is wholly visible to
  all t queries through its early half (the late half is in every query's future), and a chunk from a later
  device is wholly visible to the late half of the queries only. Each step after the first is t·h scores on
  every device: half the work of the plain ring, the same on every device."""
  me, t = jax.lax.axis_index(axes), q_btnK.shape[1]
  perm = [(i, (i + 1) % size) for i in range(size)]
  parts = len(kv_chunk)
  q_pos = chunk_tokens(me, t, size, zigzag)

  def visit(state, chunk, r, own=False):
    """Fold in the chunk held at step r (it started on device j = (me − r) mod size); `own`: r = 0, the device's
    own chunk, before the ring turns."""
    k_bsnK, v_bsnP = expand(*chunk[:parts])
    seg_bs = chunk[parts] if seg_bt is not None else None
    j = (me - r) % size
    if own or not zigzag:
      mask_bts = (q_pos[:, None] >= chunk_tokens(j, t, size, zigzag)[None, :])[None]
      if seg_bt is not None:
        mask_bts = mask_bts & _same_segment(seg_bt, seg_bs)
      return softmax_fold(state, q_btnK, k_bsnK, v_bsnP, mask_bts, scale)
    return _fold_zigzag(state, q_btnK, k_bsnK, v_bsnP, seg_bt, seg_bs, j < me, scale)

  def step(carry, r):
    chunk, state = carry
    if zigzag:  # the own chunk was visited before the scan
      chunk = jax.lax.ppermute(chunk, axes, perm)
      return (chunk, visit(state, chunk, r)), None
    state = visit(state, chunk, r)  # step 0 visits the own chunk (one causal mask for every step)
    return (jax.lax.ppermute(chunk, axes, perm), state), None

  chunk = tuple(kv_chunk) + ((seg_bt,) if seg_bt is not None else ())
  state = _ring_start(q_btnK, kv_chunk, expand, typed)
  if zigzag:
    state = jax.checkpoint(lambda state, chunk: visit(state, chunk, 0, own=True))(state, chunk)
  (_, (out_bntP, _, sum_bnt)), _ = jax.lax.scan(jax.checkpoint(step), (chunk, state),
                                                jnp.arange(1 if zigzag else 0, size))
  out_btnP = jnp.transpose(out_bntP / sum_bnt[..., None], (0, 2, 1, 3)).astype(q_btnK.dtype)
  return checkpoint_name(out_btnP, "attn_context")


def _same_segment(seg_bq, seg_bs):
  return None if seg_bq is None else seg_bq[:, :, None] == seg_bs[:, None, :]


def _fold_zigzag(state, q_btnK, k_bsnK, v_bsnP, seg_bt, seg_bs, earlier, scale):
  """A chunk from another device under zigzag: from an `earlier` device every query sees its early half (the
  late half is in every query's future); from a later device only the late half of the queries sees it, whole."""
  h = q_btnK.shape[1] // 2

  def from_earlier():
    seg_h = None if seg_bs is None else seg_bs[:, :h]
    return softmax_fold(state, q_btnK, k_bsnK[:, :h], v_bsnP[:, :h], _same_segment(seg_bt, seg_h), scale)

  def from_later():
    seg_q = None if seg_bt is None else seg_bt[:, h:]
    late = softmax_fold(tuple(a[:, :, h:] for a in state), q_btnK[:, h:], k_bsnK, v_bsnP,
                        _same_segment(seg_q, seg_bs), scale)
    return tuple(a.at[:, :, h:].set(b) for a, b in zip(state, late))

  return jax.lax.cond(earlier, from_earlier, from_later)


def _ring_start(q_btnK, kv_chunk, expand, typed):
  """The online softmax's (output [b, n, t, P], running max, running sum) before any key. They vary over every
  mesh axis their inputs vary over (a scan carry must keep its type)."""
  b, t, n, _ = q_btnK.shape
  P = jax.eval_shape(expand, *kv_chunk)[1].shape[-1]
  zero = sum(a.reshape(-1)[:0].sum().astype(jnp.float32) for a in (q_btnK, *kv_chunk, *typed))
  return (jnp.zeros((b, n, t, P), jnp.float32) + zero, jnp.full((b, n, t), NEG, jnp.float32) + zero,
          jnp.zeros((b, n, t), jnp.float32) + zero)


def make_attention(cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs) -> nnx.Module:
  cls = MLA if cfg.is_mla else Attention
  return cls(cfg, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
