"""Which implementation runs attention, the experts' grouped matmul and the expert exchange, on which device.

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

import jax
import jax.numpy as jnp

from jaxseek.errors import UserError
from jaxseek.kernels import flash, fp8_gemm
from jaxseek.kernels.gpu import has_tokamax, platform  # noqa: F401 (callers ask choice.platform())

GPU_ATTENTION = ("mosaic", "triton", "cudnn")
GPU_MATMUL = {"tokamax": "mosaic", "tokamax_triton": "triton"}


def compiler_options(cfg, where: str | None = None) -> dict[str, bool | int]:
  """XLA options the train step compiles with on platform `where` (default: the mesh's): on GPU the
  latency-hiding scheduler (train.latency_hiding), which XLA:GPU leaves off for a program of a training step's
  size, so that nothing would overlap the expert exchange or the weight gathers, and the memory it plans within
  (train.latency_hiding_memory), with the op costs of train.pgle_profile where it is set."""
  if (where or platform()) != "gpu":
    return {}
  options = {"xla_gpu_enable_latency_hiding_scheduler": cfg.train.latency_hiding}
  if cfg.train.latency_hiding:
    options["xla_gpu_memory_limit_slop_factor"] = cfg.train.latency_hiding_memory
    if cfg.train.pgle_profile:
      options["xla_gpu_pgle_profile_file_or_directory_path"] = cfg.train.pgle_profile
  return options


def plans_with_rates(cfg, where: str | None = None) -> bool:
  """Whether the step's GPU compile plans with op costs at the achieved rates (train.op_costs=rates): on GPU, with
  the latency-hiding scheduler on and no train.pgle_profile (a profile overrides)."""
  t = cfg.train
  return (where or platform()) == "gpu" and t.latency_hiding and t.op_costs == "rates" and not t.pgle_profile


def pgle_profile_error(path: str) -> str | None:
  """Why the file at `path` is not an op-cost profile XLA can read (a ProfiledInstructionsProto, as text or
  binary, naming at least one instruction), or None. XLA reads it only while compiling on a GPU, and a file it
  cannot parse is dropped there with a log line: checked here instead, on every platform."""
  from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format, unknown_fields

  proto = descriptor_pb2.FileDescriptorProto(name="jaxseek_pgle.proto", package="tensorflow.profiler",
                                             syntax="proto3")
  message = proto.message_type.add(name="ProfiledInstructionsProto")
  scalar = descriptor_pb2.FieldDescriptorProto
  for name, fields in (("InstructionCost", (("name", scalar.TYPE_STRING), ("cost_us", scalar.TYPE_DOUBLE))),
                       ("Latency", (("source", scalar.TYPE_STRING), ("target", scalar.TYPE_STRING),
                                    ("latency_us", scalar.TYPE_DOUBLE)))):
    nested = message.nested_type.add(name=name)
    for number, (field, kind) in enumerate(fields, 1):
      nested.field.add(name=field, number=number, type=kind, label=scalar.LABEL_OPTIONAL)
  for number, (field, kind) in enumerate((("costs", "InstructionCost"), ("latencies", "Latency")), 1):
    message.field.add(name=field, number=number, type=scalar.TYPE_MESSAGE, label=scalar.LABEL_REPEATED,
                      type_name=f".tensorflow.profiler.ProfiledInstructionsProto.{kind}")
  pool = descriptor_pool.DescriptorPool()
  pool.Add(proto)
  profile = message_factory.GetMessageClass(pool.FindMessageTypeByName(
      "tensorflow.profiler.ProfiledInstructionsProto"))()
  data = open(path, "rb").read()
  try:
    text_format.Parse(data.decode("utf-8"), profile)
  except (UnicodeDecodeError, text_format.ParseError) as text_error:
    try:
      profile.ParseFromString(data)
      foreign = len(unknown_fields.UnknownFieldSet(profile))  # bytes that decode, but as no field of the profile
    except Exception:  # noqa: BLE001 — protobuf's DecodeError, or what a non-protobuf file makes it raise
      foreign = 1
    if foreign:
      return f"is not an op-cost profile XLA reads ({str(text_error).splitlines()[0][:120]})"
  if not profile.costs and not profile.latencies:
    return "names no instruction's cost (an empty profile)"
  return None


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
  return cc, has_tokamax() if tokamax is None else tokamax


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
  recipe = fp8_gemm.resolve(t.fp8, where, cc)
  if m.is_moe and recipe not in (None, "blockwise"):  # kernels/fp8_grouped.py
    scaled = "one scale per tensor" if recipe == "tensorwise" else "rows and expert columns scaled"
    kernel = "tokamax Triton kernel" if where == "gpu" else "XLA ragged_dot on the e4m3 values"
    parts.append(f"expert GEMM float8 ({kernel}, {scaled})")
  elif m.is_moe:
    gemm = matmul_kind(m.moe_matmul, where, t.compute_dtype, installed, cc, expert_dims(cfg, tensor))
    parts.append(f"expert GEMM {gemm} ({LABELS['blocked_matmul' if gemm == 'blocked' else gemm]})")
  parts.append(f"loss {t.loss_impl} ({LABELS[t.loss_impl]})")
  if recipe is not None:
    parts.append(f"FP8 {recipe} ({fp8_gemm.LABELS[recipe]})")
  if where == "gpu":
    memory = f" within {t.latency_hiding_memory}% of XLA's memory limit" if t.latency_hiding_memory != 95 else ""
    if t.pgle_profile:
      costs = f", op costs from {t.pgle_profile}"
    elif t.op_costs == "rates":
      costs = ", op costs at this GPU's achieved rates (train.op_costs=rates: compiled twice)"
    else:
      costs = ", XLA's own op costs (train.op_costs=xla)"
    profile = costs if t.latency_hiding else ""
    unused = f" (train.pgle_profile={t.pgle_profile} unused)" if t.pgle_profile and not t.latency_hiding else ""
    parts.append(f"XLA latency-hiding scheduler {'on' + memory + profile if t.latency_hiding else 'off' + unused}")
  else:  # the scheduler's settings shape a GPU compile only
    unused = [f"train.{key}={getattr(t, key)}" for key, default in (("pgle_profile", None), ("latency_hiding", True),
                                                                    ("latency_hiding_memory", 95), ("op_costs", "rates"))
              if getattr(t, key) != default]
    if unused:
      parts.append(f"{', '.join(unused)} unused (they set XLA's GPU scheduler)")
  line = f"kernels on {where if where != 'gpu' else sm(cc)}: " + " | ".join(parts)
  if where == "gpu" and not installed and "auto" in (m.attention_impl, m.moe_matmul):
    line += " — tokamax is not installed, so auto takes XLA's paths: pip install -e '.[gpu]' for the GPU kernels"
  if attention in DENSE_MASK:
    line += (f" — {attention} builds a dense [batch, query, key] mask of the packed documents inside tokamax "
             f"({DENSE_MASK[attention]}): 1 byte per query-key pair, growing with the square of train.seq_len "
             f"(docs/kernels.md)")
  return line


def dispatch_kind(setting: str, where: str | None = None) -> str:
  """model.moe_dispatch resolved for platform `where` (default: the mesh's): auto is ragged on GPU and TPU,
  fixed elsewhere; two_stage runs where ragged does (sharding/experts.py)."""
  where = where or platform()
  if setting == "auto":
    return "ragged" if where in ("gpu", "tpu") else "fixed"
  if setting in ("ragged", "two_stage") and where not in ("gpu", "tpu"):
    raise UserError(f"config key model.moe_dispatch: {setting} needs ragged-all-to-all, which XLA does not "
                    f"implement on {where}; use auto or fixed")
  return setting
