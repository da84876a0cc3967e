"""The sharding layout explorer: does a model fit a mesh, what does each device hold, what moves between them.

`describe(cfg)` builds the train state abstractly once; `plan(model, sizes, hw)` answers for one mesh given as
axis sizes (no devices needed) with the layout of every parameter, the optimiser state and one layer's
activations, the memory per device by kind, the collectives per mesh axis with their bytes and time, and the
compute time. The result is the JSON document of `python -m jaxseek.explore --json` (docs/explore.md).
Modules of jaxseek.explore: layout (placement), memory, comm, compile (--compile), gpu (--compile --target),
suggest (--suggest, out-of-memory advice), report (console tables, --plot).
"""

from __future__ import annotations

import math
import re
from typing import Any

from jaxseek.config import Config
from jaxseek.errors import UserError
from jaxseek.metrics import PEAK_TFLOPS
from jaxseek.kernels import choice as kernels
from jaxseek.explore import comm as comm_lib
from jaxseek.explore import layout as layout_lib
from jaxseek.explore import memory as memory_lib
from jaxseek.explore.comm import Hardware
from jaxseek.explore.layout import Model, describe
from jaxseek.pipeline import stages as pipeline_lib
from jaxseek.sharding import rules as rules_lib
from jaxseek.sharding.mesh import resolve_sizes

__all__ = ["GPUS", "Hardware", "Model", "describe", "hardware", "layout", "mesh_sizes", "plan"]

SCHEMA = 1
# Named devices: memory in MiB as the driver reports it, and the PEAK_TFLOPS key (dense bf16).
GPUS = {"h100-80g": (81559, "h100"), "h800-80g": (81559, "h800"), "h200-141g": (143771, "h200"),
        "a100-80g": (81920, "a100"), "a100-40g": (40960, "a100"), "b200-180g": (182642, "b200")}
# CUDA compute capability by PEAK_TFLOPS key: which kernels `auto` picks there (kernels/choice.py)
CAPABILITY = {"h100": 9.0, "h800": 9.0, "h200": 9.0, "gh200": 9.0, "a100": 8.0, "a800": 8.0, "l40s": 8.9,
              "b200": 10.0}
# memory bandwidth in TB/s by PEAK_TFLOPS key (the time of memory-bound kernels beside a collective: overlap.py)
MEMORY_TBPS = {"h100": 3.35, "h800": 3.35, "h200": 4.8, "gh200": 4.0, "a100": 2.04, "a800": 2.04, "l40s": 0.864,
               "b200": 8.0}
# dense float8 peak in TFLOP/s by PEAK_TFLOPS key (train.fp8's GEMMs; none on Ampere)
FP8_TFLOPS = {"h100": 1979.0, "h800": 1979.0, "h200": 1979.0, "gh200": 1979.0, "l40s": 733.0, "b200": 4500.0}
# nominal links per direction in Gb/s where they differ from the H100's NVLink 4 (3,600) and one 400G port (400):
# the H800's NVLink cut to 400 GB/s both ways, the A100's NVLink 3 (600 GB/s both ways) with HDR 200G, the B200's
# NVLink 5 (1.8 TB/s both ways)
LINKS = {"h800": (1600.0, 400.0), "a100": (2400.0, 200.0), "a800": (1600.0, 200.0), "b200": (7200.0, 400.0)}
DEFAULT_GPU = "h100-80g"
_SIZE = re.compile(r"^\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e\+?[0-9]+)?)\s*(gib|gb|mib|mb|tib|tb|b)?\s*$",
                   re.IGNORECASE)
_UNITS = {"b": 1, "mb": 1e6, "gb": 1e9, "tb": 1e12, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def hardware(device_memory: str | None = None, *, peak_tflops: float | None = None,
             intra_node_gbps: float | None = None, inter_node_gbps: float | None = None,
             devices_per_node: int = 8, usable_fraction: float = 0.9) -> Hardware:
  """A named GPU ("h100-80g"), a size ("80GiB", "75GB", "7.5e10B"; a bare number is GB), or None: the local
  accelerator if there is one, else h100-80g."""
  name, memory, peak, cc, fp8 = _device(device_memory)
  intra, inter = next((v for k, v in LINKS.items() if k in name.lower().replace(" ", "")), (None, None))
  links = {k: v for k, v in (("intra_node_gbps", intra_node_gbps or intra), ("inter_node_gbps", inter_node_gbps or inter))
           if v}
  return Hardware(name, memory, peak_tflops or peak, devices_per_node=devices_per_node,
                  usable_fraction=usable_fraction, capability=cc, fp8_tflops=fp8, **links)


def _device(device_memory: str | None) -> tuple[str, int, float, float, float | None]:
  if device_memory is None:
    detected = _detect()
    if detected:
      return detected
    device_memory = DEFAULT_GPU
  key = device_memory.strip().lower()
  if key in GPUS:
    mib, peak_key = GPUS[key]
    return key, mib * 2**20, PEAK_TFLOPS[peak_key], CAPABILITY[peak_key], FP8_TFLOPS.get(peak_key)
  match = _SIZE.match(key)
  if not match:
    raise UserError(f"--device-memory {device_memory!r} is neither a known device ({', '.join(GPUS)}) nor a size "
                    f"like 80GiB or 75GB")
  nbytes = float(match.group(1)) * _UNITS[(match.group(2) or "gb").lower()]
  if not 1 <= nbytes <= 2**50:
    raise UserError(f"--device-memory {device_memory!r} is not a device's memory; give a size from 1 byte to 1 PiB "
                    f"like 80GiB, or a device ({', '.join(GPUS)})")
  default = GPUS[DEFAULT_GPU][1]
  return (f"{device_memory.strip()} device", int(nbytes), PEAK_TFLOPS[default], CAPABILITY[default],
          FP8_TFLOPS.get(default))


def _detect() -> tuple[str, int, float, float, float | None] | None:
  """The local accelerator's name, memory limit, peak, compute capability and float8 peak, when JAX sees one."""
  import jax

  from jaxseek.kernels import choice as kernels

  device = jax.local_devices()[0]
  if device.platform == "cpu":
    return None
  limit = (device.memory_stats() or {}).get("bytes_limit")
  kind = device.device_kind.lower().replace(" ", "")
  peak = next((v for k, v in PEAK_TFLOPS.items() if k in kind), PEAK_TFLOPS[GPUS[DEFAULT_GPU][1]])
  cc = None if kernels.is_rocm(device) else kernels.capability(device) or CAPABILITY[GPUS[DEFAULT_GPU][1]]
  fp8 = next((v for k, v in FP8_TFLOPS.items() if k in kind), None)
  return (device.device_kind, int(limit), peak, cc, fp8) if limit else None


def mesh_sizes(cfg: Config, devices: int | None) -> dict[str, int]:
  """The configured mesh with its -1 axis filled for `devices` (default: the product of the fixed axes)."""
  sizes = cfg.mesh.sizes()
  if devices is None:
    auto = [a for a, s in sizes.items() if s == -1]
    if auto:
      raise UserError(f"mesh.{auto[0]} is -1 (auto); pass --devices N so the explorer can size it, or set "
                      f"mesh.{auto[0]} explicitly")
    devices = math.prod(sizes.values())
  return resolve_sizes(cfg.mesh, devices)


def plan(model: Model, sizes: dict[str, int], hw: Hardware, platform: str = "gpu") -> dict[str, Any]:
  """The whole analysis of one mesh as a JSON-ready dict (schema in docs/explore.md)."""
  with rules_lib.layout(model.cfg):  # the activation rules the step uses
    return _plan(model, sizes, hw, platform)


def layer_forward_flops(model: Model, sizes: dict[str, int]) -> float:
  """A layer's forward FLOPs for one microbatch on one device of its stage: a third of the step's training FLOPs
  per layer (forward + backward), per device of a stage's group."""
  cfg = model.cfg
  tokens = cfg.train.batch_size * cfg.train.seq_len / cfg.train.microbatches
  group = math.prod(n for a, n in sizes.items() if a != "pipeline")
  return model.flops_per_token * tokens / 3 / max(cfg.model.num_hidden_layers, 1) / group


def _plan(model: Model, sizes: dict[str, int], hw: Hardware, platform: str) -> dict[str, Any]:
  cfg = model.cfg
  if sizes["pipeline"] > 1:
    pipeline_lib.check_stacks(cfg, sizes["pipeline"])
  memory = memory_lib.memory(model, sizes, platform, hw.devices_per_node)
  comm = comm_lib.communication(model, sizes, hw, memory["stage"], platform)
  compute = comm_lib.compute_seconds(model, sizes, hw)
  usable = int(hw.memory_bytes * hw.usable_fraction)
  t = cfg.train
  return {
      "schema": SCHEMA,
      "model": {"model_type": cfg.model.model_type, "layers": cfg.model.num_hidden_layers,
                "dense_layers": cfg.model.num_dense_layers, "moe_layers": cfg.model.num_moe_layers,
                "mtp_layers": cfg.model.num_nextn_predict_layers},
      "total_parameters": model.total_parameters,
      "mtp_parameters": model.mtp_parameters,
      "mesh": dict(sizes),
      "devices": math.prod(sizes.values()),
      "pipeline": pipeline_lib.summary(cfg, sizes["pipeline"], sizes) if sizes["pipeline"] > 1 else "none",
      "pipeline_schedules": pipeline_lib.compare(cfg, sizes["pipeline"], layer_forward_flops(model, sizes))
      if sizes["pipeline"] > 1 else [],
      "train": {"batch_size": t.batch_size, "seq_len": t.seq_len, "microbatches": t.microbatches,
                "pipeline_repeats": t.pipeline_repeats,
                "remat": t.remat, "compute_dtype": t.compute_dtype, "param_dtype": t.param_dtype,
                "zero": t.zero, "optimizer_memory": t.optimizer_memory},
      "kernels": kernels.summary(cfg, platform, hw.capability, tokamax=True, tensor=sizes["tensor"]),
      "hardware": {"name": hw.name, "memory_bytes": hw.memory_bytes, "usable_bytes": usable,
                   "compute_capability": hw.capability,
                   "peak_tflops": hw.peak_tflops, "fp8_tflops": hw.fp8_tflops, "intra_node_gbps": hw.intra_node_gbps,
                   "inter_node_gbps": hw.inter_node_gbps, "devices_per_node": hw.devices_per_node},
      "parameters": _ordered(layout_lib.parameter_rows(model, sizes)),
      "optimizer": _ordered(layout_lib.optimizer_rows(model, sizes)),
      "activations": memory_lib.activation_rows(cfg, sizes, platform,
                                                memory_lib.expert_node(memory_lib.moe_sizes(cfg, sizes),
                                                                       hw.devices_per_node)),
      "memory_per_device": memory["bytes"],
      "memory": {"stage": memory["stage"], "stages": memory["stages"], "layers_on_stage": memory["layers_on_stage"],
                 "fits": memory["bytes"]["total"] <= usable, "platform": platform},
      "communication": comm,
      "expert_dispatch": comm_lib.expert_exchange(cfg, sizes, hw, platform),
      "gradient_sums_once_per_step": list(comm_lib.summed_axes(cfg, sizes)),
      "gradient_compression": comm_lib.compression_table(model, sizes, memory["stage"],
                                                         layout_lib.stage_layers(cfg, sizes["pipeline"]))
      if sizes["data"] > 1 else None,
      "compute": compute,
      "step_time_s": comm_lib.step_seconds(compute, comm),
  } | _prediction(model, sizes, hw, compute, comm, memory)


def _prediction(model: Model, sizes, hw: Hardware, compute, comm, memory) -> dict[str, Any]:
  """The step at achieved rates (explore/predict.py), on platforms it has rates for."""
  from jaxseek.explore import predict

  result = {"compute": compute, "communication": comm, "memory_per_device": memory["bytes"]}
  return {"prediction": predict.predict(model, sizes, hw, result)}


def _ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Rows in model order: embedding, dense stack, MoE stack, final norm, head, multi-token prediction."""
  order = {s: i for i, s in enumerate(layout_lib.STACKS)}
  return sorted(rows, key=lambda r: order.get(r["stack"], len(order)))


def layout(result: dict[str, Any]) -> dict[str, Any]:
  """The part of a plan that only the rules and shapes decide (the golden files of the tests)."""
  keep = ("name", "shape", "dtype", "logical_axes", "mesh_axes", "placement", "bytes_per_device")
  return {"mesh": result["mesh"], "total_parameters": result["total_parameters"],
          "parameters": [{k: r[k] for k in keep} for r in result["parameters"]],
          "optimizer": result["optimizer"],
          "activations": [{k: r[k] for k in ("name", "layer", "shape", "placement", "bytes_per_device")}
                          for r in result["activations"]],
          "state_bytes_per_device": {k: result["memory_per_device"][k] for k in ("parameters", "optimizer")}}
