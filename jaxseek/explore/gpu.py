"""Deviceless compilation of the real train step for NVIDIA GPUs on any machine (`--compile --target h200`).

XLA compiles for a PJRT GPU topology described by a `GpuTargetConfigProto` (the files in `targets/`, XLA's own
device descriptions) without a GPU or a driver: the result is the optimised GPU program, its buffer assignment
(`memory_analysis()`, per device), which kernels it runs (custom calls: tokamax's Mosaic GPU and Triton
kernels, cuBLAS, cuDNN) and which collectives it overlaps with compute (explore/overlap.py). Needs the CUDA
build of JAX (`pip install -e '.[gpu]'`), never a GPU. Nothing is autotuned and cuBLAS/cuDNN workspaces are not
sized; everything else is the real compiler pipeline.
"""

from __future__ import annotations

import collections
import contextlib
import re
from importlib import resources
from typing import Any, Iterator

import jax
import numpy as np

from jaxseek.config import Config
from jaxseek.errors import UserError

# XLA's own device descriptions (openxla/xla xla/backends/gpu/target_config/specs/), and the --device-memory each
# target plans with
TARGETS = {"h200": "h200.txtpb", "h100": "h100_sxm.txtpb", "a100": "a100_sxm_80.txtpb", "b200": "b200.txtpb"}
TARGET_MEMORY = {"h200": "h200-141g", "h100": "h100-80g", "a100": "a100-80g", "b200": "b200-180g"}
DEVICELESS_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}
CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
KERNEL_NAMES = {"mosaic_gpu": "tokamax Mosaic GPU", "triton": "Triton (Pallas)", "cudnn$fmha": "cuDNN attention",
                "cublas": "cuBLAS GEMM"}


def topology_devices(target: str, hosts: int = 1, per_host: int = 1) -> list:
  """The compile-only devices of `hosts` × `per_host` GPUs of one kind (processes = hosts)."""
  if target not in TARGETS:
    raise UserError(f"--target {target}: known targets are {', '.join(TARGETS)}")
  try:
    import jax_plugins.xla_cuda12  # noqa: F401  (the CUDA PJRT plugin: compiles for GPUs, needs no GPU here)
  except ImportError:
    raise UserError("--target needs the CUDA build of JAX (no GPU needed): pip install -e '.[gpu]'") from None
  from jax.experimental import topologies

  spec = resources.files("jaxseek.explore.targets").joinpath(TARGETS[target]).read_text()
  topology = topologies.get_topology_desc(platform="cuda", topology=f"{hosts}x1x{per_host}", target_config=spec)
  return list(topology.devices)


@contextlib.contextmanager
def default_device(device) -> Iterator[None]:
  """Make `device` the default device while tracing. Kernel libraries (tokamax) choose and size their kernels
  from the default device (device kind, compute capability, core count), which in a deviceless compile is the
  CPU; jaxseek itself resolves kernels from the mesh's devices."""
  import jax.extend.backend as backend

  saved = backend.get_default_device, jax.devices, jax.local_devices
  real_devices, real_local = jax.devices, jax.local_devices
  backend.get_default_device = lambda: device
  jax.devices = lambda backend=None: [device] if backend is None else real_devices(backend)
  jax.local_devices = lambda process_index=None, backend=None, host_id=None: (
      [device] if (process_index, backend, host_id) == (None, None, None)
      else real_local(process_index=process_index, backend=backend, host_id=host_id))
  try:
    yield
  finally:
    backend.get_default_device, jax.devices, jax.local_devices = saved


def target_rates(target: str, per_host: int, hw=None):
  """What the overlap estimate times kernels and transfers with (explore/overlap.py): `target`'s dense peaks
  (bfloat16, float8) and memory bandwidth, the links of `hw` (a comm.Hardware; default: NVLink 4 within a node, 400 Gb/s across)."""
  from jaxseek.explore import comm, core
  from jaxseek.explore.overlap import Rates

  hw = hw or comm.Hardware(target, 0, 0.0)
  key = core.GPUS[TARGET_MEMORY[target]][1]
  return Rates(flops=core.PEAK_TFLOPS[key] * 1e12, memory=core.MEMORY_TBPS[key] * 1e12,
               intra_node=hw.intra_node_gbps * 1e9 / 8, inter_node=hw.inter_node_gbps * 1e9 / 8, per_node=per_host,
               fp8_flops=core.FP8_TFLOPS.get(key, 0.0) * 1e12)


def compile_for_target(cfg: Config, sizes: dict[str, int], target: str, per_host: int, hw=None) -> dict[str, Any]:
  """Compiles the train step for prod(sizes) GPUs of `target` (`per_host` to a host); returns XLA's figures per
  device, the kernels (custom calls) the program runs, its largest array shapes and the collectives it overlaps
  with compute (with what they hide, timed at `target_rates(target, per_host, hw)`)."""
  from jaxseek import step as step_lib
  from jaxseek.explore import compile as explore_compile
  from jaxseek.explore import overlap as explore_overlap
  from jaxseek.explore import predict as explore_predict
  from jaxseek.kernels import choice as kernels
  from jaxseek.sharding import mesh as mesh_lib

  n = int(np.prod(list(sizes.values())))
  per_host = min(per_host, n)
  if n % per_host:
    raise UserError(f"--devices-per-node {per_host} does not divide the mesh's {n} devices")
  devices = topology_devices(target, n // per_host, per_host)
  mesh = mesh_lib.make_mesh(cfg, devices)
  batch = explore_compile.abstract_batch(cfg, mesh)
  from absl import logging as absl_logging

  absl_logging.set_verbosity(absl_logging.ERROR)  # tokamax warns of every autotuning-cache miss (none is tuned)
  with default_device(devices[0]):
    trainer = step_lib.make_trainer(cfg, mesh)
    step = step_lib.compile_step(trainer, cfg, mesh)
    with jax.set_mesh(mesh):
      # XLA takes CUB's radix sort where it holds deviceless scratch sizes (H100) and then asks the CUDA runtime
      # for a device: the same fallback sort as on the other targets keeps the compile deviceless
      options = {**DEVICELESS_OPTIONS, **kernels.compiler_options(cfg, "gpu")}
      # as the run compiles it: with train.op_costs=rates twice, the second planning with the first's op costs
      compiled = explore_predict.compile_planned(step.lower(trainer.abstract_state, batch), cfg, options,
                                                 devices[0].device_kind, per_host, where="gpu")
  stats = compiled.memory_analysis()
  text = compiled.as_text()
  calls = collections.Counter(CUSTOM_CALL.findall(text))

  return {"target": target, "devices": n, "hosts": n // per_host, "device_kind": devices[0].device_kind,
          "compute_capability": kernels.capability(devices[0]),
          "kernel_choice": kernels.summary(cfg, *kernels.device_target(devices[0]), tensor=sizes["tensor"]),
          "argument_bytes": stats.argument_size_in_bytes, "output_bytes": stats.output_size_in_bytes,
          "alias_bytes": stats.alias_size_in_bytes, "temp_bytes": stats.temp_size_in_bytes,
          "total_bytes": stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
          + stats.temp_size_in_bytes,
          "batch_bytes": sum(int(np.prod(b.sharding.shard_shape(b.shape))) * b.dtype.itemsize for b in batch.values()),
          "custom_calls": dict(calls), "kernels": kernels_used(calls),
          "collectives": explore_compile.count_collectives(text, tuple(mesh.devices.shape)),
          "overlap": explore_overlap.overlap(text, target_rates(target, per_host, hw)),
          "matmuls": explore_compile.matmul_flops(text), "hlo": text}


def kernels_used(calls: dict[str, int]) -> dict[str, int]:
  """Custom calls grouped by the kernel family they run."""
  out: dict[str, int] = collections.Counter()
  for name, count in calls.items():
    family = next((label for key, label in KERNEL_NAMES.items() if key in name), None)
    if family:
      out[family] += count
  return dict(out)


def largest_shapes(hlo: str, top: int = 5) -> list[tuple[str, int]]:
  """The largest array types named in an HLO text (dtype[dims]) and their bytes, largest first."""
  from jaxseek.explore import overlap

  seen = {}
  for dtype, dims in re.findall(r"\b(f32|bf16|f16|s32|u32|f8e4m3fn|s8|pred|u8)\[([\d,]+)\]", hlo):
    shape = f"{dtype}[{dims}]"
    if shape not in seen:
      seen[shape] = overlap.array_bytes(shape)
  return sorted(seen.items(), key=lambda kv: -kv[1])[:top]
