"""The device mesh: axes pipeline, data, fsdp, expert, context, tensor (outermost to innermost)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
import platform

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxseek.config import MESH_AXES, Config, DistConfig, MeshConfig, check_mesh_fit
from jaxseek.errors import UserError

# Axes that must stay inside one node (NVLink): their collectives run every layer.
HOST_LOCAL_AXES = ("expert", "tensor")
_NODES: dict[int, int] | None = None  # process index → node number, learnt once per run


def initialize_distributed(dist: DistConfig) -> bool:
  """Joins the processes of a multi-process run with jax.distributed, before the backend starts.

  Explicit settings (config, then JAXSEEK_COORDINATOR / JAXSEEK_NUM_PROCESSES / JAXSEEK_PROCESS_ID) win; else JAX
  detects SLURM (srun) or Open MPI (mpirun). Returns False for a single process, which skips it.
  """
  coordinator = dist.coordinator or os.environ.get("JAXSEEK_COORDINATOR")
  num_processes = dist.num_processes or _env_int("JAXSEEK_NUM_PROCESSES")
  process_id = dist.process_id if dist.process_id is not None else _env_int("JAXSEEK_PROCESS_ID")
  managed = _env_int("SLURM_NTASKS", 1) > 1 or _env_int("OMPI_COMM_WORLD_SIZE", 1) > 1
  if not coordinator and not managed:
    return False
  if coordinator and (num_processes is None or process_id is None):
    raise UserError("dist.coordinator is set but dist.num_processes or dist.process_id is not; set all three "
                    "(or JAXSEEK_NUM_PROCESSES and JAXSEEK_PROCESS_ID)")
  local_ids = _node_local_devices() if dist.process_per == "node" else None
  try:
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_ids, initialization_timeout=dist.init_timeout_s,
                               heartbeat_timeout_seconds=dist.heartbeat_timeout_s)
  except Exception as e:  # noqa: BLE001 — a coordinator that cannot be reached is a set-up error
    raise UserError(f"jax.distributed could not start ({type(e).__name__}: {str(e).splitlines()[0][:160]}); check "
                    f"dist.coordinator / the launcher and that every process started") from None
  return True


def _env_int(name: str, default: int | None = None) -> int | None:
  value = os.environ.get(name)
  return int(value) if value not in (None, "") else default


def _node_local_devices() -> list[int]:
  """All GPUs this process may use when one process drives a whole node."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible:
    return list(range(len(visible.split(","))))
  count = _env_int("SLURM_GPUS_ON_NODE") or _env_int("SLURM_GPUS_PER_NODE")
  if not count:
    raise UserError("dist.process_per=node needs CUDA_VISIBLE_DEVICES or SLURM_GPUS_ON_NODE to count this node's "
                    "GPUs; export one of them in the job script")
  return list(range(count))


def simulate_cpu_devices(n: int | None) -> None:
  """Asks XLA:CPU for `n` devices, and has a program on one CPU device run on the thread that calls it (JAX's
  jax_cpu_enable_async_dispatch off; programs over several devices run on XLA's threads either way), which lets
  `keep_host_memory` keep its temporaries mapped. Must run before the JAX backend starts (first array or device
  query); accelerators are unaffected."""
  jax.config.update("jax_cpu_enable_async_dispatch", False)
  if not n:
    return
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:  # the backend already started (a library or test touched JAX first)
    if jax.devices()[0].platform == "cpu" and jax.device_count() != n:
      raise UserError(f"mesh.num_cpu_devices={n} cannot take effect: JAX already started with "
                      f"{jax.device_count()} devices; set it before any JAX computation") from None


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


@functools.cache
def keep_host_memory() -> bool:
  """On CPU: glibc's malloc keeps what a step frees for the next (no mmap for large blocks, no trimming below 2
  GiB), so XLA:CPU's temporaries, one block per run of a program (1.2 GiB for benchmarks/bench_vs_hf.py's
  step), are not mapped anew and zero-filled page by page by the kernel every step (0.5 s of system time in a
  1.7 s step there). Blocks XLA allocates on its own threads (programs over several devices) are mapped as
  before. The process keeps its peak memory until it exits. Returns whether the setting took effect (glibc only)."""
  if platform.libc_ver()[0] != "glibc":
    return False
  libc = ctypes.CDLL(ctypes.util.find_library("c"))
  return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def resolve_sizes(mesh_cfg: MeshConfig, num_devices: int) -> dict[str, int]:
  """Axis sizes with the one -1 filled; raises UserError when the product cannot equal `num_devices`."""
  sizes = mesh_cfg.sizes()
  fixed = math.prod(s for s in sizes.values() if s != -1)
  shape = " × ".join(f"{a}={s}" for a, s in sizes.items())
  if -1 in sizes.values():
    auto = next(a for a, s in sizes.items() if s == -1)
    if num_devices % fixed:
      raise UserError(f"mesh {shape} cannot fill {num_devices} devices: the fixed axes multiply to {fixed}, which "
                      f"does not divide {num_devices}; change the fixed axes")
    sizes[auto] = num_devices // fixed
  elif fixed != num_devices:
    raise UserError(f"mesh {shape} needs {fixed} devices but {num_devices} are available; set one axis to -1 "
                    f"(e.g. mesh.data=-1) or make the sizes multiply to {num_devices}")
  return sizes


def make_mesh(cfg: Config, devices: list | None = None) -> Mesh:
  """Builds the 6-axis mesh over `devices` (default: all), every axis AxisType.Auto (GSPMD propagation).

  Devices are ordered by (process, id) and the innermost axes vary fastest, so the inner axes (tensor,
  context, expert) fill one process before the outer ones (fsdp, data, pipeline) cross to the next.
  """
  devices = list(jax.devices()) if devices is None else list(devices)
  sizes = resolve_sizes(cfg.mesh, len(devices))
  check_mesh_fit(cfg, sizes)
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  grid = np.array(ordered, dtype=object).reshape(tuple(sizes[a] for a in MESH_AXES))
  if not cfg.mesh.allow_cross_host:
    check_host_local(grid)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def process_nodes() -> dict[int, int]:
  """Which node each process runs on: processes with the same host name (or JAXSEEK_NODE, which
  scripts/launch_local.py sets to tell simulated nodes apart) share a node. One all-gather, the first time."""
  global _NODES
  if _NODES is None:
    if jax.process_count() == 1:
      _NODES = {0: 0}
    else:
      import hashlib
      import socket

      from jax.experimental import multihost_utils

      name = os.environ.get("JAXSEEK_NODE") or socket.gethostname()
      key = np.frombuffer(hashlib.sha256(name.encode()).digest()[:4], np.int32)
      keys = np.asarray(multihost_utils.process_allgather(key)).reshape(-1)
      first = {k: i for i, k in reversed(list(enumerate(keys)))}  # a node is numbered by its first process
      _NODES = {p: first[k] for p, k in enumerate(keys)}
  return _NODES


def check_host_local(grid: np.ndarray) -> None:
  """Refuses a layout whose expert or tensor groups span nodes (their per-layer collectives would cross the slow
  inter-node links). With one process per GPU the processes of a node share its NVLink: they may form a group."""
  nodes = process_nodes()
  for axis in HOST_LOCAL_AXES:
    moved = np.moveaxis(grid, MESH_AXES.index(axis), -1).reshape(-1, grid.shape[MESH_AXES.index(axis)])
    for group in moved:
      spanned = {nodes.get(d.process_index, d.process_index) for d in group}
      if len(spanned) > 1:
        raise UserError(f"mesh.{axis}={len(group)} would span processes {sorted({d.process_index for d in group})} "
                        f"on {len(spanned)} nodes; keep {axis} within a node or set mesh.allow_cross_host=true")


def describe(mesh: Mesh) -> str:
  return " × ".join(f"{a}={n}" for a, n in mesh.shape.items())


def startup_line(mesh: Mesh) -> str:
  """One line per process: who it is, how many devices it drives, the mesh."""
  return (f"process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} local of "
          f"{jax.device_count()} {jax.devices()[0].platform} devices | mesh {describe(mesh)}")
