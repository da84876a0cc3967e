"""Greedy decoding speed of jaxseek.generate against transformers' `generate`, same model, prompts and CPU.

  python benchmarks/bench_generate.py [--batch 4] [--prompt-len 32] [--new 64] [--repeats 3] [--set KEY=VALUE ...]

One random DeepseekV3ForCausalLM (benchmarks/common.py SMALL_V3; --set changes it) is built with `transformers`,
saved and loaded by jaxseek's load_pretrained, so both hold the same weights. Each greedily generates `--new`
tokens for the same batch of random prompts (float32, EOS off, one JAX device, torch with every core):

  transformers  model.generate(do_sample=False), its dynamic KV cache (full keys and values per head), its
                default experts (grouped_mm) and attention (sdpa) implementations unless --hf-experts
  jaxseek       jaxseek.generate.generate: jitted prefill + while_loop decode over the MLA latent cache

After one warm-up call (JAX compiles in it) the median wall time of `--repeats` calls gives new tokens/s
(batch × new / time, prefill included). The fraction of identical tokens is printed too (random models have
near ties, so a late token may differ). Appends one JSON line to benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

import common
from jaxseek import generate as gen
from jaxseek.convert.pretrained import load_pretrained



def timed(fn, repeats: int):
  fn()  # warm-up (compiles on the JAX side)
  times, out = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--new", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
  parser.add_argument("--hf-experts", default=None,
                      help="transformers' experts_implementation (default: its own, grouped_mm), e.g. batched_mm")
  parser.add_argument("--results", default=str(common.RESULTS))
  args = parser.parse_args()

  import torch

  model = common.parse_sets(args.set, common.SMALL_V3)
  hf_model = common.transformers_twin(model).eval()
  if args.hf_experts:
    hf_model.set_experts_implementation(args.hf_experts)
  prompts = np.random.default_rng(0).integers(1, model["vocab_size"], (args.batch, args.prompt_len)).tolist()
  with tempfile.TemporaryDirectory() as tmp:
    hf_model.save_pretrained(f"{tmp}/hf")
    ours = load_pretrained(f"{tmp}/hf")
  jax_s, jax_out = timed(lambda: gen.generate(ours, prompts, args.new), args.repeats)
  ids = torch.tensor(prompts)

  def hf_generate():
    with torch.no_grad():
      return hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.new,
                               min_new_tokens=args.new, pad_token_id=0, eos_token_id=None)

  hf_s, hf_out = timed(hf_generate, args.repeats)
  hf_out = hf_out[:, args.prompt_len:].numpy()
  same = float(np.mean(np.asarray(jax_out) == hf_out))
  rows = [dict(impl=name, wall_s=s, tokens_per_sec=args.batch * args.new / s)
          for name, s in (("transformers", hf_s), ("jaxseek", jax_s))]
  experts, attention = hf_model.config._experts_implementation, hf_model.config._attn_implementation
  print(f"DeepSeek-V3 small ({', '.join(args.set) or 'default'}), transformers experts {experts}, attention "
        f"{attention}, float32, {os.cpu_count()} CPU cores: batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.new} new tokens, greedy; identical tokens {100 * same:.1f}%")
  print(f"{'':<13} {'wall s':>8} {'new tokens/s':>13}")
  for r in rows:
    print(f"{r['impl']:<13} {r['wall_s']:>8.3f} {r['tokens_per_sec']:>13,.1f}")
  ratio = rows[1]["tokens_per_sec"] / rows[0]["tokens_per_sec"]
  print(f"jaxseek / transformers decode throughput: {ratio:.2f}x")
  common.append_result(args.results, dict(bench="generate", set=args.set, hf_experts=experts, batch=args.batch,
                                          prompt_len=args.prompt_len, new=args.new, same_tokens=same, ratio=ratio,
                                          rows=rows))


if __name__ == "__main__":
  main()
