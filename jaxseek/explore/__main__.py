"""The sharding layout explorer: memory, layout and communication of a config on a mesh, without the hardware.

python -m jaxseek.explore --config FILE [section.key=value ...] [--devices N] [--device-memory h100-80g]
                          [--compile [--target h200|h100|a100|b200]] [--suggest] [--json PATH] [--plot PATH.png]

--compile alone compiles the real train step on simulated CPU devices; with --target it compiles for that many
GPUs (--devices-per-node to a host) without a GPU, through the CUDA build of JAX (pip install -e '.[gpu]').
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from jaxseek import config as config_lib
from jaxseek.errors import UserError, cli, writable_file
from jaxseek.explore import core as explore
from jaxseek.explore import report
from jaxseek.explore import suggest as explore_suggest
from jaxseek.explore.gpu import TARGET_MEMORY, TARGETS

COMPILE_MAX_DEVICES = 64  # simulated CPU devices: compile time and host memory grow with their number


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m jaxseek.explore", description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True, help="YAML config (see configs/)")
  parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. mesh.fsdp=8 train.microbatches=4")
  parser.add_argument("--devices", type=int, help="device count (fills a -1 mesh axis; required by --suggest "
                      "unless the mesh is fixed)")
  parser.add_argument("--device-memory", help=f"a device ({', '.join(explore.GPUS)}) or a size such as 80GiB; "
                      f"default: the local accelerator, else {explore.DEFAULT_GPU}")
  parser.add_argument("--peak-tflops", type=float, help="dense peak per device (default: from the device)")
  parser.add_argument("--intra-node-gbps", type=float, help="link inside a node, gigabits/s per direction "
                      "(default 3600: NVLink 4)")
  parser.add_argument("--inter-node-gbps", type=float, help="link between nodes, gigabits/s per device "
                      "(default 400: InfiniBand NDR)")
  parser.add_argument("--devices-per-node", type=int, default=8)
  parser.add_argument("--usable-fraction", type=float, default=0.9, help="share of device memory a run may fill")
  parser.add_argument("--compile", action="store_true", help="also compile the real train step on simulated CPU "
                      "devices and show XLA's memory and collectives beside the estimate")
  parser.add_argument("--target", choices=sorted(TARGETS), help="--compile for this GPU (deviceless: no GPU "
                      "needed, the CUDA build of JAX is) instead of simulated CPU devices")
  parser.add_argument("--suggest", action="store_true", help="rank the meshes of --devices that fit")
  parser.add_argument("--pipeline", action="store_true", help="--suggest: include pipeline-parallel meshes (those "
                      "whose stage count divides a layer stack)")
  parser.add_argument("--top", type=int, default=10, help="--suggest: how many layouts to show")
  parser.add_argument("--json", help="write the result as JSON (schema in docs/explore.md)")
  parser.add_argument("--hlo", help="--compile --target: write the compiled step's optimised, scheduled HLO here")
  parser.add_argument("--pgle-profile", help="--compile --target: write the compiled step's op costs at the "
                      "target's rates here (train.pgle_profile) and compile again with them; reports the second")
  parser.add_argument("--plot", help="write a PNG of the memory per device and the parameter layouts")
  return parser.parse_args(argv)


def _devices(cfg: config_lib.Config, args: argparse.Namespace) -> int:
  if args.devices:
    return args.devices
  sizes = cfg.mesh.sizes()
  if -1 in sizes.values():
    raise UserError("--suggest needs --devices N (how many devices to lay the model out on)")
  return math.prod(sizes.values())


def _simulate(n: int) -> None:
  """--compile runs on simulated CPU devices; they must be requested before JAX starts."""
  import jax

  if n > COMPILE_MAX_DEVICES:
    raise UserError(f"--compile simulates at most {COMPILE_MAX_DEVICES} CPU devices and this mesh has {n}; drop "
                    f"--compile (the analytic answer covers any size) or compile a smaller mesh")

  from jaxseek.sharding.mesh import simulate_cpu_devices

  jax.config.update("jax_platforms", "cpu")
  simulate_cpu_devices(n)


def run(cfg: config_lib.Config, args: argparse.Namespace) -> dict[str, Any]:
  """The explorer's answer for the parsed command line, printed on the console; returns the JSON document."""
  if args.target and not args.compile:
    raise UserError("--target names the GPU to --compile for; add --compile")
  if args.compile and not args.target:
    _simulate(_devices(cfg, args) if args.suggest else math.prod(explore.mesh_sizes(cfg, args.devices).values()))
  elif args.target:
    import jax

    jax.config.update("jax_platforms", "cpu")  # never a CUDA client: the GPU devices are compile-only
    args.device_memory = args.device_memory or TARGET_MEMORY[args.target]
  model = explore.describe(cfg)
  hw = explore.hardware(args.device_memory, peak_tflops=args.peak_tflops, intra_node_gbps=args.intra_node_gbps,
                        inter_node_gbps=args.inter_node_gbps, devices_per_node=args.devices_per_node,
                        usable_fraction=args.usable_fraction)
  suggestions = None
  if args.suggest:
    suggestions = explore_suggest.suggest(model, _devices(cfg, args), hw, args.top, args.pipeline)
    report.print_suggestions(suggestions)
    if not suggestions:
      return {"schema": explore.SCHEMA, "total_parameters": model.total_parameters, "suggestions": []}
    cfg = config_lib.load(args.config, list(args.overrides) + suggestions[0]["overrides"])
    model = explore.describe(cfg)
  sizes = explore.mesh_sizes(cfg, args.devices)
  config_lib.check_mesh_fit(cfg, sizes)
  result = explore.plan(model, sizes, hw)
  if args.compile and args.target:
    from jaxseek.explore import compile as explore_compile
    from jaxseek.explore import gpu as explore_gpu
    from jaxseek.explore import overlap as explore_overlap

    first = cfg  # with --pgle-profile the first program plans with XLA's own costs, the second with the file's
    if args.pgle_profile:
      first = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, op_costs="xla"))
    compiled = explore_gpu.compile_for_target(first, sizes, args.target, args.devices_per_node, hw)
    if args.pgle_profile:  # the scheduler plans again with the first program's kernels and transfers timed
      rates = explore_gpu.target_rates(args.target, args.devices_per_node, hw)
      Path(args.pgle_profile).write_text(explore_overlap.analytic_profile(compiled["hlo"], rates))
      cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, pgle_profile=args.pgle_profile))
      compiled = explore_gpu.compile_for_target(cfg, sizes, args.target, args.devices_per_node, hw)
    hlo = compiled.pop("hlo")
    if args.hlo:
      Path(args.hlo).write_text(hlo)
    compiled["overlap"] = explore_overlap.beside_estimate(compiled["overlap"], result["communication"],
                                                          result["step_time_s"])
    result["prediction"] = _compiled_prediction(model, sizes, hw, result, hlo, args.devices_per_node)
    result["compiled"] = {**compiled, **explore_compile.predicted(result, compiled["batch_bytes"])}
  elif args.compile:
    from jaxseek.explore import compile as explore_compile

    result["compiled"] = explore_compile.compare(cfg, model, sizes, hw)
  if suggestions is not None:
    result["suggestions"] = suggestions
  if not args.suggest or args.compile:
    report.print_plan(result)
  return result


def _compiled_prediction(model, sizes, hw, result: dict[str, Any], hlo: str, per_node: int) -> dict[str, Any]:
  """The prediction with the compiled program's own overlap, its kernels and transfers timed at achieved rates
  (independent of the op costs the scheduler was given); the step-structure prediction kept beside it."""
  from jaxseek.explore import overlap as explore_overlap
  from jaxseek.explore import predict

  scored = explore_overlap.overlap(hlo, predict.achieved_rates(hw, per_node))
  shares = {kind: (r["always_hidden_bytes"] / r["always_bytes"] if r.get("always_bytes") else
                   r["hidden_bytes"] / r["bytes"] if r.get("bytes") else 0.0) for kind, r in scored.items()}
  p = predict.predict(model, sizes, hw, result, hidden_shares=shares)
  return {**p, "hidden_shares_at_achieved_rates": shares, "structure_step_s": result["prediction"]["step_s"]}


@cli
def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if args.plot:
    report.require_matplotlib()
  for flag, count in (("--devices", args.devices), ("--devices-per-node", args.devices_per_node),
                      ("--top", args.top)):
    if count is not None and count < 1:
      raise UserError(f"{flag} {count} must be ≥ 1")
  for flag, rate in (("--peak-tflops", args.peak_tflops), ("--intra-node-gbps", args.intra_node_gbps),
                     ("--inter-node-gbps", args.inter_node_gbps)):
    if rate is not None and not 0 < rate < math.inf:
      raise UserError(f"{flag} {rate:g} must be a positive number")
  if not 0 < args.usable_fraction <= 1:
    raise UserError(f"--usable-fraction {args.usable_fraction:g} must be in (0, 1], e.g. 0.9")
  for flag, path in (("--hlo", args.hlo), ("--pgle-profile", args.pgle_profile)):
    if path and not (args.compile and args.target):
      raise UserError(f"{flag} writes what --compile --target compiles: add them, e.g. --compile --target h100")
  for flag, path in (("--json", args.json), ("--plot", args.plot), ("--hlo", args.hlo),
                     ("--pgle-profile", args.pgle_profile)):
    if path:
      writable_file(path, flag)
  cfg = config_lib.load(args.config, args.overrides)
  result = run(cfg, args)
  if args.json:
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
  if args.plot and "memory_per_device" in result:
    report.plot(result, args.plot)
  return 0


if __name__ == "__main__":
  sys.exit(main())
