"""The GPU kernels through tokamax: flash attention with the packed-document mask as per-query key ranges, and
the grouped GEMM of the experts. `choice.py` says which of them runs where."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from jaxseek.errors import UserError


def platform() -> str:
  """'cpu', 'gpu' or 'tpu': the platform of the active mesh's devices, else of the default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  name = jax.default_backend() if mesh.empty else mesh.abstract_device.platform
  return "gpu" if name in ("cuda", "rocm", "gpu") else name


def has_tokamax() -> bool:
  """Whether tokamax (the GPU kernels: pip install -e '.[gpu]') is installed."""
  try:
    import tokamax  # noqa: F401
  except ImportError:
    return False
  return True


def tokamax_module():
  try:
    import tokamax
  except ImportError as e:
    raise UserError("the GPU kernels need tokamax: pip install -e '.[gpu]' (or tokamax==0.0.12)") from e
  from absl import flags

  if not flags.FLAGS.is_parsed():  # tokamax reads absl flags, and would parse this program's own arguments
    flags.FLAGS(sys.argv[:1])
  return tokamax


def segment_starts(segment_ids_BS: jax.Array) -> jax.Array:
  """Index of the first token of each token's segment (segments are contiguous runs, as the packer writes)."""
  S = segment_ids_BS.shape[1]
  index = jnp.arange(S, dtype=jnp.int32)
  change = jnp.concatenate([jnp.ones_like(segment_ids_BS[:, :1], bool), segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]],
                           axis=1)
  return jax.lax.cummax(jnp.where(change, index, 0), axis=1)


MOSAIC_BLOCK = 128  # the query block of tokamax's Mosaic GPU attention: its query length must be a multiple


def tokamax_attention(q_BTNK, k_BSGK, v_BSGP, segment_ids_BT, scale, key_segment_ids_BS=None, query_offset=0,
                      implementation: str = "mosaic", pad_to: int | None = None):
  """Causal attention through a tokamax kernel with the packed-document mask as key ranges per query:
  query t (at sequence position offset + t) sees keys [start of its segment, offset + t]. The queries are padded
  to a multiple of `pad_to` (default: Mosaic's query block for mosaic, none otherwise) and the padding sliced off;
  on the causal path the keys too, the padded queries seeing only padded keys."""
  tokamax_module()
  # tokamax 0.0.12 (pinned in pyproject.toml) exports no key-range Mask nor implementation table: its public
  # dot_product_attention takes a dense [T, S] mask only
  from tokamax._src.ops.attention import api, base

  B, T, S = q_BTNK.shape[0], q_BTNK.shape[1], k_BSGK.shape[1]
  pad_to = pad_to or (MOSAIC_BLOCK if implementation == "mosaic" else 1)
  pad = -T % pad_to
  rows = lambda x, value=0: x if not pad else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2),
                                                         constant_values=value)
  start_B1T = None
  if segment_ids_BT is not None:
    keys_BS = segment_ids_BT if key_segment_ids_BS is None else key_segment_ids_BS
    start_B1T = jax.lax.dynamic_slice_in_dim(segment_starts(keys_BS), query_offset, T, axis=1)[:, None, :]
  if isinstance(query_offset, int) and query_offset == 0 and S == T:
    # the kernel's own causal path (skips masked blocks); padded queries start at the first padded key
    start_B1T = None if start_B1T is None else rows(start_B1T.reshape(B, T), T).reshape(B, 1, T + pad)
    mask = base.Mask(k_start=start_B1T, is_causal=True)
    k_BSGK, v_BSGP = rows(k_BSGK), rows(v_BSGP)
  else:
    end_BT = jnp.broadcast_to(query_offset + jnp.arange(T, dtype=jnp.int32) + 1, (B, T))
    start_B1T = None if start_B1T is None else rows(start_B1T.reshape(B, T)).reshape(B, 1, T + pad)
    mask = base.Mask(k_start=start_B1T, k_end=rows(end_BT, 1).reshape(B, 1, T + pad))
  name = implementation
  if name == "mosaic":
    name = "mosaic_gpu"
  impl = api.IMPLEMENTATIONS.get(name)
  if impl is None:
    raise UserError(f"config key model.attention_impl: tokamax has no {implementation} kernel here; use auto")
  return impl(rows(q_BTNK), k_BSGK, v_BSGP, mask=mask, logits_scale=scale)[:, :T]


def tokamax_ragged_dot(x_RD, w_EDF, sizes_E, implementation: str = "mosaic"):
  """Grouped GEMM of rows sorted by group through tokamax (Mosaic GPU or Triton kernels, their own backward)."""
  tokamax = tokamax_module()
  return tokamax.ragged_dot(x_RD, w_EDF, sizes_E.astype(jnp.int32), implementation=implementation)
