"""The device mesh: axes pipeline, data, fsdp, expert, context, tensor (outermost to innermost)."""

from __future__ import annotations

import math

import jax
from jax.sharding import AxisType, Mesh

from jaxseek.config import MESH_AXES, Config, MeshConfig, check_mesh_fit
from jaxseek.errors import UserError


def simulate_cpu_devices(n: int | None) -> None:
  """Asks XLA:CPU for `n` devices; must run before the JAX backend starts (first array or device query)."""
  if not n:
    return
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:  # the backend already started (a library or test touched JAX first)
    if jax.devices()[0].platform == "cpu" and jax.device_count() != n:
      raise UserError(f"mesh.num_cpu_devices={n} cannot take effect: JAX already started with "
                      f"{jax.device_count()} devices; set it before any JAX computation") from None


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
  """Builds the 6-axis mesh over `devices` (default: all), every axis AxisType.Auto (GSPMD propagation)."""
  devices = list(jax.devices()) if devices is None else list(devices)
  sizes = resolve_sizes(cfg.mesh, len(devices))
  check_mesh_fit(cfg, sizes)
  return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def describe(mesh: Mesh) -> str:
  return " × ".join(f"{a}={n}" for a, n in mesh.shape.items())
