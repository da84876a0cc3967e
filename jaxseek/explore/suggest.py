"""Choosing a layout: every mesh of N devices that divides the model, ranked by predicted step time
(`--suggest`; the prediction at achieved rates, explore/predict.py, with the bound at peak beside it), and the smallest change that makes a run fit after it ran out of device memory.

For each mesh the settings that fit are searched: remat none, then full; the fewest microbatches that fit
(and, with pipeline stages, more microbatches while they shorten the bubble). Expert and tensor groups (with
context between them) must fit in one node, as `make_mesh` demands unless `mesh.allow_cross_host` is set.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shlex
from typing import Any, Iterator

from jaxseek.config import MESH_AXES, Config, check_mesh_fit
from jaxseek.errors import UserError
from jaxseek.explore import comm as comm_lib
from jaxseek.explore import layout as ex
from jaxseek.explore import memory as memory_lib
from jaxseek.explore.comm import Hardware
from jaxseek.explore.layout import Model
from jaxseek.explore.report import human


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One layout that fits, with what its step time is made of."""

  sizes: dict[str, int]
  microbatches: int
  remat: str
  memory_bytes: int
  step_s: float  # predicted at achieved rates
  parts: dict[str, float]  # seconds: the prediction's parts ("compute", "pipeline bubble", "exposed expert exchange", ...)
  bound_s: float = 0.0  # the bound at peak rates, nothing overlapped
  moe_tensor: str | None = None  # model.moe_tensor where the search chose it (MoE, tensor > 1)

  def overrides(self) -> list[str]:
    return [f"mesh.{a}={self.sizes[a]}" for a in MESH_AXES] + [f"train.microbatches={self.microbatches}",
                                                                f"train.remat={self.remat}"] + \
        ([f"model.moe_tensor={self.moe_tensor}"] if self.moe_tensor else [])


def meshes(cfg: Config, devices: int, hw: Hardware, pipeline: bool = False) -> Iterator[dict[str, int]]:
  """Axis sizes multiplying to `devices` that the model's dimensions and the batch divide."""
  m = cfg.model
  for sizes in _factorizations(devices, len(MESH_AXES)):
    s = dict(zip(MESH_AXES, sizes))
    if (s["pipeline"] > 1 and (not pipeline or not any(ex.pipelined(cfg, st, s["pipeline"])
                                                      for st in ex.LAYER_STACKS))) \
        or (s["expert"] > 1 and not m.is_moe) or cfg.train.seq_len % s["context"] \
        or (s["expert"] * s["context"] * s["tensor"] > hw.devices_per_node and not cfg.mesh.allow_cross_host):
      continue
    try:
      check_mesh_fit(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=1)), s)
    except UserError:
      continue
    yield s


def _factorizations(n: int, k: int) -> Iterator[tuple[int, ...]]:
  if k == 1:
    yield (n,)
    return
  for d in range(1, n + 1):
    if n % d == 0:
      for rest in _factorizations(n // d, k - 1):
        yield (d,) + rest


def microbatch_options(cfg: Config, sizes: dict[str, int]) -> list[int]:
  shards = memory_lib.batch_shards({**sizes, "pipeline": 1})  # microbatch rows: split over the batch axes
  B = cfg.train.batch_size
  return [m for m in range(1, B + 1) if B % m == 0 and (B // m) % shards == 0]


def evaluate(model: Model, sizes: dict[str, int], hw: Hardware, budget: int | None = None,
             platform: str = "gpu") -> Candidate | None:
  """The fastest settings (remat, microbatches, and on an MoE mesh with tensor > 1 model.moe_tensor) with which
  `sizes` fits in `budget` bytes per device."""
  budget = int(hw.memory_bytes * hw.usable_fraction) if budget is None else budget
  best = None
  for variant, moe_tensor in _moe_tensor_options(model, sizes):
    for remat in ("none", "full"):
      for micro in microbatch_options(model.cfg, sizes):
        candidate = measure(variant.with_train(remat=remat, microbatches=micro), sizes, hw, platform)
        candidate = dataclasses.replace(candidate, moe_tensor=moe_tensor)
        if candidate.memory_bytes > budget:
          continue
        if best is None or candidate.step_s < best.step_s:
          best = candidate
        if sizes["pipeline"] == 1 or micro >= 4 * sizes["pipeline"]:
          break  # more microbatches only repeat the weight collectives
  return best


def _moe_tensor_options(model: Model, sizes: dict[str, int]) -> list[tuple[Model, str | None]]:
  """The model as given, and on an MoE mesh with tensor > 1 also with the other model.moe_tensor where the mesh
  divides it (experts: n_routed_experts by expert × tensor, the length by context × tensor)."""
  m, t = model.cfg.model, sizes["tensor"]
  if not m.is_moe or t == 1:
    return [(model, None)]
  out = [(model, m.moe_tensor)]
  other = "experts" if m.moe_tensor == "split" else "split"
  fits = (m.n_routed_experts % (sizes["expert"] * t) == 0 and model.cfg.train.seq_len % (sizes["context"] * t) == 0
          if other == "experts" else m.n_routed_experts % sizes["expert"] == 0 and m.moe_intermediate_size % t == 0)
  return out + ([(model.with_model(moe_tensor=other), other)] if fits else [])


# the prediction's parts (explore/predict.py) by the names "why it loses" gives them
PARTS = {"compute": "compute_s", "pipeline bubble": "bubble_s", "memory-bound kernels": "memory_bound_s",
         "kernel launches": "launch_s", "exposed expert exchange": "exposed_exchange_s",
         "exposed gradient reductions": "exposed_reductions_s", "other exposed collectives": "exposed_other_s",
         "optimiser update": "optimizer_s"}


def measure(model: Model, sizes: dict[str, int], hw: Hardware, platform: str = "gpu") -> Candidate:
  from jaxseek.explore import predict as predict_lib

  memory = memory_lib.memory(model, sizes, platform, hw.devices_per_node)
  comm = comm_lib.communication(model, sizes, hw, memory["stage"], platform)
  compute = comm_lib.compute_seconds(model, sizes, hw)
  prediction = predict_lib.predict(model, sizes, hw, {"compute": compute, "communication": comm,
                                                      "memory_per_device": memory["bytes"]})
  parts = {name: prediction[key] for name, key in PARTS.items()}
  t = model.cfg.train
  return Candidate(dict(sizes), t.microbatches, t.remat, memory["bytes"]["total"], prediction["step_s"], parts,
                   comm_lib.step_seconds(compute, comm))


def suggest(model: Model, devices: int, hw: Hardware, top: int = 10, pipeline: bool = False) -> list[dict[str, Any]]:
  """The `top` fastest layouts that fit, each with the reason it loses to the first."""
  found = [c for s in meshes(model.cfg, devices, hw, pipeline) if (c := evaluate(model, s, hw)) is not None]
  found.sort(key=lambda c: (c.step_s, c.memory_bytes))
  ranked = found[:top]
  return [{"rank": i + 1, "mesh": c.sizes, "microbatches": c.microbatches, "remat": c.remat, "moe_tensor": c.moe_tensor,
           "memory_bytes": c.memory_bytes, "step_time_s": c.bound_s, "predicted_step_s": c.step_s, "parts_s": c.parts,
           "overrides": c.overrides(), "why_not_first": loses(c, ranked[0]) if i else ""}
          for i, c in enumerate(ranked)]


def loses(candidate: Candidate, first: Candidate) -> str:
  """Why `candidate` is slower than `first`: the step-time part that grew the most."""
  keys = set(candidate.parts) | set(first.parts)
  deltas = {k: candidate.parts.get(k, 0.0) - first.parts.get(k, 0.0) for k in keys}
  worst = max(deltas, key=deltas.get)
  slower = candidate.step_s - first.step_s
  if slower <= 1e-12:
    return "as fast as the first (a tie)"
  why = f"{worst} {_s(candidate.parts.get(worst, 0.0))} vs {_s(first.parts.get(worst, 0.0))}"
  if worst == "compute" and candidate.remat != first.remat:
    why += " (remat full recomputes the forward)"
  return f"+{_s(slower)} per step: {why}"


def _s(seconds: float) -> str:
  return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


# --------------------------------------------------------------------------------------- out of memory

_ALLOC = re.compile(r"allocate\s+([0-9]+)\s*(?:bytes|B)\b", re.IGNORECASE)


def is_out_of_memory(error: BaseException) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def smallest_fit(model: Model, sizes: dict[str, int], hw: Hardware, budget: int) -> list[str] | None:
  """The fewest config changes whose estimate fits `budget`: more microbatches, then remat, then both, then
  another mesh of the same devices. None when nothing fits."""
  t = model.cfg.train
  options = [m for m in microbatch_options(model.cfg, sizes) if m > t.microbatches]
  tries = [{"microbatches": m} for m in options]
  if t.remat == "none":
    tries += [{"remat": "full"}] + [{"remat": "full", "microbatches": m} for m in options]
  for change in tries:
    changed = memory_lib.memory(model.with_train(**change), sizes, devices_per_node=hw.devices_per_node)
    if changed["bytes"]["total"] <= budget:
      return [f"train.{k}={v}" for k, v in change.items()]
  others = [c for s in meshes(model.cfg, math.prod(sizes.values()), hw) if s != sizes
            and (c := evaluate(model, s, hw, budget)) is not None]
  if not others:
    return None
  best = min(others, key=lambda c: c.step_s)
  now = {**{f"mesh.{a}": sizes[a] for a in MESH_AXES}, "train.microbatches": t.microbatches, "train.remat": t.remat}
  return [o for o in best.overrides() if str(now[o.split("=")[0]]) != o.split("=")[1]]


def explore_command(config_path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> str:
  """The explorer command line for a config file and its overrides."""
  args = ["python", "-m", "jaxseek.explore"] + (["--config", str(config_path)] if config_path else [])
  return shlex.join(args + list(overrides))


def explain_oom(cfg: Config, error: BaseException, config_path: str | None, overrides: list[str] | tuple[str, ...],
                devices: int | None = None, hw: Hardware | None = None) -> str | None:
  """One line for a step that ran out of device memory: the estimate, the smallest change that fits it, and
  the explorer command for this config. None when `error` is not an out-of-memory error."""
  if not is_out_of_memory(error):
    return None
  import jax

  from jaxseek.explore import core as explore

  hw = hw or explore.hardware(None)
  devices = devices or jax.device_count()
  model = explore.describe(cfg)
  sizes = explore.mesh_sizes(cfg, devices)
  estimate = memory_lib.memory(model, sizes, devices_per_node=hw.devices_per_node)["bytes"]["total"]
  budget = int(hw.memory_bytes * hw.usable_fraction)
  asked = _ALLOC.search(str(error))
  if estimate <= budget:  # the estimate is short of what the run needed: ask for that much less
    budget = estimate - int(asked.group(1)) if asked else int(0.75 * estimate)
  change = smallest_fit(model, sizes, hw, budget)
  fix = f"try {' '.join(change)}" if change else f"no layout of {devices} devices fits; use more devices"
  return (f"the train step ran out of device memory (estimated {human(estimate)} per device of "
          f"{human(hw.memory_bytes)} on {hw.name}); {fix}; see {explore_command(config_path, overrides)} "
          f"--devices {devices}")
