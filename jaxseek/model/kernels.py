"""Which implementation runs attention and the experts' grouped matmul, and the GPU kernel wrappers (tokamax).

Choices are resolved from the platform of the active mesh's devices, not from `jax.default_backend()`, so a
deviceless compile for a GPU target on a CPU machine picks the GPU kernels, and on a GPU from its CUDA compute
capability (tokamax 0.0.12: Mosaic GPU kernels on sm_90 and sm_100 only, Triton from sm_80, cuDNN's MLA-shaped
attention from sm_90). A GPU without a CUDA compute capability (ROCm) gets XLA's paths from auto (blocked, or
dense), and the tokamax kernels asked for by name are refused there.

  model.attention_impl  auto: on GPU tokamax's Mosaic GPU flash attention on sm_90 (sm_100: head dims ≤ 64)
                        with 16-bit inputs, else its Triton flash attention from sm_80, else (or without tokamax) the blocked
                        attention (`flash.py`); elsewhere blocked, or the dense reference when the whole
                        sequence is one block
                        dense | blocked | mosaic | triton | cudnn (the last three: tokamax, GPU only)
  model.moe_matmul      auto: tokamax's grouped GEMM on GPU for 16-bit inputs (Mosaic GPU on sm_90 for widths
                        in multiples of 64, else Triton from sm_80), else blocked; ragged_dot on TPU
                        blocked | ragged_dot | tokamax | tokamax_triton
  model.moe_dispatch    auto: ragged (exact-size ragged_all_to_all) on GPU and TPU, fixed (padded all_to_all)
                        elsewhere: XLA:CPU has no ragged-all-to-all
                        fixed | ragged
"""

from __future__ import annotations

import re
import sys

import jax
import jax.numpy as jnp

from jaxseek.errors import UserError
from jaxseek.model import flash

GPU_ATTENTION = ("mosaic", "triton", "cudnn")
GPU_MATMUL = {"tokamax": "mosaic", "tokamax_triton": "triton"}


def platform() -> str:
  """'cpu', 'gpu' or 'tpu': the platform of the active mesh's devices, else of the default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  name = jax.default_backend() if mesh.empty else mesh.abstract_device.platform
  return "gpu" if name in ("cuda", "rocm", "gpu") else name


MOSAIC_SM = (9.0, 11.0)  # tokamax 0.0.12's Mosaic GPU kernels: Hopper (sm_90) and Blackwell (sm_100)
TRITON_SM = 8.0  # Triton (Pallas) kernels: Ampere and later
MOSAIC_SM100_HEAD_DIM = 64  # the widest head tokamax 0.0.12's sm_100 Mosaic attention fits in shared memory
MOSAIC_GEMM_TILE = 64  # tokamax's Mosaic GPU grouped GEMM: hidden and expert widths in whole tiles of 64
PLANNED_SM = 9.0  # the capability assumed for a GPU that is not at hand (the explorer's plans)
LABELS = {"mosaic": "tokamax Mosaic GPU flash kernel", "triton": "tokamax Triton flash kernel",
          "cudnn": "cuDNN flash kernel through tokamax", "blocked": "XLA, blocked flash", "dense": "XLA, dense",
          "tokamax": "tokamax Mosaic GPU kernel", "tokamax_triton": "tokamax Triton kernel",
          "ragged_dot": "XLA ragged_dot", "blocked_matmul": "XLA, one GEMM per expert block",
          "chunked": "XLA, the head's logits one chunk of tokens at a time",
          "full": "XLA, the whole batch's logits at once"}


# tokamax kernels that turn the per-query key ranges into a dense boolean mask, and where
DENSE_MASK = {"cudnn": "forward and backward", "triton": "in its backward"}


def capability(device=None) -> float | None:
  """The CUDA compute capability of `device` (8.0, 9.0, 10.0; None for other platforms, ROCm included, whose
  devices report a gfx architecture there). Default: the default device, which a deviceless compile sets to the
  target GPU (explore/gpu.py), as tokamax itself reads it."""
  device = device or jax.devices()[0]
  cc = str(getattr(device, "compute_capability", None) or "")
  cuda = device.platform in ("cuda", "gpu") and not is_rocm(device)
  return float(cc) if cuda and re.fullmatch(r"\d+\.\d+", cc) else None


def is_rocm(device) -> bool:
  """Whether `device` is an AMD GPU (JAX names the platform of ROCm and CUDA devices alike "gpu")."""
  version = str(getattr(getattr(device, "client", None), "platform_version", ""))
  return device.platform == "rocm" or "rocm" in version.lower()


def device_target(device) -> tuple[str, float | None]:
  """('cpu' | 'gpu' | 'tpu', CUDA compute capability or None) of one of the mesh's devices."""
  where = "gpu" if device.platform in ("cuda", "rocm", "gpu") else device.platform
  return where, capability(device)


def sm(cc: float | None) -> str:
  return "a GPU without a CUDA compute capability (ROCm)" if cc is None else f"sm_{int(cc)}{round(cc % 1 * 10)}"


def _gpu(where: str, cc: float | None, tokamax: bool | None) -> tuple[float | None, bool]:
  """The capability and whether tokamax is installed, for a GPU platform. A capability not given is the default
  device's: None for a GPU without one (ROCm: no CUDA kernel runs there), sm_90 when no GPU is at hand (the
  explorer planning for one)."""
  if where == "gpu" and cc is None:
    cc = PLANNED_SM if jax.devices()[0].platform == "cpu" else capability()
  return cc, _has_tokamax() if tokamax is None else tokamax


def _mosaic_runs(cc: float | None, head_dims: tuple[int, int] | None = None) -> bool:
  """Whether tokamax's Mosaic GPU attention runs: sm_90, or sm_100 with head dims of at most 64 (tokamax 0.0.12's
  sm_100 kernels ask for more shared memory than the GPU has at 96 and over)."""
  if cc is None or not MOSAIC_SM[0] <= cc < MOSAIC_SM[1]:
    return False
  return cc < 10.0 or max(head_dims or (0,)) <= MOSAIC_SM100_HEAD_DIM


def _mosaic_gemm_runs(cc: float | None, dims: tuple[int, ...] | None) -> bool:
  return cc is not None and 9.0 <= cc < 10.0 and all(d % MOSAIC_GEMM_TILE == 0 for d in dims or ())


def _triton_runs(cc: float | None) -> bool:
  return cc is not None and cc >= TRITON_SM


def attention_kind(setting: str, length: int, where: str | None = None, dtype=jnp.bfloat16,
                   tokamax: bool | None = None, capability: float | None = None,
                   head_dims: tuple[int, int] | None = None) -> str:
  """model.attention_impl resolved for a sequence of `length` keys of `dtype` on platform `where` (default: the
  mesh's) with CUDA compute `capability` (default: the device's). `tokamax`: whether tokamax is installed (None:
  look; the explorer plans a GPU install). `head_dims`: (query/key, value) head dims, checked for cuDNN."""
  where = where or platform()
  cc, installed = _gpu(where, capability, tokamax)
  if setting == "auto":
    if where == "gpu" and installed:
      if _mosaic_runs(cc, head_dims) and jnp.dtype(dtype).itemsize == 2:
        return "mosaic"
      if _triton_runs(cc):
        return "triton"
    return "dense" if length <= flash.BLOCK else "blocked"
  key = "config key model.attention_impl"
  if setting in GPU_ATTENTION and where != "gpu":
    raise UserError(f"{key}: {setting} is a GPU kernel but the mesh's devices are {where}; use auto, blocked or "
                    f"dense")
  if setting in GPU_ATTENTION and where == "gpu":
    auto = attention_kind("auto", length, where, dtype, installed, cc, head_dims)
    if setting == "mosaic" and not _mosaic_runs(cc):
      raise UserError(f"{key}: mosaic (tokamax's Mosaic GPU kernels) runs on sm_90 and sm_100 GPUs and this is "
                      f"{sm(cc)}; use auto (it picks {auto} here){' or triton' if cc else ''}")
    if setting == "mosaic" and not _mosaic_runs(cc, head_dims):
      raise UserError(f"{key}: mosaic on {sm(cc)} takes head dims of at most {MOSAIC_SM100_HEAD_DIM} (tokamax's "
                      f"kernels there exceed shared memory beyond), and these are {head_dims[0]}/{head_dims[1]}; "
                      f"use auto (it picks {auto} here) or triton")
    if setting == "triton" and not _triton_runs(cc):
      raise UserError(f"{key}: triton needs an sm_80 or newer GPU and this is {sm(cc)}; use auto or blocked")
    if setting == "cudnn" and cc is None:
      raise UserError(f"{key}: cudnn is NVIDIA's cuDNN and this is {sm(cc)}; use auto (it picks {auto} here)")
    if setting == "cudnn" and head_dims and cc < 9.0 and (head_dims[0] != head_dims[1] or head_dims[0] > 128):
      raise UserError(f"{key}: cudnn takes query/key head dim {head_dims[0]} with value head dim "
                      f"{head_dims[1]} (MLA-shaped, or over 128) on sm_90 or newer only, and this is {sm(cc)}; "
                      f"use auto or triton")
  if setting in ("mosaic", "cudnn") and jnp.dtype(dtype).itemsize != 2:
    raise UserError(f"{key}: {setting} takes bfloat16 or float16 inputs; set train.compute_dtype=bfloat16, or "
                    f"use triton or auto")
  return setting


def matmul_kind(setting: str, where: str | None = None, dtype=jnp.bfloat16, tokamax: bool | None = None,
                capability: float | None = None, dims: tuple[int, ...] | None = None) -> str:
  """model.moe_matmul resolved for a platform, compute dtype, CUDA compute capability and the expert GEMMs' `dims`
  (hidden size, the expert's local intermediate size). auto: tokamax's grouped GEMM on GPU for 16-bit inputs,
  Mosaic GPU on sm_90 when every dim is a multiple of 64 (tokamax 0.0.12: its sm_100 kernels have no weight
  gradient, and other widths do not tile), else Triton from sm_80 (XLA:GPU lowers `ragged_dot` to a dense product
  with every expert; tokamax's kernels take 16-bit inputs only, so float32 stays blocked), blocked on older GPUs
  and on GPUs without a CUDA compute capability (ROCm), blocked on CPU (the same rewrite, and no grouped GEMM),
  ragged_dot on TPU."""
  where = where or platform()
  cc, installed = _gpu(where, capability, tokamax)
  if setting == "auto":
    if where == "gpu":
      if installed and jnp.dtype(dtype).itemsize == 2:
        if _mosaic_gemm_runs(cc, dims):
          return "tokamax"
        if _triton_runs(cc):
          return "tokamax_triton"
      return "blocked"
    return "ragged_dot" if where == "tpu" else "blocked"
  key = "config key model.moe_matmul"
  if setting in GPU_MATMUL and where != "gpu":
    raise UserError(f"{key}: {setting} is a GPU kernel but the mesh's devices are {where}; use auto, blocked or "
                    f"ragged_dot")
  if setting in GPU_MATMUL and jnp.dtype(dtype).itemsize != 2:
    raise UserError(f"{key}: {setting} takes bfloat16 or float16 inputs; set train.compute_dtype=bfloat16, or use "
                    f"auto or blocked")
  if where == "gpu":
    if setting == "tokamax" and not _mosaic_gemm_runs(cc, None):
      raise UserError(f"{key}: tokamax (tokamax's Mosaic GPU grouped GEMM, forward and backward) runs on sm_90 GPUs "
                      f"and this is {sm(cc)}; use auto (it picks {matmul_kind('auto', where, dtype, installed, cc)} "
                      f"here){' or tokamax_triton' if cc else ''}")
    if setting == "tokamax" and not _mosaic_gemm_runs(cc, dims):
      raise UserError(f"{key}: tokamax (tokamax's Mosaic GPU grouped GEMM) takes widths that are multiples of "
                      f"{MOSAIC_GEMM_TILE}, and the expert GEMMs here are {' × '.join(map(str, dims))}; use auto "
                      f"(tokamax_triton here) or tokamax_triton")
    if setting == "tokamax_triton" and not _triton_runs(cc):
      raise UserError(f"{key}: tokamax_triton needs an sm_80 or newer GPU and this is {sm(cc)}; use auto or "
                      f"blocked")
  return setting


def expert_dims(cfg, tensor: int) -> tuple[int, int]:
  """The widths of one expert-GEMM shard: the hidden size and the expert's intermediate size over `tensor` shards
  (model.moe_intermediate_size splits over the tensor axis)."""
  return cfg.model.hidden_size, cfg.model.moe_intermediate_size // max(tensor, 1)


def summary(cfg, where: str, cc: float | None = None, tokamax: bool | None = None, tensor: int | None = None) -> str:
  """One line for the start-up summary and the explorer: the attention, expert-GEMM and loss paths the run takes
  (cfg: the run's Config) on platform `where` with CUDA compute capability `cc`; `tensor`: the tensor axis size
  (default mesh.tensor)."""
  tensor = cfg.mesh.tensor if tensor is None else tensor
  m, t = cfg.model, cfg.train
  cc, installed = _gpu(where, cc, tokamax)
  attention = attention_kind(m.attention_impl, t.seq_len, where, t.compute_dtype, installed, cc,
                             m.attention_head_dims)
  parts = [f"attention {attention} ({LABELS[attention]})"]
  if m.is_moe:
    gemm = matmul_kind(m.moe_matmul, where, t.compute_dtype, installed, cc, expert_dims(cfg, tensor))
    parts.append(f"expert GEMM {gemm} ({LABELS['blocked_matmul' if gemm == 'blocked' else gemm]})")
  parts.append(f"loss {t.loss_impl} ({LABELS[t.loss_impl]})")
  line = f"kernels on {where if where != 'gpu' else sm(cc)}: " + " | ".join(parts)
  if where == "gpu" and not installed and "auto" in (m.attention_impl, m.moe_matmul):
    line += " — tokamax is not installed, so auto takes XLA's paths: pip install -e '.[gpu]' for the GPU kernels"
  if attention in DENSE_MASK:
    line += (f" — {attention} builds a dense [batch, query, key] mask of the packed documents inside tokamax "
             f"({DENSE_MASK[attention]}): 1 byte per query-key pair, growing with the square of train.seq_len "
             f"(docs/kernels.md)")
  return line


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


MOSAIC_BLOCK = 128  # the query block of tokamax's Mosaic GPU attention: its query length must be a multiple


def tokamax_attention(q_BTNK, k_BSGK, v_BSGP, segment_ids_BT, scale, key_segment_ids_BS=None, query_offset=0,
                      implementation: str = "mosaic", pad_to: int | None = None):
  """Causal attention through a tokamax kernel with the packed-document mask as key ranges per query:
  query t (at sequence position offset + t) sees keys [start of its segment, offset + t]. The queries are padded
  to a multiple of `pad_to` (default: Mosaic's query block for mosaic, none otherwise) and the padding sliced off;
  on the causal path the keys too, the padded queries seeing only padded keys."""
  tokamax_module()
  from tokamax._src.ops.attention import api, base  # tokamax 0.0.12 exports no Mask nor implementation table

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
