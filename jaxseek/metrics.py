"""Model FLOPs and MFU, and the metric writers (console line, metrics.jsonl)."""

from __future__ import annotations

import json
import math
import sys
import time
from functools import lru_cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxseek.config import Config
from jaxseek.errors import RunStopped

# Dense bf16 peak TFLOP/s per device (vendor data sheets, without sparsity).
PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0, "h800": 989.0, "a100": 312.0, "a800": 312.0, "l40s": 362.0,
               "gh200": 989.0, "b200": 2250.0}


def flops_per_token(cfg: Config, abstract_params: nnx.State) -> float:
  """Training FLOPs per token = 3 × forward, forward = 2 × active matmul parameters + attention.

  Active parameters: every matrix but the embedding lookup, routed experts counted K/E (only the chosen ones
  run). Attention: 2 · N · (qk head dim + v head dim) multiply-adds per query-key pair, (T + 1)/2 pairs per
  query under the causal mask, per layer.
  """
  m = cfg.model
  active = 0.0
  for path, var in jax.tree_util.tree_flatten_with_path(abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    names = var.get_metadata()["logical_axes"]
    if sum(n != "layers" for n in names) < 2 or any(getattr(k, "key", None) == "table_VD" for k in path):
      continue
    size = math.prod(var.shape)
    if "experts" in names:
      size *= m.num_experts_per_tok / m.n_routed_experts
    active += size
  depth = m.num_nextn_predict_layers
  active += (int(m.tie_word_embeddings) + depth) * m.vocab_size * m.hidden_size  # the head, once per MTP depth too
  qk, v = (m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim) if m.is_mla else (m.dense_head_dim,) * 2
  attention = (m.num_hidden_layers + depth) * 2 * m.num_attention_heads * (qk + v) * (cfg.train.seq_len + 1) / 2
  return 3 * (2 * active + attention)


@lru_cache(maxsize=1)
def _cpu_probe_tflops() -> float:
  """Measured float32 matmul rate of this host (all cores), in TFLOP/s."""
  n = 1024
  x = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  f(x).block_until_ready()
  reps, start = 8, time.perf_counter()
  for _ in range(reps):
    y = f(x)
  y.block_until_ready()
  return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def peak_tflops_per_device(override: float | None) -> tuple[float, str]:
  """(peak TFLOP/s per device, where it came from): config, the accelerator table, or a CPU probe."""
  if override:
    return override, "config"
  device = jax.local_devices()[0]
  kind = device.device_kind.lower()
  for name, tflops in PEAK_TFLOPS.items():
    if name in kind.replace(" ", ""):
      return tflops, f"table ({device.device_kind})"
  if device.platform == "cpu":
    return _cpu_probe_tflops() / jax.local_device_count(), "cpu matmul probe, shared by the simulated devices"
  return float("nan"), f"unknown device {device.device_kind}; set metrics.peak_tflops"


class Writer:
  """One place all per-step metrics go: a console line and metrics.jsonl (process 0 only)."""

  def __init__(self, run_dir: Path, total_steps: int):
    self.enabled = jax.process_index() == 0
    self.total_steps = total_steps
    self.first: tuple[int, float] | None = None  # (step, time) of the first write: ETA excludes compilation
    self.file = open(run_dir / "metrics.jsonl", "a") if self.enabled else None

  def write(self, step: int, values: dict[str, float]) -> None:
    if not self.enabled:
      return
    record = {"step": step, **{k: _plain(v) for k, v in values.items()}}
    self.file.write(json.dumps(record) + "\n")
    self.file.flush()
    now = time.perf_counter()
    if self.first is None:
      self.first = (step, now)
    done_steps = step - self.first[0]
    eta = (now - self.first[1]) / done_steps * (self.total_steps - step) if done_steps else float("nan")
    parts = [f"step {step:>6}/{self.total_steps}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}",
             f"grad {record['grad_norm']:.3f}"]
    if "tokens_per_sec" in record:
      parts += [f"{record['tokens_per_sec']:,.0f} tok/s", f"mfu {100 * record['mfu']:.1f}%"]
    if record.get("skipped"):
      parts.append("SKIPPED" + (" (non-finite)" if record.get("nonfinite") else " (loss spike)"))
    parts.append(f"eta {_hms(eta)}")
    line = " | ".join(parts)
    print(line, file=sys.stdout, flush=True)

  def close(self) -> None:
    if self.file:
      self.file.close()


def _plain(v):
  v = np.asarray(v)
  return v.item() if v.ndim == 0 else v.tolist()


def _hms(seconds: float) -> str:
  if math.isnan(seconds):
    return "-"
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class StepReporter:
  """Fetches each step's metrics (waiting for that step to finish), times steps, writes every metrics.every."""

  def __init__(self, writer: Writer, cfg: Config, flops_per_step: float, peak: float):
    self.writer, self.cfg, self.flops_per_step, self.peak = writer, cfg, flops_per_step, peak
    self.last_done = time.perf_counter()
    self.step_times: list[float] = []
    self.losses: list[float] = []
    self.skipped = 0

  def __call__(self, step: int, metrics: dict[str, jax.Array], data_wait: float, extra: dict[str, float]) -> None:
    values = {k: float(v) if v.ndim == 0 else v.tolist() for k, v in jax.device_get(metrics).items()}
    values.update(extra)
    self.skipped += int(values["skipped"])
    if values["nonfinite"] and self.cfg.train.on_nonfinite == "stop":
      self.writer.write(step, values)
      raise RunStopped(f"step {step}: loss {values['loss']:g}, gradient norm {values['grad_norm']:g}; the "
                       f"parameters were not updated and checkpoints on disk hold finite values; lower optim.lr, "
                       f"or set train.on_nonfinite=skip to skip such steps")
    done = time.perf_counter()
    step_time, self.last_done = done - self.last_done, done
    self.step_times.append(step_time)
    self.losses.append(values["loss"])
    cfg = self.cfg
    if step % cfg.metrics.every == 0 or step in (1, cfg.train.steps) or extra or values["skipped"]:
      tflops = self.flops_per_step / step_time / jax.device_count() / 1e12
      values.update(tokens_per_sec=cfg.train.batch_size * cfg.train.seq_len / step_time, step_time_s=step_time,
                    data_wait_s=data_wait, tflops_per_device=tflops, mfu=tflops / self.peak)
      self.writer.write(step, values)
