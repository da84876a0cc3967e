"""Bytes each device moves per step by collective kind and mesh axes, read from the compiled train step, every
loop body weighted by its trip count (a plain count sees a `while` body once).

  # 8 simulated CPU devices
  python benchmarks/collective_bytes.py --config configs/tiny-v3.yaml mesh.data=8 train.microbatches=4
  # deviceless, for 8 H200s (needs .venv-gpu: make test-gpu-compile)
  JAX_PLATFORMS=cpu .venv-gpu/bin/python benchmarks/collective_bytes.py --target h200 \
      --config configs/bench-v3-1b.yaml model.num_hidden_layers=4 train.seq_len=1024 train.batch_size=8 mesh.data=8

Prints one JSON object: {"collectives": {kind: {axes: bytes per device per step}}, "temp_bytes": ...,
"gradient_reduction_bytes": all-reduce and reduce-scatter bytes over the batch axes}. Bytes are the result
sizes of each op (an all-reduce's operand, an all-gather's gathered result, the received buffer of an
all-to-all), not wire bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ITEMSIZE = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
            "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
OP = re.compile(r"=\s*(.+?)\s+(" + "|".join(KINDS) + r")(-start)?\(")
COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
CALLEE = re.compile(r"(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
ARRAY = re.compile(r"\b(" + "|".join(ITEMSIZE) + r")\[([\d,]*)\]")
BATCH_AXES = ("pipeline", "data", "fsdp", "expert", "context")


def computations(hlo: str) -> dict[str, list[str]]:
  """Each computation's lines, by name (the entry named "ENTRY")."""
  out, name = {}, None
  for line in hlo.splitlines():
    match = COMPUTATION.match(line)
    if match and not line.startswith(" "):
      name = "ENTRY" if line.startswith("ENTRY") else match.group(1)
      out[name] = []
    elif name is not None:
      out[name].append(line)
  return out


def weights(comps: dict[str, list[str]]) -> dict[str, float]:
  """How many times each computation runs per call of the entry: while bodies × their known trip count, the
  branches of a conditional each counted once (an upper bound: one of them runs)."""
  calls: dict[str, list[tuple[str, float]]] = {name: [] for name in comps}
  for name, lines in comps.items():
    for line in lines:
      trip = TRIP.search(line)
      for role, callee in CALLEE.findall(line):
        calls[name].append((callee, float(trip.group(1)) if role == "body" and trip else 1.0))
      for group in BRANCHES.findall(line):
        calls[name] += [(c.strip().lstrip("%"), 1.0) for c in group.split(",") if c.strip()]
  out: dict[str, float] = {}

  def visit(name, weight):
    out[name] = out.get(name, 0.0) + weight
    for callee, times in calls.get(name, ()):
      if callee in comps:
        visit(callee, weight * times)

  visit("ENTRY", 1.0)
  return out


def array_bytes(text: str) -> int:
  total = 0
  for dtype, dims in ARRAY.findall(text):
    n = 1
    for d in dims.split(","):
      n *= int(d) if d else 1
    total += n * ITEMSIZE[dtype]
  return total


def collective_bytes(hlo: str, mesh_shape: tuple[int, ...]) -> dict[str, dict[str, float]]:
  """{kind: {"axis+axis": bytes per device per step}}, each op's result size times its computation's weight."""
  from jaxseek.explore import compile as explore_compile

  comps = computations(hlo)
  weight = weights(comps)
  out: dict[str, dict[str, float]] = {}
  for name, lines in comps.items():
    for line in lines:
      match = OP.search(line)
      if not match:
        continue
      result = match.group(1)
      if match.group(3):  # an async start's result is (operands, outputs[, scratch]): count the outputs
        parts = re.findall(r"\b(?:" + "|".join(ITEMSIZE) + r")\[[\d,]*\]", result)
        result = " ".join(parts[len(parts) // 2:]) if match.group(2) != "collective-permute" else parts[-1] if parts else ""
      axes = explore_compile.collective_axes(line, mesh_shape)
      label = "+".join(axes) if axes else ("-" if axes is not None else "?")
      kind = out.setdefault(match.group(2), {})
      kind[label] = kind.get(label, 0.0) + weight.get(name, 0.0) * array_bytes(result)
  return out


def gradient_reduction_bytes(coll: dict[str, dict[str, float]]) -> float:
  """All-reduce and reduce-scatter bytes over groups that span a batch axis (the gradient sums)."""
  return sum(b for kind in ("all-reduce", "reduce-scatter") for axes, b in coll.get(kind, {}).items()
             if any(a in BATCH_AXES for a in axes.split("+")))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", required=True)
  ap.add_argument("--target", default=None, help="h200 | h100: deviceless GPU compile (JAX_PLATFORMS=cpu)")
  ap.add_argument("overrides", nargs="*")
  args = ap.parse_args()
  from jaxseek import config as config_lib

  cfg = config_lib.load(args.config, args.overrides)
  sizes = cfg.mesh.sizes()
  n = 1
  for v in sizes.values():
    n *= v
  if args.target:
    from jaxseek.explore import gpu as explore_gpu

    got = explore_gpu.compile_for_target(cfg, sizes, args.target, per_host=min(n, 8))
    hlo, temp, shape = got["hlo"], got["temp_bytes"], tuple(sizes.values())
  else:
    import jax

    jax.config.update("jax_num_cpu_devices", n)
    from jaxseek import step as step_lib
    from jaxseek.explore import compile as explore_compile
    from jaxseek.sharding import mesh as mesh_lib

    mesh = mesh_lib.make_mesh(cfg)
    trainer = step_lib.make_trainer(cfg, mesh)
    with jax.set_mesh(mesh):
      compiled = step_lib.compile_step(trainer, cfg, mesh).lower(
          trainer.abstract_state, explore_compile.abstract_batch(cfg, mesh)).compile()
    hlo, temp, shape = compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes, tuple(mesh.devices.shape)
  coll = collective_bytes(hlo, shape)
  print(json.dumps({"config": args.config, "overrides": args.overrides, "target": args.target or "cpu",
                    "temp_bytes": temp, "gradient_reduction_bytes": gradient_reduction_bytes(coll),
                    "collectives": coll}, indent=1))


if __name__ == "__main__":
  main()
