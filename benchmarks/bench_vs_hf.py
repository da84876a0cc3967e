"""Training throughput of jaxseek against the Hugging Face `transformers` PyTorch model, same model and batch.

  python benchmarks/bench_vs_hf.py [--steps 10] [--batch 8] [--seq 256] [--results benchmarks/results.jsonl]

One random DeepseekV3ForCausalLM (MLA with q compression, sigmoid router with noaux_tc over groups, shared
expert, one dense layer then MoE layers) is built with `transformers`, saved, and converted to jaxseek, so both
start from the same weights and route the same tokens to the same experts. Each then trains on the same random
token batch, float32, on this machine's CPU (all cores, one JAX device; torch with as many threads):

  transformers  model(input_ids).logits, cross entropy, backward, torch.optim.AdamW step
  jaxseek       jaxseek.train.train_step: forward, backward, AdamW (optax), MoE bias update, jitted, donated

The first two steps of each are warm-up (JAX compiles in the first); the table gives the median of the rest,
tokens/s and MFU (model FLOPs per token from jaxseek.metrics.flops_per_token, the same for both, over this
machine's measured float32 matmul rate), and the first-step losses, which must agree since the weights do.
Appends one JSON line per run to --results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxseek import checkpoint as checkpoint_lib  # noqa: E402
from jaxseek import config as config_lib  # noqa: E402
from jaxseek import metrics as metrics_lib  # noqa: E402
from jaxseek import train as train_lib  # noqa: E402
from jaxseek.convert import pretrained  # noqa: E402
from jaxseek.input import pipeline  # noqa: E402
from jaxseek.sharding.mesh import make_mesh  # noqa: E402

# A small DeepSeek-V3: 4 layers (1 dense + 3 MoE with 16 routed experts, top 4 over 4 groups keeping 2, 1 shared).
MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256,
             num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
             q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
             n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2,
             routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096, rope_theta=10000.0,
             tie_word_embeddings=False)
LR = 1e-4


def timed(step, n: int) -> tuple[list[float], list[float]]:
  """Runs `step()` (which returns the loss as a float, so it waits for the step) n times: (seconds, losses)."""
  times, losses = [], []
  for _ in range(n):
    start = time.perf_counter()
    losses.append(step())
    times.append(time.perf_counter() - start)
  return times, losses


def hf_side(hf_model, tokens: np.ndarray, steps: int):
  import torch

  torch.manual_seed(0)
  hf_model.train()
  opt = torch.optim.AdamW(hf_model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
  ids, targets = torch.from_numpy(tokens[:, :-1].astype(np.int64)), torch.from_numpy(tokens[:, 1:].astype(np.int64))

  def step() -> float:
    opt.zero_grad(set_to_none=True)
    logits = hf_model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    opt.step()
    return float(loss.detach())

  return timed(step, steps)


def jaxseek_side(ckpt_dir: Path, tokens: np.ndarray, steps: int, run_dir: str):
  raw = config_lib.to_dict(config_lib.load(ckpt_dir / "config.yaml"))
  batch_size, seq_len = tokens.shape
  raw.update(mesh={"data": 1}, data={"source": "synthetic"},
             optim={"lr": LR, "warmup_steps": 0, "schedule": "constant", "b1": 0.9, "b2": 0.95, "eps": 1e-8,
                    "weight_decay": 0.0, "clip_norm": 0.0, "bias_update_rate": 0.0},
             train={"steps": 1000, "batch_size": batch_size, "seq_len": seq_len - 1, "run_dir": run_dir})
  cfg = config_lib.from_dict(raw)
  mesh = make_mesh(cfg, jax.devices()[:1])
  trainer = train_lib.make_trainer(cfg, mesh)
  source = checkpoint_lib.Checkpointer(cfg, ckpt_dir / "checkpoints", read_only=True)
  state = trainer.init().replace(**source.restore(0, trainer.abstract_state, trainer.state_shardings, None,
                                                  params_only=True))
  source.close()
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones_like(tokens[:, 1:], np.float32),
           "positions": np.broadcast_to(np.arange(seq_len - 1, dtype=np.int32), (batch_size, seq_len - 1)),
           "segment_ids": np.ones_like(tokens[:, 1:])}  # one document per row, as transformers sees it
  batch = {k: jax.device_put(v, s) for k, v in batch.items() for s in [pipeline.batch_shardings(mesh)[k]]}
  step_fn = train_lib.compile_step(trainer, cfg, mesh)
  holder = [state]

  def step() -> float:
    with jax.set_mesh(mesh):
      holder[0], metrics = step_fn(holder[0], batch)
    return float(metrics["loss"])

  flops = metrics_lib.flops_per_token(cfg, trainer.abstract_state.params)
  return timed(step, steps), flops


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=10, help="timed steps after 2 warm-up steps")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                      help="change the model, e.g. first_k_dense_replace=4 (all dense) num_hidden_layers=8")
  parser.add_argument("--results", default=str(ROOT / "benchmarks/results.jsonl"))
  args = parser.parse_args()

  import torch
  import transformers

  torch.set_num_threads(os.cpu_count())
  torch.manual_seed(0)
  model = dict(MODEL, **{k: type(MODEL[k])(v) for k, v in (kv.split("=", 1) for kv in args.set)})
  hf_model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**model)).float()
  tokens = np.random.default_rng(0).integers(0, model["vocab_size"], (args.batch, args.seq + 1), dtype=np.int32)
  with tempfile.TemporaryDirectory() as tmp:
    hf_model.save_pretrained(f"{tmp}/hf")
    pretrained.hf_to_checkpoint(f"{tmp}/hf", f"{tmp}/ck")
    (jax_times, jax_losses), flops_per_token = jaxseek_side(Path(tmp) / "ck", tokens, args.steps + 2, f"{tmp}/run")
  hf_times, hf_losses = hf_side(hf_model, tokens, args.steps + 2)

  peak = metrics_lib._cpu_probe_tflops()
  tokens_per_step = args.batch * args.seq
  rows = []
  for name, times, losses in (("transformers", hf_times, hf_losses), ("jaxseek", jax_times, jax_losses)):
    step_s = statistics.median(times[2:])
    tps = tokens_per_step / step_s
    rows.append(dict(impl=name, step_s=step_s, tokens_per_sec=tps, mfu=tps * flops_per_token / 1e12 / peak,
                     first_loss=losses[0], last_loss=losses[-1]))
  n_params = sum(p.numel() for p in hf_model.parameters())
  print(f"DeepSeek-V3 small: {n_params / 1e6:.1f}M parameters, batch {args.batch} x {args.seq} tokens, float32, "
        f"{os.cpu_count()} CPU cores, matmul peak {peak * 1e3:.0f} GFLOP/s, "
        f"{flops_per_token / 1e6:.1f} MFLOP/token (training)")
  print(f"{'':<13} {'step s':>8} {'tokens/s':>10} {'MFU':>7} {'loss@1':>8} {'loss@last':>9}")
  for r in rows:
    print(f"{r['impl']:<13} {r['step_s']:>8.3f} {r['tokens_per_sec']:>10,.0f} {100 * r['mfu']:>6.1f}% "
          f"{r['first_loss']:>8.4f} {r['last_loss']:>9.4f}")
  ratio = rows[1]["tokens_per_sec"] / rows[0]["tokens_per_sec"]
  print(f"jaxseek / transformers throughput: {ratio:.2f}x")
  with open(args.results, "a") as f:
    f.write(json.dumps(dict(bench="vs_hf", time=time.strftime("%Y-%m-%dT%H:%M:%S"), params=n_params,
                            batch=args.batch, seq=args.seq, peak_tflops=peak, ratio=ratio, rows=rows)) + "\n")


if __name__ == "__main__":
  main()
