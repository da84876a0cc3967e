"""Memory-linear causal attention on any backend: online softmax over key blocks, with a custom backward.

The sequence is cut into query blocks of b rows and key blocks of b columns. Query block i visits only the key
blocks that hold a key at or before its last query (the fully masked causal blocks are never computed), folding
each into a running max m, sum l and output o (FlashAttention-2):

  s = q_i·k_jᵀ·scale (masked),  m' = max(m, max s),  o ← o·e^(m−m') + e^(s−m')·v_j,  l ← l·e^(m−m') + Σ e^(s−m')
  out_i = o / l,  lse_i = m + log l

Only out and lse [B, T, N] are kept for the backward, which recomputes each visible block's probabilities
p = e^(s − lse) and accumulates, with δ_i = Σ_P dout_i ⊙ out_i:

  dv_j += pᵀ·dout_i,  ds = p ⊙ (dout_i·v_jᵀ − δ_i),  dq_i += ds·k_j·scale,  dk_j += dsᵀ·q_i·scale

so nothing of size [T, S] exists at any time: one block's scores [B, N, b, b] at most. Queries may be a slice of
the sequence starting at `query_offset` (context parallelism), with the keys' segment ids given apart.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG = float(jnp.finfo(jnp.float32).min)
BLOCK = 512


def block_size(length: int, block: int = BLOCK) -> int:
  """The largest divisor of `length` that is at most `block` (the whole length when it is short)."""
  if length <= block:
    return length
  return max(d for d in range(1, block + 1) if length % d == 0)


def blocks(length: int, block: int = BLOCK) -> tuple[int, int]:
  """(block rows, padded length): the largest divisor of `length` up to `block` when it is at least a quarter
  of `block`, else `block` rows over `length` padded up to a multiple of it (a length with no good divisor, a
  prime say, would otherwise run blocks of one row)."""
  b = block_size(length, block)
  if 4 * b >= min(block, length):
    return b, length
  return block, -(-length // block) * block


def attention(q_BTNK: jax.Array, k_BSGK: jax.Array, v_BSGP: jax.Array, segment_ids_BT: jax.Array | None,
              scale: float, key_segment_ids_BS: jax.Array | None = None, query_offset: jax.Array | int = 0,
              block: int = BLOCK) -> jax.Array:
  """Causal softmax attention with G ≤ N key/value heads; packed segments never attend to each other.
  Equal in value and gradient to `attention.dense_attention`."""
  B, T, S = q_BTNK.shape[0], q_BTNK.shape[1], k_BSGK.shape[1]
  if segment_ids_BT is not None and key_segment_ids_BS is None and S != T:
    raise ValueError("attention: keys of another length need their own segment ids")
  seg_q = jnp.zeros((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT.astype(jnp.int32)
  if key_segment_ids_BS is not None:
    seg_k = key_segment_ids_BS.astype(jnp.int32)
  else:  # the queries' own ids (keys of the same length), or one segment
    seg_k = seg_q if segment_ids_BT is not None else jnp.zeros((B, S), jnp.int32)
  offset = jnp.asarray(query_offset, jnp.int32)
  (bq, Tp), (bk, Sp) = blocks(T, block), blocks(S, block)
  if (Tp, Sp) != (T, S):  # padded queries and keys: segment ids that match nothing (-1, -2), cut off after
    pad = lambda a, n, value=0: jnp.pad(a, [(0, 0), (0, n)] + [(0, 0)] * (a.ndim - 2), constant_values=value)
    q_BTNK, seg_q = pad(q_BTNK, Tp - T), pad(seg_q, Tp - T, -1)
    k_BSGK, v_BSGP, seg_k = pad(k_BSGK, Sp - S), pad(v_BSGP, Sp - S), pad(seg_k, Sp - S, -2)
  return _flash(q_BTNK, k_BSGK, v_BSGP, seg_q, seg_k, offset, scale, bq, bk)[:, :T]


def _heads(q_BTNK, G):
  B, T, N, K = q_BTNK.shape
  return q_BTNK.reshape(B, T, G, N // G, K)


def _visible_blocks(i, offset, bq: int, bk: int, nk: int):
  """Key blocks 0 .. n-1 hold a key at or before query block i's last query (position offset + (i+1)·bq − 1)."""
  return jnp.clip((offset + (i + 1) * bq + bk - 1) // bk, 0, nk)


def _scores(q_bGnK, k_bGK, seg_q, seg_k, q0, k0, scale):
  """Masked float32 scores [B, G, n, bq, bk] of one block pair and its mask [B, bq, bk]."""
  s = jnp.einsum("BqGnK,BsGK->BGnqs", q_bGnK, k_bGK, preferred_element_type=jnp.float32) * scale
  bq, bk = q_bGnK.shape[1], k_bGK.shape[1]
  mask = ((q0 + jnp.arange(bq))[:, None] >= (k0 + jnp.arange(bk))[None, :])[None]
  mask = mask & (seg_q[:, :, None] == seg_k[:, None, :])
  return jnp.where(mask[:, None, None], s, NEG), mask


def _slice(a, start, size, axis=1):
  return jax.lax.dynamic_slice_in_dim(a, start, size, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, seg_q, seg_k, offset, scale, bq, bk):
  return _flash_fwd(q, k, v, seg_q, seg_k, offset, scale, bq, bk)[0]


def _flash_fwd(q_BTNK, k_BSGK, v_BSGP, seg_q, seg_k, offset, scale, bq, bk):
  B, T, N, K = q_BTNK.shape
  S, G, P = k_BSGK.shape[1], k_BSGK.shape[2], v_BSGP.shape[-1]
  nq, nk = T // bq, S // bk
  q_BTGnK = _heads(q_BTNK, G)

  def query_block(_, i):
    q_bGnK = _slice(q_BTGnK, i * bq, bq)
    sq = _slice(seg_q, i * bq, bq)

    def key_block(j, state):
      o, m, l = state
      s, mask = _scores(q_bGnK, _slice(k_BSGK, j * bk, bk), sq, _slice(seg_k, j * bk, bk), offset + i * bq,
                        j * bk, scale)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.where(mask[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
      fade = jnp.exp(m - m_new)
      pv = jnp.einsum("BGnqs,BsGP->BGnqP", p.astype(v_BSGP.dtype), _slice(v_BSGP, j * bk, bk),
                      preferred_element_type=jnp.float32)
      return o * fade[..., None] + pv, m_new, l * fade + p.sum(-1)

    n = N // G
    init = (jnp.zeros((B, G, n, bq, P), jnp.float32), jnp.full((B, G, n, bq), NEG, jnp.float32),
            jnp.zeros((B, G, n, bq), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, _visible_blocks(i, offset, bq, bk, nk), key_block, init)
    l = jnp.maximum(l, 1e-30)  # a query that sees no key (none in the dense path either) outputs 0
    return None, ((o / l[..., None]).astype(q_BTNK.dtype), m + jnp.log(l))

  _, (o_iBGnqP, lse_iBGnq) = jax.lax.scan(query_block, None, jnp.arange(nq))
  out_BTNP = jnp.moveaxis(o_iBGnqP, 0, 3).reshape(B, G, N // G, T, P).transpose(0, 3, 1, 2, 4).reshape(B, T, N, P)
  lse_BGnT = jnp.moveaxis(lse_iBGnq, 0, 3).reshape(B, G, N // G, T)
  return out_BTNP, (q_BTNK, k_BSGK, v_BSGP, seg_q, seg_k, offset, out_BTNP, lse_BGnT)


def _flash_bwd(scale, bq, bk, residuals, dout_BTNP):
  q_BTNK, k_BSGK, v_BSGP, seg_q, seg_k, offset, out_BTNP, lse_BGnT = residuals
  B, T, N, K = q_BTNK.shape
  S, G, P = k_BSGK.shape[1], k_BSGK.shape[2], v_BSGP.shape[-1]
  nq, nk = T // bq, S // bk
  q_BTGnK, dout_BTGnP = _heads(q_BTNK, G), _heads(dout_BTNP, G)
  delta_BTGn = jnp.einsum("BTGnP,BTGnP->BTGn", dout_BTGnP.astype(jnp.float32), _heads(out_BTNP, G).astype(jnp.float32))

  def query_block(carry, i):
    q_bGnK, do_bGnP = _slice(q_BTGnK, i * bq, bq), _slice(dout_BTGnP, i * bq, bq)
    lse_BGnq = _slice(lse_BGnT, i * bq, bq, axis=3)
    delta_BGnq = jnp.moveaxis(_slice(delta_BTGn, i * bq, bq), 1, 3)
    sq = _slice(seg_q, i * bq, bq)

    def key_block(j, state):
      dq, dk, dv = state
      k_bGK, v_bGP = _slice(k_BSGK, j * bk, bk), _slice(v_BSGP, j * bk, bk)
      s, mask = _scores(q_bGnK, k_bGK, sq, _slice(seg_k, j * bk, bk), offset + i * bq, j * bk, scale)
      p = jnp.where(mask[:, None, None], jnp.exp(s - lse_BGnq[..., None]), 0.0)
      dv_j = jnp.einsum("BGnqs,BqGnP->BsGP", p.astype(do_bGnP.dtype), do_bGnP, preferred_element_type=jnp.float32)
      dp = jnp.einsum("BqGnP,BsGP->BGnqs", do_bGnP, v_bGP, preferred_element_type=jnp.float32)
      ds = (p * (dp - delta_BGnq[..., None]) * scale).astype(q_bGnK.dtype)
      dq = dq + jnp.einsum("BGnqs,BsGK->BqGnK", ds, k_bGK, preferred_element_type=jnp.float32)
      dk_j = jnp.einsum("BGnqs,BqGnK->BsGK", ds, q_bGnK, preferred_element_type=jnp.float32)
      dk = jax.lax.dynamic_update_slice_in_dim(dk, _slice(dk, j * bk, bk) + dk_j, j * bk, 1)
      dv = jax.lax.dynamic_update_slice_in_dim(dv, _slice(dv, j * bk, bk) + dv_j, j * bk, 1)
      return dq, dk, dv

    dq0 = jnp.zeros(q_bGnK.shape, jnp.float32)
    dq, dk, dv = jax.lax.fori_loop(0, _visible_blocks(i, offset, bq, bk, nk), key_block, (dq0, *carry))
    return (dk, dv), dq.astype(q_BTNK.dtype)

  zeros = (jnp.zeros(k_BSGK.shape, jnp.float32), jnp.zeros(v_BSGP.shape, jnp.float32))
  (dk, dv), dq_iBqGnK = jax.lax.scan(query_block, zeros, jnp.arange(nq))
  dq_BTNK = jnp.moveaxis(dq_iBqGnK, 0, 1).reshape(B, T, N, K)
  return dq_BTNK, dk.astype(k_BSGK.dtype), dv.astype(v_BSGP.dtype), None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
