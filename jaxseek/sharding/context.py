"""Attention with the sequence split over the `context` axis, each inside a `jax.shard_map` over the length:
MLA's latent all-gathered (`latent_attention`; its gradient reduce-scattered at the latent's size), or key/value
chunks passed round the context ring with an online softmax (`ring_attention`: MLA's latent, or grouped-query
heads through `gqa_ring_attention`; with zigzag storage, only the causally visible half-chunks). See
docs/context.md."""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxseek.kernels import flash
from jaxseek.kernels.attention import attend
from jaxseek.sharding import rules


def split_over_context() -> bool:
  """Whether the active mesh splits the length over an automatic (not yet manual) axis of size > 1."""
  if not rules.has_mesh():
    return False
  mesh = jax.sharding.get_abstract_mesh()
  return math.prod(mesh.shape[a] for a in rules.mesh_axes("length")) > 1


def latent_attention(q_BTNK, latent, w_up, expand: Callable, segment_ids_BT, scale, ring=False, zigzag=False,
                     impl="auto"):
  """MLA attention with the queries split over `context`, inside `jax.shard_map`: each device all-gathers the
  compressed latent and the rope key (C + R numbers per token), expands the key and value heads locally and
  attends its queries (a slice of the sequence at offset index · t) to the whole sequence. In the backward pass
  the all-gather's transpose reduce-scatters the latent's and rope key's gradients, at the same C + R size,
  where GSPMD alone would all-reduce the expanded keys' and values' gradients (N·(H + R + P) per token).
  With `ring`, the latent chunks travel round the context ring instead (`ring_attention`).
  `latent`: (ckv [B, T, C], kr [B, T, 1, R]); `w_up`: (w_uk [C, N, H], w_uv [C, N, P]); `expand(ckv, kr, w_uk,
  w_uv)` gives the keys and values (the model's `expand_latent`).
  Lowercase letters are local shards: t = T / context, n = N / tensor."""
  length = rules.mesh_axes("length")
  packed = segment_ids_BT is not None
  size = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in length)

  def local(q_btnK, ckv_btC, kr_bt1R, w_uk_CnH, w_uv_CnP, *segments):
    seg_bt = segments[0] if packed else None
    if ring:
      chunk_expand = lambda ckv_bsC, kr_bs1R: expand(ckv_bsC, kr_bs1R, w_uk_CnH, w_uv_CnP)
      return ring_attention(q_btnK, (ckv_btC, kr_bt1R), chunk_expand, seg_bt, scale, length, size,
                            typed=(w_uk_CnH, w_uv_CnP), zigzag=zigzag)
    gathered = lambda a: jax.lax.all_gather(a, length, axis=1, tiled=True)
    ckv_bSC, kr_bS1R = gathered(ckv_btC), gathered(kr_bt1R)
    k_bSnK, v_bSnP = expand(ckv_bSC, kr_bS1R, w_uk_CnH, w_uv_CnP)
    offset = jax.lax.axis_index(length) * q_btnK.shape[1]
    seg_bS = gathered(seg_bt) if packed else None
    return attend(q_btnK, k_bSnK, v_bSnP, seg_bt, scale, seg_bS, offset, impl=impl)

  spec = rules.activation_spec
  in_specs = (spec(("batch", "length", "heads", None)), spec(("batch", "length", None)),
              spec(("batch", "length", None, None)), spec((None, "heads", None)), spec((None, "heads", None)))
  args = (q_BTNK, *latent, *w_up)
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
