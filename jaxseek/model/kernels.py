"""Which implementation runs attention and the experts' grouped matmul, and the GPU kernel wrappers (tokamax).

Choices are resolved from the platform of the active mesh's devices, not from `jax.default_backend()`, so a
deviceless compile for a GPU target on a CPU machine picks the GPU kernels.

  model.attention_impl  auto: on GPU tokamax's Mosaic GPU flash attention (Triton for float32); elsewhere the blocked
                        attention (`flash.py`), or the dense reference when the whole sequence is one block
                        dense | blocked | mosaic | triton | cudnn (the last three: tokamax, GPU only)
  model.moe_matmul      auto: tokamax's grouped GEMM on GPU (bf16/f16), else blocked; ragged_dot on TPU
                        blocked | ragged_dot | tokamax | tokamax_triton
  model.moe_dispatch    auto: ragged (exact-size ragged_all_to_all) on GPU and TPU, fixed (padded all_to_all)
                        elsewhere: XLA:CPU has no ragged-all-to-all
                        fixed | ragged
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from jaxseek.errors import UserError
from jaxseek.model import flash
from jaxseek.sharding import rules

GPU_ATTENTION = ("mosaic", "triton", "cudnn")
GPU_MATMUL = {"tokamax": "mosaic", "tokamax_triton": "triton"}


def platform() -> str:
  """'cpu', 'gpu' or 'tpu': the platform of the active mesh's devices, else of the default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  name = jax.default_backend() if mesh.empty else mesh.abstract_device.platform
  return "gpu" if name in ("cuda", "rocm", "gpu") else name


def attention_kind(setting: str, length: int, where: str | None = None, dtype=jnp.bfloat16,
                   tokamax: bool | None = None) -> str:
  """model.attention_impl resolved for a sequence of `length` keys of `dtype` on platform `where` (default: the
  mesh's). On GPU auto is Mosaic GPU for 16-bit inputs and Triton for float32 (Mosaic's kernels take 16-bit
  matmuls only). `tokamax`: whether tokamax is installed (None: look; the explorer plans a GPU install)."""
  where = where or platform()
  if setting == "auto":
    if where == "gpu" and (_has_tokamax() if tokamax is None else tokamax):
      return "mosaic" if jnp.dtype(dtype).itemsize == 2 else "triton"
    return "dense" if length <= flash.BLOCK else "blocked"
  if setting in GPU_ATTENTION and where != "gpu":
    raise UserError(f"config key model.attention_impl: {setting} is a GPU kernel but the mesh's devices are "
                    f"{where}; use auto, blocked or dense")
  if setting == "mosaic" and jnp.dtype(dtype).itemsize != 2:
    raise UserError("config key model.attention_impl: mosaic takes bfloat16 or float16 inputs; set "
                    "train.compute_dtype=bfloat16, or use triton or auto")
  return setting


def matmul_kind(setting: str, where: str | None = None, dtype=jnp.bfloat16, tokamax: bool | None = None) -> str:
  """model.moe_matmul resolved for a platform and compute dtype. auto: tokamax's grouped GEMM on GPU for 16-bit
  inputs (XLA:GPU lowers `ragged_dot` to a dense product with every expert; tokamax's kernels take 16-bit
  inputs only, so float32 stays blocked), blocked on CPU (the same rewrite, and no grouped GEMM), ragged_dot on
  TPU."""
  where = where or platform()
  if setting == "auto":
    if where == "gpu":
      installed = _has_tokamax() if tokamax is None else tokamax
      return "tokamax" if installed and jnp.dtype(dtype).itemsize == 2 else "blocked"
    return "ragged_dot" if where == "tpu" else "blocked"
  if setting in GPU_MATMUL and where != "gpu":
    raise UserError(f"config key model.moe_matmul: {setting} is a GPU kernel but the mesh's devices are {where}; "
                    f"use auto, blocked or ragged_dot")
  if setting in GPU_MATMUL and jnp.dtype(dtype).itemsize != 2:
    raise UserError(f"config key model.moe_matmul: {setting} takes bfloat16 or float16 inputs; set "
                    f"train.compute_dtype=bfloat16, or use auto or blocked")
  return setting


def dispatch_kind(setting: str, where: str | None = None) -> str:
  """model.moe_dispatch resolved for platform `where` (default: the mesh's): auto is ragged on GPU and TPU, fixed
  elsewhere."""
  where = where or platform()
  if setting == "auto":
    return "ragged" if where in ("gpu", "tpu") else "fixed"
  if setting == "ragged" and where not in ("gpu", "tpu"):
    raise UserError(f"config key model.moe_dispatch: ragged needs ragged-all-to-all, which XLA does not implement "
                    f"on {where}; use auto or fixed")
  return setting


def dispatch_summary(cfg, sizes: dict[str, int], where: str | None = None) -> str:
  """One line for the start-up summary (cfg: the run's Config, sizes: the mesh's axis sizes): how routed tokens
  reach the expert shards and the rows one MoE layer sends per device (x local tokens per microbatch)."""
  from jaxseek.model import moe  # moe imports this module

  m, t = cfg.model, cfg.train
  if not m.is_moe:
    return "MoE dispatch: none (dense model)"
  P, K = sizes.get("expert", 1), m.num_experts_per_tok
  if P == 1:
    return f"MoE dispatch: none (mesh.expert=1: all {m.n_routed_experts} experts on every device)"
  x = (t.batch_size // t.microbatches // (sizes.get("data", 1) * sizes.get("fsdp", 1) * P)
       * t.seq_len // sizes.get("context", 1))
  cap = moe.capacity(x, K, P, m.n_routed_experts // P, m.moe_capacity_factor)
  rows = f"{m.moe_dispatch_dtype} rows with float32 scales per 128 channels" if m.moe_dispatch_dtype else \
      f"{t.compute_dtype} rows"
  if dispatch_kind(m.moe_dispatch, where) == "fixed":
    return (f"MoE dispatch: fixed all_to_all over expert={P}, {P} × {cap} = {P * cap} rows per device for "
            f"K·x = {K * x} token copies; {rows}, results back in {t.compute_dtype}")
  recv = moe.receive_rows(x, K, P, cap, m.moe_recv_factor)
  return (f"MoE dispatch: ragged_all_to_all over expert={P}, exactly the K·x = {K * x} token copies per device "
          f"into a receive buffer of {recv} rows (model.moe_recv_factor={m.moe_recv_factor:g}, dropless from "
          f"{min(P, m.n_routed_experts / K):g}); {rows}, results back in {t.compute_dtype}")


def _has_tokamax() -> bool:
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


def tokamax_attention(q_BTNK, k_BSGK, v_BSGP, segment_ids_BT, scale, key_segment_ids_BS=None, query_offset=0,
                      implementation: str = "mosaic"):
  """Causal attention through a tokamax kernel with the packed-document mask as key ranges per query:
  query t (at sequence position offset + t) sees keys [start of its segment, offset + t]."""
  tokamax_module()
  from tokamax._src.ops.attention import api, base

  T, S = q_BTNK.shape[1], k_BSGK.shape[1]
  start_B1T = None
  if segment_ids_BT is not None:
    keys_BS = segment_ids_BT if key_segment_ids_BS is None else key_segment_ids_BS
    start_B1T = jax.lax.dynamic_slice_in_dim(segment_starts(keys_BS), query_offset, T, axis=1)[:, None, :]
  if isinstance(query_offset, int) and query_offset == 0 and S == T:
    mask = base.Mask(k_start=start_B1T, is_causal=True)  # the kernel's own causal path (skips masked blocks)
  else:
    end_B1T = jnp.broadcast_to(query_offset + jnp.arange(T, dtype=jnp.int32) + 1, (q_BTNK.shape[0], 1, T))
    mask = base.Mask(k_start=start_B1T, k_end=end_B1T)
  name = implementation
  if name == "mosaic":
    name = "mosaic_gpu"
  impl = api.IMPLEMENTATIONS.get(name)
  if impl is None:
    raise UserError(f"config key model.attention_impl: tokamax has no {implementation} kernel here; use auto")
  return impl(q_BTNK, k_BSGK, v_BSGP, mask=mask, logits_scale=scale)


def tokamax_ragged_dot(x_RD, w_EDF, sizes_E, implementation: str = "mosaic"):
  """Grouped GEMM of rows sorted by group through tokamax (Mosaic GPU or Triton kernels, their own backward)."""
  tokamax = tokamax_module()
  from tokamax._src.ops.ragged_dot import api

  name = "mosaic_gpu" if implementation == "mosaic" else implementation
  impl = api.IMPLEMENTATIONS.get(name)
  if impl is None:
    raise UserError(f"config key model.moe_matmul: tokamax has no {implementation} kernel here; use auto")
  return tokamax.ragged_dot(x_RD, w_EDF, sizes_E.astype(jnp.int32), implementation=(impl,))


def manual() -> bool:
  """Inside a shard_map (or a vmap over mesh axes): arrays are local shards already."""
  mesh = jax.sharding.get_abstract_mesh()
  return bool(rules.reserved_axes()) or (not mesh.empty and bool(mesh.manual_axes))
