"""The one softmax attention (causal, packed documents apart, grouped heads, a query offset) by the implementation
`model.attention_impl` resolves to (`choice.attention_kind`): `dense_attention` (the reference), the blocked
`flash.attention`, or a tokamax GPU kernel (`gpu.tokamax_attention`, mapped per shard)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxseek.kernels import choice, flash, gpu
from jaxseek.sharding import rules


def attend(q_BTNH: jax.Array, k_BSGH: jax.Array, v_BSGP: jax.Array, segment_ids_BT: jax.Array | None,
           scale: float, key_segment_ids_BS: jax.Array | None = None, query_offset: jax.Array | int = 0,
           impl: str = "auto") -> jax.Array:
  """Causal attention of q [B, T, N, H] over k [B, S, G, H], v [B, S, G, P] (G ≤ N), packed segments apart, by
  the implementation `impl` (model.attention_impl) resolves to: dense (the reference), blocked (memory-linear,
  `flash.py`) or a tokamax GPU kernel."""
  kind = choice.attention_kind(impl, k_BSGH.shape[1], dtype=q_BTNH.dtype,
                               head_dims=(q_BTNH.shape[-1], v_BSGP.shape[-1]))
  args = (q_BTNH, k_BSGH, v_BSGP, segment_ids_BT, scale, key_segment_ids_BS, query_offset)
  if kind == "dense":
    out = dense_attention(*args)
  elif kind == "blocked":
    out = flash.attention(*args)
  else:
    out = gpu_attention(*args, implementation=kind)
  # named for the remat policies (model/remat.py): the attention output is the costliest tensor to recompute
  return checkpoint_name(out.astype(v_BSGP.dtype), "attn_context")


def gpu_attention(q_BTNH, k_BSGH, v_BSGP, segment_ids_BT, scale, key_segment_ids_BS=None, query_offset=0,
                  implementation="mosaic"):
  """A tokamax kernel, run per shard: a custom call GSPMD cannot split, so outside a shard_map it is wrapped in
  one over the batch and head axes (the whole sequence is local here; context parallelism calls in with its
  local queries and gathered keys)."""
  kernel = lambda q, k, v, *seg: gpu.tokamax_attention(
      q, k, v, seg[0] if seg else None, scale, seg[1] if len(seg) > 1 else None, query_offset, implementation)
  segments = () if segment_ids_BT is None else (segment_ids_BT,) + (
      () if key_segment_ids_BS is None else (key_segment_ids_BS,))
  if not rules.has_mesh():
    return kernel(q_BTNH, k_BSGH, v_BSGP, *segments)
  spec = rules.activation_spec  # the axes an enclosing shard_map handles (a pipeline stage's) left out
  kv = ("batch", None, "heads" if k_BSGH.shape[2] == q_BTNH.shape[2] else "kv_heads", None)
  in_specs = (spec(("batch", None, "heads", None)), spec(kv), spec(kv)) + (spec(("batch", None)),) * len(segments)
  mesh = jax.sharding.get_abstract_mesh()
  # inside a shard_map manual over some axes only (a pipeline stage), the kernel is mapped over the rest: left
  # to GSPMD, a custom call it cannot split would gather the batch and heads onto every device. Under the vmap
  # over data shards of train.grad_compression the specs leave `data` out and the vmap adds it to the mapped
  # dimension (spmd_axis_name), so each device runs the kernel on its own rows there too
  auto = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
  if not auto:
    return kernel(q_BTNH, k_BSGH, v_BSGP, *segments)
  return jax.shard_map(kernel, in_specs=in_specs, out_specs=spec(("batch", None, "heads", None)),
                       axis_names=set(auto), check_vma=False)(q_BTNH, k_BSGH, v_BSGP, *segments)


def dense_attention(q_BTNH: jax.Array, k_BSGH: jax.Array, v_BSGP: jax.Array, segment_ids_BT: jax.Array | None,
                    scale: float, key_segment_ids_BS: jax.Array | None = None,
                    query_offset: jax.Array | int = 0) -> jax.Array:
  """softmax(q·kᵀ · scale + mask) · v with G ≤ N key/value heads (N/G query heads share one, "n" below).

  The mask is causal and, with packed sequences, keeps each token inside its own segment. The queries may be a
  slice of the sequence starting at `query_offset`, with the keys' segment ids given apart (context parallelism).
  """
  B, T, N, H = q_BTNH.shape
  G = k_BSGH.shape[2]
  q_BTGnH = q_BTNH.reshape(B, T, G, N // G, H)
  scores_BGnTS = jnp.einsum("BTGnH,BSGH->BGnTS", q_BTGnH, k_BSGH, preferred_element_type=jnp.float32) * scale
  S = k_BSGH.shape[1]
  mask_BTS = ((query_offset + jnp.arange(T))[:, None] >= jnp.arange(S)[None, :])[None]
  if segment_ids_BT is not None:
    keys_BS = segment_ids_BT if key_segment_ids_BS is None else key_segment_ids_BS
    mask_BTS = mask_BTS & (segment_ids_BT[:, :, None] == keys_BS[:, None, :])
  scores_BGnTS = jnp.where(mask_BTS[:, None, None], scores_BGnTS, jnp.finfo(jnp.float32).min)
  probs_BGnTS = jax.nn.softmax(scores_BGnTS, axis=-1).astype(v_BSGP.dtype)
  out_BTGnP = jnp.einsum("BGnTS,BSGP->BTGnP", probs_BGnTS, v_BSGP)
  return out_BTGnP.reshape(B, T, N, v_BSGP.shape[-1])
