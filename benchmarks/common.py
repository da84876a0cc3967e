"""Shared by the benchmark scripts: build a config, time jaxseek's train step on this machine, append results."""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxseek import config as config_lib  # noqa: E402
from jaxseek import metrics as metrics_lib  # noqa: E402
from jaxseek import step as step_lib  # noqa: E402
from jaxseek.input import batches as batches_lib  # noqa: E402
from jaxseek.kernels import choice as kernels  # noqa: E402
from jaxseek.sharding.mesh import make_mesh  # noqa: E402

RESULTS = ROOT / "benchmarks/results.jsonl"

# A small DeepSeek-V3: 4 layers (1 dense + 3 MoE with 16 routed experts, top 4 over 4 groups keeping 2, 1 shared).
SMALL_V3 = dict(model_type="deepseek_v3", vocab_size=8192, hidden_size=512, intermediate_size=1408,
                moe_intermediate_size=256, num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8,
                num_key_value_heads=8, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
                v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=4,
                topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096,
                rope_theta=10000.0, tie_word_embeddings=False)

# A ~50M-parameter dense model (DeepSeek LLM / Llama layout).
DENSE_50M = dict(model_type="llama", vocab_size=8192, hidden_size=640, intermediate_size=1728, num_hidden_layers=8,
                 num_attention_heads=10, num_key_value_heads=10, max_position_embeddings=4096,
                 tie_word_embeddings=False)


def parse_sets(items: list[str], model: dict[str, Any]) -> dict[str, Any]:
  """KEY=VALUE strings applied to a model dict, each value cast to the type it replaces."""
  out = dict(model)
  for item in items:
    key, value = item.split("=", 1)
    out[key] = type(model[key])(value) if key in model and model[key] is not None else json.loads(value)
  return out


def transformers_twin(model: dict[str, Any]):
  """The transformers DeepseekV3ForCausalLM of a SMALL_V3-style model dict, float32, seeded (torch seed 0), on
  every CPU thread."""
  import os

  import torch
  import transformers

  torch.set_num_threads(os.cpu_count())
  torch.manual_seed(0)
  config = transformers.DeepseekV3Config(**{k: v for k, v in model.items() if k != "model_type"})
  return transformers.DeepseekV3ForCausalLM(config).float()


def make_config(model: dict[str, Any], batch: int, seq: int, **train: Any) -> config_lib.Config:
  """A one-device config for timing: no clipping (as the peers' plain loops), AdamW at a small constant lr."""
  return config_lib.from_dict({
      "model": model, "mesh": {"data": 1},
      "optim": {"lr": 1e-4, "warmup_steps": 0, "schedule": "constant", "b1": 0.9, "b2": 0.95, "eps": 1e-8,
                "weight_decay": 0.0, "clip_norm": 0.0, "bias_update_rate": 0.0},
      "train": {"steps": 1000, "batch_size": batch, "seq_len": seq, "run_dir": "/tmp/jaxseek-bench", **train}})


def with_overrides(cfg: config_lib.Config, items: list[str]) -> config_lib.Config:
  """cfg with `section.key=value` overrides applied (as on jaxseek.train's command line)."""
  if not items:
    return cfg
  raw = config_lib.to_dict(cfg)
  for item in items:
    section, key, value = config_lib.parse_override(item)
    raw[section][key] = value
  return config_lib.from_dict(raw)


def token_batch(tokens: np.ndarray, mesh) -> dict[str, jax.Array]:
  """inputs tokens[:, :-1] → targets tokens[:, 1:], one document per row, placed as the trainer expects."""
  b, t = tokens.shape[0], tokens.shape[1] - 1
  host = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((b, t), np.float32),
          "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)), "segment_ids": np.ones((b, t), np.int32)}
  shardings = batches_lib.batch_shardings(mesh)
  return {k: jax.device_put(v, shardings[k]) for k, v in host.items()}


class StepTimer:
  """jaxseek's jitted train step on the config's mesh (one device unless it says otherwise): compile time, then timed steps (each waits for its loss)."""

  def __init__(self, cfg: config_lib.Config, state=None, tokens: np.ndarray | None = None):
    self.cfg = cfg
    self.mesh = make_mesh(cfg, jax.devices()[:math.prod(cfg.mesh.sizes().values())])
    self.trainer = step_lib.make_trainer(cfg, self.mesh)
    self.state = self.trainer.init() if state is None else state(self.trainer)
    if tokens is None:
      tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1),
                                                 dtype=np.int32)
    self.batch = token_batch(tokens, self.mesh)
    jax.block_until_ready(self.state)  # initialisation runs asynchronously: keep it out of the compile time
    start = time.perf_counter()
    with jax.set_mesh(self.mesh):
      self.step_fn = step_lib.compile_step(self.trainer, cfg, self.mesh).lower(self.state, self.batch).compile(
          kernels.compiler_options(cfg) or None)  # as python -m jaxseek.train compiles it
    self.compile_s = time.perf_counter() - start
    self.flops_per_token = metrics_lib.flops_per_token(cfg, self.trainer.abstract_state.params)
    self.n_params = sum(x.size for x in jax.tree.leaves(self.state.params))

  def step(self) -> float:
    with jax.set_mesh(self.mesh):
      self.state, metrics = self.step_fn(self.state, self.batch)
    return float(metrics["loss"])

  def run(self, steps: int, warmup: int = 1) -> tuple[list[float], list[float]]:
    """(seconds per step, losses) over warmup + steps steps."""
    times, losses = [], []
    for _ in range(warmup + steps):
      start = time.perf_counter()
      losses.append(self.step())
      times.append(time.perf_counter() - start)
    return times, losses

  def tokens_per_sec(self, times: list[float], warmup: int = 1) -> float:
    return self.cfg.train.batch_size * self.cfg.train.seq_len / statistics.median(times[warmup:])


def matmul_peak_tflops() -> float:
  """This machine's float32 matmul rate through XLA (all cores), the MFU denominator on CPU."""
  return metrics_lib.cpu_matmul_tflops()


def append_result(path: str | Path, record: dict[str, Any]) -> None:
  with open(path, "a") as f:
    f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": jax.devices()[0].device_kind,
                        **record}) + "\n")
