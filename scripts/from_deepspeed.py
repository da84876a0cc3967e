"""Translate a DeepSpeed config into a jaxseek config (docs/from-deepspeed.md).

  python scripts/from_deepspeed.py ds_config.json --model deepseek-llm-67b --nodes 4 --gpus-per-node 8 > run.yaml
  python scripts/from_deepspeed.py ds_config.json --model tiny-dense model.num_hidden_layers=8 --platform cpu \
      --gpus-per-node 8 > tiny.yaml
  python -m jaxseek.train --config run.yaml

The YAML goes to stdout, each translated line commented with the DeepSpeed key it came from, and the keys with
no jaxseek equivalent listed at its end with what to do instead. The result passes the same validation as
`python -m jaxseek.train` for the cluster given; the explorer's memory per device for it goes to stderr.
Exit status 2 (one line on stderr) for contradictory or invalid values.
"""

from __future__ import annotations

import argparse
import sys

from jaxseek import deepspeed
from jaxseek.errors import UserError, cli


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("ds_config", help="the DeepSpeed JSON config (a Python dict literal is read too)")
  p.add_argument("overrides", nargs="*", help="section.key=value applied last, e.g. model.num_hidden_layers=8")
  p.add_argument("--model", help="the model: a jaxseek config name (deepseek-llm-67b) or YAML file, or a Hugging "
                 "Face folder or config.json; its other settings (data, seq_len, run_dir) are kept")
  p.add_argument("--nodes", type=int, default=1, help="nodes (deepspeed --num_nodes; default 1)")
  p.add_argument("--gpus-per-node", type=int, help="GPUs per node (deepspeed --num_gpus / nodes); required")
  p.add_argument("--platform", choices=("gpu", "cpu"), default="gpu", help="cpu: a run on simulated CPU devices "
                 "(mesh.num_cpu_devices = --gpus-per-node; no host offload)")
  p.add_argument("--device-memory", default="h100-80g", help="the explorer's device for the memory summary "
                 "(h100-80g, h800-80g, a100-40g, ... or a size such as 80GB)")
  return p.parse_intermixed_args(argv)


@cli
def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if not args.gpus_per_node or args.gpus_per_node < 1 or args.nodes < 1:
    raise UserError("--gpus-per-node N (and --nodes M if more than one) are needed: DeepSpeed takes the world "
                    "size from its launcher, so the file alone does not say it")
  cluster = deepspeed.Cluster(args.nodes, args.gpus_per_node, args.platform)
  ds = deepspeed.read(args.ds_config)
  translation = deepspeed.translate(ds, cluster)
  base, origin = deepspeed.base_config(args.model)
  merged = deepspeed.merge(base, translation)
  deepspeed.override(merged, translation, args.overrides)
  try:
    cfg = deepspeed.check(merged, cluster)
  except UserError as e:
    raise UserError(f"the translated config is refused: {e}") from None
  header = [f"jaxseek config from {args.ds_config} for {args.nodes} node(s) × {args.gpus_per_node} "
            f"{args.platform.upper()} devices (scripts/from_deepspeed.py).",
            f"Settings without a comment come from {origin}."]
  sys.stdout.write(deepspeed.render(merged, translation, header))
  sys.stdout.flush()
  for key, advice in translation.unmapped:
    print(f"not translated: {key}: {advice}", file=sys.stderr)
  _memory_summary(cfg, cluster, args.device_memory)
  return 0


def _memory_summary(cfg, cluster: deepspeed.Cluster, device_memory: str) -> None:
  """The explorer's memory table for the translated config on the cluster (stderr)."""
  from rich.console import Console

  from jaxseek.explore import core as explore
  from jaxseek.explore import report

  hw = explore.hardware(device_memory, devices_per_node=cluster.gpus_per_node)
  result = explore.plan(explore.describe(cfg), explore.mesh_sizes(cfg, cluster.devices), hw)
  console = Console(stderr=True, width=120)
  report.print_memory(result, console)
  if not result["memory"]["fits"]:
    console.print(f"layouts that fit: python -m jaxseek.explore --config run.yaml --devices {cluster.devices} "
                  f"--device-memory {device_memory} --suggest --pipeline")


if __name__ == "__main__":
  sys.exit(main())
