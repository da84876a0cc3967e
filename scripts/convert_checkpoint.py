"""Convert between Hugging Face model folders and jaxseek checkpoints (docs/convert.md).

  python scripts/convert_checkpoint.py to-jaxseek --hf DIR --out DIR
  python scripts/convert_checkpoint.py to-hf --checkpoint DIR --out DIR [--dtype float32|bfloat16]
                                              [--max-shard-size 5GB]
  python scripts/convert_checkpoint.py inspect PATH
"""

from __future__ import annotations

import argparse
import re
import sys

from jaxseek.errors import UserError, cli

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_size(text: str) -> int:
  """'5GB', '200MB', '1000' → bytes."""
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
  if not match or float(match.group(1)) <= 0:
    raise UserError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB or 200MB")
  return int(float(match.group(1)) * _UNITS[match.group(2)])


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  to_jax = sub.add_parser("to-jaxseek", help="Hugging Face folder → jaxseek checkpoint (config.yaml + Orbax)")
  to_jax.add_argument("--hf", required=True, help="folder with config.json and safetensors")
  to_jax.add_argument("--out", required=True, help="new folder for config.yaml and checkpoints/0")
  to_hf = sub.add_parser("to-hf", help="jaxseek checkpoint (latest step) → Hugging Face folder")
  to_hf.add_argument("--checkpoint", required=True, help="folder with config.yaml and checkpoints/")
  to_hf.add_argument("--out", required=True, help="new folder for config.json and safetensors")
  to_hf.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  to_hf.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
  show = sub.add_parser("inspect", help="list the tensors and the variant of a folder or checkpoint")
  show.add_argument("path")
  return p


@cli
def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  import jax

  jax.config.update("jax_platforms", "cpu")  # conversion runs on the host, whatever accelerators exist
  from jaxseek.convert import pretrained

  if args.command == "to-jaxseek":
    cfg = pretrained.hf_to_checkpoint(args.hf, args.out)
    print(f"wrote {args.out}: {pretrained.describe(cfg)}")
  elif args.command == "to-hf":
    files = pretrained.export_hf(args.checkpoint, args.out, dtype=args.dtype,
                                 max_shard_bytes=parse_size(args.max_shard_size))
    print(f"wrote {args.out}: {', '.join(files)}")
  else:
    print("\n".join(pretrained.inspect(args.path)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
