"""Training throughput of jaxseek against the Hugging Face `transformers` PyTorch model, same model and batch.

  python benchmarks/bench_vs_hf.py [--steps 8] [--batch 8] [--seq 256] [--set KEY=VALUE ...]

One random DeepseekV3ForCausalLM (benchmarks/common.py SMALL_V3: MLA with q compression, sigmoid router with
noaux_tc over groups, a shared expert, one dense layer then MoE layers; --set changes it) is built with
`transformers`, saved, and converted to jaxseek, so both start from the same weights and route the same tokens
to the same experts. Each then trains on the same random token batch, float32, on this machine's CPU (all cores;
one JAX device, torch with as many threads):

  transformers  model(input_ids).logits, cross entropy, backward, torch.optim.AdamW step
  jaxseek       jaxseek.train.train_step: forward, backward, AdamW (optax), jitted, state donated

Both use AdamW(lr 1e-4, betas 0.9/0.95, eps 1e-8, no weight decay, no clipping). After one warm-up step (JAX
compiles in it) the table gives the median step, tokens/s and MFU: model FLOPs per token (jaxseek.metrics
.flops_per_token, the same for both) over this machine's measured float32 matmul rate. The losses of the first
and last steps must agree, since the weights and data do. Appends one JSON line to benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import common
from jaxseek import checkpoint as checkpoint_lib
from jaxseek.convert import pretrained



def hf_side(hf_model, tokens: np.ndarray, steps: int) -> tuple[list[float], list[float]]:
  import torch

  hf_model.train()
  opt = torch.optim.AdamW(hf_model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
  ids, targets = torch.from_numpy(tokens[:, :-1].astype(np.int64)), torch.from_numpy(tokens[:, 1:].astype(np.int64))
  times, losses = [], []
  for _ in range(steps):
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    logits = hf_model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    opt.step()
    losses.append(float(loss.detach()))
    times.append(time.perf_counter() - start)
  return times, losses


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=8, help="timed steps after one warm-up step")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                      help="change the model, e.g. first_k_dense_replace=4 (all dense) n_routed_experts=64")
  parser.add_argument("--results", default=str(common.RESULTS))
  args = parser.parse_args()

  import torch

  model = common.parse_sets(args.set, common.SMALL_V3)
  hf_model = common.transformers_twin(model)
  tokens = np.random.default_rng(0).integers(0, model["vocab_size"], (args.batch, args.seq + 1), dtype=np.int32)
  with tempfile.TemporaryDirectory() as tmp:
    hf_model.save_pretrained(f"{tmp}/hf")
    model_cfg = pretrained.hf_to_checkpoint(f"{tmp}/hf", f"{tmp}/ck")
    cfg = common.make_config(common.config_lib.to_dict(common.config_lib.Config(model=model_cfg))["model"],
                             args.batch, args.seq)

    def converted(trainer):
      source = checkpoint_lib.Checkpointer(cfg, Path(tmp) / "ck/checkpoints", read_only=True)
      params = source.restore(0, trainer.abstract_state, trainer.state_shardings, None, params_only=True)
      source.close()
      return trainer.init().replace(**params)

    timer = common.StepTimer(cfg, converted, tokens)
    jax_times, jax_losses = timer.run(args.steps)
  hf_times, hf_losses = hf_side(hf_model, tokens, args.steps + 1)

  peak = common.matmul_peak_tflops()
  rows = []
  for name, times, losses in (("transformers", hf_times, hf_losses), ("jaxseek", jax_times, jax_losses)):
    step_s = statistics.median(times[1:])
    tps = args.batch * args.seq / step_s
    rows.append(dict(impl=name, step_s=step_s, tokens_per_sec=tps, mfu=tps * timer.flops_per_token / 1e12 / peak,
                     first_loss=losses[0], last_loss=losses[-1]))
  print(f"DeepSeek-V3 small ({', '.join(args.set) or 'default'}): {timer.n_params / 1e6:.1f}M parameters, batch "
        f"{args.batch} x {args.seq} tokens, float32, {os.cpu_count()} CPU cores, matmul peak {peak * 1e3:.0f} GFLOP/s, "
        f"{timer.flops_per_token / 1e6:.1f} MFLOP/token (training), jaxseek compile {timer.compile_s:.1f} s")
  print(f"{'':<13} {'step s':>8} {'tokens/s':>10} {'MFU':>7} {'loss@1':>8} {'loss@last':>9}")
  for r in rows:
    print(f"{r['impl']:<13} {r['step_s']:>8.3f} {r['tokens_per_sec']:>10,.0f} {100 * r['mfu']:>6.1f}% "
          f"{r['first_loss']:>8.4f} {r['last_loss']:>9.4f}")
  ratio = rows[1]["tokens_per_sec"] / rows[0]["tokens_per_sec"]
  print(f"jaxseek / transformers throughput: {ratio:.2f}x")
  common.append_result(args.results, dict(bench="vs_hf", set=args.set, params=timer.n_params, batch=args.batch,
                                          seq=args.seq, peak_tflops=peak, ratio=ratio, rows=rows))


if __name__ == "__main__":
  main()
