"""Training throughput of jaxseek against the Hugging Face `transformers` PyTorch model, same model and batch,
their steps alternating in one process.

  python benchmarks/bench_vs_hf.py [--steps 12] [--batch 8] [--seq 256] [--set KEY=VALUE ...]
                                   [--jax section.key=value ...] [--bf16] [--check [FILE]]

One random DeepseekV3ForCausalLM (benchmarks/common.py SMALL_V3 with a 4,096-word vocabulary: 4 layers, MLA with
q compression, 16 routed experts top-4 with a shared one, sigmoid router with noaux_tc over groups, one dense layer
then MoE layers; --set changes it) is built with `transformers`, saved, and converted to jaxseek, so both start
from the same weights and route the same tokens to the same experts. Each trains on the same random token batch,
float32 (--bf16: jaxseek's train.compute_dtype=bfloat16 and torch's CPU autocast to bfloat16), on this machine's
CPU with every core (torch with as many threads; jaxseek on one device unless --jax gives a mesh, e.g.
`--jax mesh.num_cpu_devices=8 mesh.data=8`):

  transformers  model(input_ids).logits, cross entropy, backward, torch.optim.AdamW step
  jaxseek       jaxseek.train.train_step: forward, backward, AdamW (optax), jitted, state donated

Both use AdamW(lr 1e-4, betas 0.9/0.95, eps 1e-8, no weight decay, no clipping). After two warm-up steps each
(JAX compiles in the first), the two take turns, one step each, the first of a pair alternating, so load from other
work on the machine slows both. Printed: each one's median step, tokens/s and MFU (model FLOPs per token,
jaxseek.metrics.flops_per_token, over this machine's measured float32 matmul rate), and the ratio of
throughputs, jaxseek / transformers, as the median over pairs. The losses of the first and last steps must agree,
since the weights and data do. Appends one JSON line to benchmarks/results.jsonl.

--check compares the ratio with the one kept in benchmarks/baselines.json for the same settings (the last
measured on the reference machine, docs/cpu.md) and exits with status 1 when it fell below 0.8 of it: a
step 1.25 times slower relative to transformers fails, where run-to-run noise of the paired ratio is about 5%.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT_SETS = ("vocab_size=4096",)
BASELINES = Path(__file__).with_name("baselines.json")
CHECK_FRACTION = 0.8


def _jax_overrides(items: list[str]) -> list[str]:
  """Before JAX starts, what `python -m jaxseek.train` sets there (sharding/mesh.py simulate_cpu_devices): the
  simulated device count of a --jax mesh.num_cpu_devices=N, single-device programs on the calling thread."""
  from jaxseek.sharding import mesh as mesh_lib

  counts = [int(item.split("=", 1)[1]) for item in items if item.startswith("mesh.num_cpu_devices=")]
  mesh_lib.simulate_cpu_devices(counts[-1] if counts else None)
  return items


def hf_stepper(hf_model, tokens: np.ndarray, bf16: bool):
  """One transformers training step per call: (seconds, loss)."""
  import torch

  hf_model.train()
  opt = torch.optim.AdamW(hf_model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
  ids, targets = torch.from_numpy(tokens[:, :-1].astype(np.int64)), torch.from_numpy(tokens[:, 1:].astype(np.int64))
  autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

  def step() -> tuple[float, float]:
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with autocast():
      logits = hf_model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    opt.step()
    value = float(loss.detach())
    return time.perf_counter() - start, value

  return step


def jax_stepper(timer):
  def step() -> tuple[float, float]:
    start = time.perf_counter()
    loss = timer.step()
    return time.perf_counter() - start, loss

  return step


def alternate(steppers: dict, steps: int, warmup: int = 2) -> dict[str, dict]:
  """Warm-up steps of each, then `steps` pairs taking turns (the first of a pair alternating)."""
  runs = {name: dict(times=[], losses=[]) for name in steppers}
  for name, step in steppers.items():
    for _ in range(warmup):
      runs[name]["losses"].append(step()[1])
  names = list(steppers)
  for i in range(steps):
    for name in (names if i % 2 == 0 else names[::-1]):
      seconds, loss = steppers[name]()
      runs[name]["times"].append(seconds)
      runs[name]["losses"].append(loss)
  return runs


def settings_key(args) -> str:
  return " ".join([f"batch={args.batch}", f"seq={args.seq}", *args.set, *args.jax, *(["bf16"] if args.bf16 else [])])


def check(ratio: float, key: str, path: Path) -> int:
  kept = json.loads(path.read_text()) if path.exists() else {}
  if key not in kept:
    print(f"no kept ratio for '{key}' in {path}: nothing to compare")
    return 1
  floor = CHECK_FRACTION * kept[key]["ratio"]
  verdict = "ok" if ratio >= floor else "FAIL"
  print(f"{verdict}: ratio {ratio:.3f} against the kept {kept[key]['ratio']:.3f} ({kept[key]['date']}): floor {floor:.3f}")
  return 0 if ratio >= floor else 1


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=12, help="timed pairs of steps after the warm-up steps")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                      help="change the model, e.g. first_k_dense_replace=4 (all dense) n_routed_experts=64")
  parser.add_argument("--jax", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                      help="jaxseek config overrides, e.g. mesh.num_cpu_devices=8 mesh.data=8")
  parser.add_argument("--bf16", action="store_true", help="bfloat16 compute on both sides")
  parser.add_argument("--check", nargs="?", const=str(BASELINES), default=None, metavar="FILE",
                      help="exit 1 when the ratio fell below 0.8 of the kept one")
  parser.add_argument("--results", default=None)
  args = parser.parse_args()
  _jax_overrides(args.jax)

  import common
  from jaxseek import checkpoint as checkpoint_lib
  from jaxseek.convert import pretrained

  model = common.parse_sets([*DEFAULT_SETS, *args.set], common.SMALL_V3)
  hf_model = common.transformers_twin(model)
  tokens = np.random.default_rng(0).integers(0, model["vocab_size"], (args.batch, args.seq + 1), dtype=np.int32)
  with tempfile.TemporaryDirectory() as tmp:
    hf_model.save_pretrained(f"{tmp}/hf")
    model_cfg = pretrained.hf_to_checkpoint(f"{tmp}/hf", f"{tmp}/ck")
    cfg = common.make_config(common.config_lib.to_dict(common.config_lib.Config(model=model_cfg))["model"],
                             args.batch, args.seq, **({"compute_dtype": "bfloat16"} if args.bf16 else {}))
    cfg = common.with_overrides(cfg, args.jax)

    def converted(trainer):
      source = checkpoint_lib.Checkpointer(cfg, Path(tmp) / "ck/checkpoints", read_only=True)
      params = source.restore(0, trainer.abstract_state, trainer.state_shardings, None, params_only=True)
      source.close()
      return trainer.init().replace(**params)

    timer = common.StepTimer(cfg, converted, tokens)
  runs = alternate({"transformers": hf_stepper(hf_model, tokens, args.bf16), "jaxseek": jax_stepper(timer)},
                   args.steps)
  return report(args, timer, runs)


def report(args, timer, runs: dict[str, dict]) -> int:
  import common

  peak = common.matmul_peak_tflops()
  rows = []
  for name, run in runs.items():
    step_s = statistics.median(run["times"])
    tps = args.batch * args.seq / step_s
    rows.append(dict(impl=name, step_s=step_s, tokens_per_sec=tps, mfu=tps * timer.flops_per_token / 1e12 / peak,
                     first_loss=run["losses"][0], last_loss=run["losses"][-1]))
  pairs = [h / j for h, j in zip(runs["transformers"]["times"], runs["jaxseek"]["times"])]
  ratio = statistics.median(pairs)
  print(f"DeepSeek-V3 small ({', '.join([*DEFAULT_SETS, *args.set])}{', ' + ' '.join(args.jax) if args.jax else ''}): "
        f"{timer.n_params / 1e6:.1f}M parameters, batch {args.batch} x {args.seq} tokens, "
        f"{'bfloat16' if args.bf16 else 'float32'}, {os.cpu_count()} CPU cores, matmul peak {peak * 1e3:.0f} GFLOP/s, "
        f"{timer.flops_per_token / 1e6:.1f} MFLOP/token (training), jaxseek compile {timer.compile_s:.1f} s, "
        f"{len(pairs)} pairs of steps")
  print(f"{'':<13} {'step s':>8} {'tokens/s':>10} {'MFU':>7} {'loss@1':>8} {'loss@last':>9}")
  for r in rows:
    print(f"{r['impl']:<13} {r['step_s']:>8.3f} {r['tokens_per_sec']:>10,.0f} {100 * r['mfu']:>6.1f}% "
          f"{r['first_loss']:>8.4f} {r['last_loss']:>9.4f}")
  spread = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [ratio, ratio, ratio]
  print(f"jaxseek / transformers throughput: {ratio:.2f}x (median over pairs; quartiles {spread[0]:.2f}, "
        f"{spread[2]:.2f})")
  common.append_result(args.results or common.RESULTS, dict(
      bench="vs_hf", set=[*DEFAULT_SETS, *args.set], jax=args.jax, bf16=args.bf16, params=timer.n_params,
      batch=args.batch, seq=args.seq, peak_tflops=peak, ratio=ratio, pair_ratios=pairs, rows=rows))
  return check(ratio, settings_key(args), Path(args.check)) if args.check else 0


if __name__ == "__main__":
  sys.exit(main())
