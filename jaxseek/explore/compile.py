"""Ahead-of-time compilation of the real train step for a mesh, on simulated CPU devices (`--compile`).

Lowers and compiles `step.compile_step` with abstract inputs (nothing is allocated), then reads XLA's memory
analysis and the collectives of the compiled module. Each collective's replica groups (or source → target
pairs) are mapped back to the mesh axes along which its devices differ: logical device i of the SPMD program
is the mesh position np.unravel_index(i, mesh shape).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxseek.config import MESH_AXES, Config
from jaxseek.errors import UserError
from jaxseek.explore.overlap import device_groups
from jaxseek.input.batches import BATCH_KEYS, batch_shardings

COLLECTIVE = re.compile(
    r"(?<![\w-])(ragged-all-to-all|all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


TEMP_KINDS = ("gradients", "activations", "moe_dispatch", "gathered_weights")


def compare(cfg: Config, model, sizes: dict[str, int], hw) -> dict[str, Any]:
  """XLA's figures for the compiled step beside the analytic ones for what it compiles (the CPU expert path):
  arguments = state + batch, temporaries = gradients + activations + MoE buffers + gathered weights."""
  from jaxseek.explore import core as explore

  built = explore.plan(model, sizes, hw, platform="cpu")
  got = compile_train_step(cfg, sizes)
  return {**got, **predicted(built, got["batch_bytes"])}


def predicted(built: dict[str, Any], batch_bytes: int) -> dict[str, Any]:
  """The explorer's figures for what XLA reports: arguments = state + batch, temporaries = gradients +
  activations + MoE buffers + gathered weights, and the collectives it implies."""
  mem = built["memory_per_device"]
  return {"predicted_argument_bytes": mem["parameters"] + mem["optimizer"] + mem["other"] + batch_bytes,
          "predicted_temp_bytes": sum(mem[k] for k in TEMP_KINDS),
          "predicted_collectives": expected_collectives(built["communication"])}


def expected_collectives(communication: dict[str, list[dict[str, Any]]]) -> dict[str, list[str]]:
  """{collective: [mesh axes]} the analytic model implies; XLA:CPU emits a reduce-scatter as an all-reduce."""
  out: dict[str, set[str]] = {}
  for axis, items in communication.items():
    for item in items:
      out.setdefault(item["collective"], set()).add(axis)
      if item["collective"] == "reduce-scatter":
        out.setdefault("all-reduce", set()).add(axis)
  return {kind: sorted(axes) for kind, axes in out.items()}


def compile_train_step(cfg: Config, sizes: dict[str, int]) -> dict[str, Any]:
  """Compiles the train step on the first prod(sizes) devices; returns XLA's memory figures and collectives."""
  from jaxseek import step as step_lib
  from jaxseek.model import transformer
  from jaxseek.sharding import mesh as mesh_lib

  n = int(np.prod(list(sizes.values())))
  if jax.device_count() < n:
    raise UserError(f"--compile needs {n} devices but JAX sees {jax.device_count()}; on a CPU machine pass "
                    f"mesh.num_cpu_devices={n} (simulated devices) or use a smaller mesh")
  mesh = mesh_lib.make_mesh(cfg, jax.devices()[:n])
  trainer = step_lib.make_trainer(cfg, mesh)
  step = step_lib.compile_step(trainer, cfg, mesh)
  shape = (cfg.train.batch_size, cfg.train.seq_len)
  batch = abstract_batch(cfg, mesh)
  with jax.set_mesh(mesh), transformer.scanned():  # the layer loop the estimate models, on CPU too
    compiled = step.lower(trainer.abstract_state, batch).compile()
  stats = compiled.memory_analysis()
  text = compiled.as_text()
  batch_bytes = sum(int(np.prod(s.sharding.shard_shape(shape))) * np.dtype(s.dtype).itemsize for s in batch.values())
  return {"argument_bytes": stats.argument_size_in_bytes, "output_bytes": stats.output_size_in_bytes,
          "alias_bytes": stats.alias_size_in_bytes, "temp_bytes": stats.temp_size_in_bytes,
          "batch_bytes": batch_bytes, "collectives": count_collectives(text, tuple(mesh.devices.shape)),
          "collective_total": dict(Counter(m.group(1) for m in COLLECTIVE.finditer(text)))}


def abstract_batch(cfg: Config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch as shapes with their shardings (nothing allocated)."""
  shape = (cfg.train.batch_size, cfg.train.seq_len)
  dtypes = {"loss_mask": jnp.float32}
  return {k: jax.ShapeDtypeStruct(shape, dtypes.get(k, jnp.int32), sharding=s)
          for k, s in batch_shardings(mesh, cfg).items() if k in BATCH_KEYS}


def count_collectives(text: str, mesh_shape: tuple[int, ...]) -> dict[str, dict[str, int]]:
  """{collective: {mesh axes it spans ("data+fsdp"; "-" for single-device groups): count}} of an HLO text."""
  out: dict[str, Counter] = {}
  for line in text.splitlines():
    match = COLLECTIVE.search(line)
    if not match:
      continue
    axes = collective_axes(line, mesh_shape)
    label = "+".join(axes) if axes else "-"
    if axes is None:
      label = "?"
    out.setdefault(match.group(1), Counter())[label] += 1
  return {kind: dict(counts) for kind, counts in out.items()}


def collective_axes(line: str, mesh_shape: tuple[int, ...]) -> tuple[str, ...] | None:
  """The mesh axes along which the devices of one collective's groups differ (None: groups not understood)."""
  groups = device_groups(line)
  if groups is None:
    return None
  varying = set()
  for group in groups:
    coords = np.array(np.unravel_index(np.asarray(group, dtype=np.int64), mesh_shape)).T
    varying.update(int(i) for i in np.nonzero((coords != coords[:1]).any(axis=0))[0])
  return tuple(MESH_AXES[i] for i in sorted(varying))


def collective_bytes(text: str, mesh_shape: tuple[int, ...]) -> dict[str, dict[str, float]]:
  """{collective: {mesh axes it spans: bytes per device per step}} of a compiled module: each collective's
  result (an async start's output element) times how often its computation runs (`overlap.weights`: loop
  bodies by their trip counts, so a reduction inside the microbatch loop counts once per microbatch)."""
  from jaxseek.explore import overlap

  module, entry = overlap.parse(text)
  runs = overlap.weights(module, entry)
  out: dict[str, dict[str, float]] = {}
  for name, instructions in module.items():
    for instruction in instructions:
      op = instruction["opcode"]
      kind = op if op in overlap.KINDS else overlap.collective_kind(module, instruction)
      if kind is None or runs.get(name, 0) == 0:
        continue
      type_ = instruction["type"]
      if op != kind:  # an async start: (operands, output, ...) or (operand, output): the output
        type_ = _tuple_elements(type_)[1] if type_.startswith("(") else type_
      attrs = instruction["attrs"]
      if op == "async-start":  # the groups are on the wrapped collective
        attrs = " ".join(i["attrs"] for key, callee in overlap.callees(instruction) for i in module.get(callee, []))
      axes = collective_axes(attrs, mesh_shape)
      label = "?" if axes is None else "+".join(axes) if axes else "-"
      out.setdefault(kind, {})
      out[kind][label] = out[kind].get(label, 0.0) + runs[name] * overlap.array_bytes(type_)
  return out


def _tuple_elements(type_: str) -> list[str]:
  """The top-level elements of an HLO tuple type "(a, (b, c), d)"."""
  depth, start, out = 0, 1, []
  for i, ch in enumerate(type_):
    depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(ch, 0)
    if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
      out.append(type_[start:i].strip())
      start = i + 1
  return out


def gradient_reduction_bytes(collectives: dict[str, dict[str, float]]) -> float:
  """All-reduce and reduce-scatter bytes per device per step over groups that span a batch axis (the gradient
  sums; tensor-parallel partial sums span `tensor` alone)."""
  batch = ("pipeline", "data", "fsdp", "expert", "context")
  return sum(b for kind in ("all-reduce", "reduce-scatter") for axes, b in collectives.get(kind, {}).items()
             if any(a in batch for a in axes.split("+")))


OP_NAME = re.compile(r'op_name="([^"]*)"')
GEMM_CALL = ("cublas", "triton", "mosaic", "blockScaledDot")  # custom calls that may be GEMMs


def matmul_flops(text: str) -> dict[str, float]:
  """Matmul FLOPs per step of a compiled module (dots and GEMM custom calls, loops weighted by their trip counts):
  `all`, and `recipe`: those of the GEMMs DeepSeek's FP8 recipe covers, the attention, MLP and expert projections
  (named by their einsum letters, `fp8_gemm.PROJECTIONS`, or inside the routed experts' scope): the head, the
  router and attention's scores are not. `*_f8`: the part whose operands are float8."""
  from jaxseek.explore import overlap
  from jaxseek.kernels import fp8_gemm

  module, entry = overlap.parse(text)
  if entry is None:
    return {}
  runs = overlap.weights(module, entry)
  timer = overlap._Timer(module, None)
  out = dict.fromkeys(("all", "all_f8", "recipe", "recipe_f8"), 0.0)
  for name, instructions in module.items():
    for instruction in instructions:
      op = instruction["opcode"]
      if not runs.get(name) or not (op == "dot" or op == "custom-call" and any(
          k in instruction["attrs"] for k in GEMM_CALL)):
        continue
      flops = runs[name] * timer.flops(name, instruction)
      f8 = timer.on_f8(name, instruction)
      found = OP_NAME.search(instruction["attrs"])
      recipe = fp8_gemm.in_recipe(found.group(1) if found else "")
      for key, counts in (("all", True), ("recipe", recipe)):
        if counts:
          out[key] += flops
          out[f"{key}_f8"] += flops * f8
  return out

