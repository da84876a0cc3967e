"""Held-out loss: the summary and evaluator that training uses (eval.every), and the command line.

python -m jaxseek.evaluate --checkpoint PATH --data FOLDER [--tokens N] [--json FILE] [section.key=value ...]

PATH: a run directory, one of its steps (RUN/checkpoints/40), a converted jaxseek checkpoint or a Hugging Face
folder. The batches are the ones training evaluates on (eval.source = FOLDER): the first ⌈N / (B·T)⌉ packed
batches of train.batch_size × train.seq_len (the run's, or the overrides'), so the loss equals the run's eval_loss.
With eval.holdout=F among the overrides, the held-out share F of FOLDER: the set a run with data.source=FOLDER,
eval.source=holdout, eval.holdout=F evaluated on. The model runs as the run trained (train.fp8 included).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx

from jaxseek import config as config_lib
from jaxseek import faults
from jaxseek import input as input_lib
from jaxseek import step as step_lib
from jaxseek.errors import UserError, cli, writable_file
from jaxseek.kernels import choice as kernels
from jaxseek.kernels import fp8_gemm
from jaxseek.sharding import mesh as mesh_lib
from jaxseek.sharding import rules


def summarize(sums: list[dict[str, jax.Array]]) -> dict[str, float]:
  """eval_loss = Σ CE / Σ tokens over all batches (each token weighs the same), eval_perplexity = exp(eval_loss),
  eval_mtp_loss = the mean over depths of each depth's Σ CE / Σ tokens; per depth k, eval_mtp_accuracy = the
  share of tokens whose top-1 MTP prediction is the text's t_{i+k+1}, and eval_mtp_acceptance = the share whose
  top-1 MTP prediction is the main model's own top-1 prediction of t_{i+k+1} (at position i+k, teacher forced):
  what greedy speculative decoding with that depth as the draft accepts; eval_tokens = Σ tokens."""
  host = jax.device_get(sums)
  total = lambda key: np.sum([np.asarray(s[key], np.float64) for s in host], axis=0)
  tokens = float(total("tokens"))
  loss = float(total("ce_sum")) / tokens if tokens else float("nan")  # eval_batches refuses a set without any
  with np.errstate(over="ignore"):
    perplexity = float(np.exp(np.float64(loss)))
  out = {"eval_loss": loss, "eval_perplexity": perplexity, "eval_tokens": tokens}
  if "mtp_sums" in host[0]:
    out["eval_mtp_loss"] = float(np.mean(total("mtp_sums") / np.maximum(total("mtp_tokens"), 1.0)))
    out["eval_mtp_accuracy"] = (total("mtp_correct") / np.maximum(total("mtp_tokens"), 1.0)).tolist()
    out["eval_mtp_acceptance"] = (total("mtp_agree") / np.maximum(total("mtp_tokens"), 1.0)).tolist()
  return out


IN_FLIGHT = 2  # evaluation batches dispatched ahead of the one being waited for


def bounded(step: Callable, batches: list, *args) -> list:
  """[step(*args, batch) for batch in batches], with at most IN_FLIGHT of them running ahead of the host: enough
  to keep a device busy, and the XLA CPU runtime deadlocks in its collectives with many programs queued."""
  out = []
  for i, batch in enumerate(batches):
    out.append(step(*args, batch))
    if i >= IN_FLIGHT:
      jax.block_until_ready(out[i - IN_FLIGHT])
  return out


class Evaluator:
  """Training's evaluation: the fixed batches (made once) and the eval step (compiled once, on first use)."""

  def __init__(self, cfg: config_lib.Config, mesh: jax.sharding.Mesh, trainer: step_lib.Trainer):
    self.batches = input_lib.batches.eval_batches(cfg, mesh)
    self.step = faults.Aligned(step_lib.compile_eval(trainer, cfg, mesh), "eval step", cfg.dist.init_timeout_s,
                               kernels.compiler_options(cfg))

  def __call__(self, state: step_lib.TrainState) -> dict[str, float]:
    """The eval metrics of `state` (waits for them); eval_time_s is the time it took."""
    start = time.perf_counter()
    out = summarize(bounded(self.step, self.batches, state.params, state.biases))
    return {**out, "eval_time_s": time.perf_counter() - start}


# ---------------------------------------------------------------------------------------------- command line


def base_config(path: Path) -> config_lib.Config:
  """The config a checkpoint was trained with (config.yaml), or the model of a Hugging Face folder."""
  from jaxseek.convert import hf
  from jaxseek.convert.pretrained import hf_model_config, step_folder

  if not path.exists():
    raise UserError(f"--checkpoint {path} does not exist; pass a run directory, a checkpoint step, a converted "
                    f"checkpoint or a Hugging Face folder")
  if (path / "config.json").is_file():  # jaxseek's defaults, sequences no longer than the model's positions
    model = hf_model_config(hf.Folder(path))
    train = config_lib.TrainConfig()
    return config_lib.Config(model=model, train=dataclasses.replace(
        train, seq_len=min(train.seq_len, model.max_position_embeddings)))
  folder = path if (path / "config.yaml").is_file() else path.parent.parent if step_folder(path) else None
  if folder is not None:  # its kernels and exchanges as they run here (another platform's go back to auto)
    cfg = config_lib.load(folder / "config.yaml")
    return dataclasses.replace(cfg, model=config_lib.portable(cfg.model))
  raise UserError(f"--checkpoint {path} has no config.json (Hugging Face folder) or config.yaml (jaxseek "
                  f"checkpoint) and is no checkpoint step (RUN/checkpoints/<step>); pass the folder that holds one")


def eval_run_config(base: config_lib.Config, data: str, tokens: int | None, overrides: list[str]) -> config_lib.Config:
  """`base` with the overrides, evaluating on `data` (eval.source) for `tokens` (default eval.tokens). With an
  eval.holdout override, on the held-out share of `data` (data.source=`data`, eval.source=holdout), the set a
  run with that share evaluated on."""
  raw = config_lib.to_dict(base)
  holdout = 0.0
  for item in overrides:
    section, field, value = config_lib.parse_override(item, "mesh.tensor=2")
    if section == "model" and field not in config_lib.EXECUTION_KEYS:
      raise UserError(f"override {item!r}: the model comes from the checkpoint; override other sections, or the "
                      f"model's kernels and exchanges ({', '.join(config_lib.EXECUTION_KEYS)})")
    if section not in raw:
      raise UserError(f"unknown config section {section!r}; valid sections: {', '.join(raw)}")
    if (section, field) == ("eval", "source"):
      raise UserError(f"override {item!r}: evaluate reads the folder given with --data; pass it there")
    if (section, field) in (("data", "source"), ("data", "weights")):
      raise UserError(f"override {item!r}: evaluate reads the folder given with --data (with eval.holdout=F, "
                      f"its held-out share F); pass it there")
    if (section, field) == ("eval", "holdout"):
      holdout = value
      continue
    raw[section][field] = value
  if holdout:
    raw["data"].update(source=data, weights=[])
    raw["eval"].update(source="holdout", holdout=holdout)
  else:
    raw["eval"].update(source=data, holdout=0.0)
  if tokens is not None:
    raw["eval"]["tokens"] = tokens
  cfg = config_lib.from_dict(raw)
  config_lib.validate(cfg)
  if cfg.mesh.pipeline != 1:
    raise UserError(f"config key mesh.pipeline: {cfg.mesh.pipeline}; evaluation runs without a pipeline, set "
                    f"mesh.pipeline=1")
  return cfg


def evaluate(path: str | Path, cfg: config_lib.Config) -> dict[str, float]:
  """The loss of the checkpoint at `path` on cfg.eval.source's evaluation batches, on cfg's mesh."""
  from jaxseek.convert.pretrained import load_pretrained

  mesh = mesh_lib.make_mesh(cfg)
  batches = input_lib.batches.eval_batches(cfg, mesh)  # data errors (vocabulary, folder) before the weights load
  with jax.set_mesh(mesh):
    model = load_pretrained(path, param_dtype=cfg.train.param_dtype, dtype=cfg.train.compute_dtype,
                            fp8=fp8_gemm.resolve(cfg.train.fp8, *kernels.device_target(mesh.devices.flat[0])),
                            execution={k: getattr(cfg.model, k) for k in config_lib.EXECUTION_KEYS})
    graphdef, weights = nnx.split(model)

    def forward(weights, batch):
      with rules.layout(cfg):
        return step_lib.eval_sums_accumulated(lambda: nnx.merge(graphdef, weights), cfg, batch)

    compiled = jax.jit(forward).lower(weights, batches[0]).compile()
    start = time.perf_counter()
    out = summarize(bounded(compiled, batches, weights))
  seconds = time.perf_counter() - start
  return {**out, "tokens_per_sec": len(batches) * cfg.train.batch_size * cfg.train.seq_len / seconds,
          "seconds": seconds}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m jaxseek.evaluate", description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True, help="run directory, RUN/checkpoints/STEP, converted "
                      "checkpoint or Hugging Face folder")
  parser.add_argument("--data", required=True, help="a folder written by scripts/prepare_data.py")
  parser.add_argument("--tokens", type=int, help="token positions to evaluate (default: eval.tokens)")
  parser.add_argument("--json", help="also write the results to this JSON file")
  parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. mesh.tensor=2 train.batch_size=8")
  return parser.parse_args(argv)


@cli
def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  path = Path(args.checkpoint)
  if args.tokens is not None and args.tokens < 1:
    raise UserError(f"--tokens {args.tokens} must be ≥ 1")
  if args.json:
    writable_file(args.json, "--json")
  input_lib.shards.read_manifest(Path(args.data), "--data")  # a prepared folder, before any device starts
  cfg = eval_run_config(base_config(path), args.data, args.tokens, args.overrides)
  mesh_lib.simulate_cpu_devices(cfg.mesh.num_cpu_devices)
  out = evaluate(path, cfg)
  if jax.process_index() == 0:
    shares = lambda key: ", ".join(f"{a:.1%}" for a in out[key])
    mtp = (f" | mtp loss {out['eval_mtp_loss']:.4f} | mtp top-1 {shares('eval_mtp_accuracy')} | mtp acceptance "
           f"{shares('eval_mtp_acceptance')}") if "eval_mtp_loss" in out else ""
    print(f"eval {path} on {args.data}: loss {out['eval_loss']:.4f} | perplexity {out['eval_perplexity']:.3f}{mtp}"
          f" | {out['eval_tokens']:,.0f} tokens | {out['tokens_per_sec']:,.0f} tokens/s", flush=True)
    if args.json:
      Path(args.json).write_text(json.dumps({"checkpoint": str(path), "data": args.data, **out}, indent=2) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
