"""End to end: the run loop on real text, its run directory and metrics; the optimiser pieces."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from conftest import CONFIGS, load_config
from jaxseek import config as config_lib
from jaxseek import optim
from jaxseek.step import update_bias
from jaxseek.train import run

REQUIRED = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "step_time_s", "tflops_per_device", "mfu"}


def test_demo_model_learns_python_source(tmp_path):
  cfg = config_lib.load(CONFIGS / "demo.yaml", ["train.steps=20", "metrics.every=10", "optim.warmup_steps=10",
                                                f"train.run_dir={tmp_path}", "data.max_bytes=1000000"])
  summary = run(cfg)
  assert summary["last_loss"] < 0.67 * summary["first_loss"], summary  # ln 256 ≈ 5.55 at the start
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 10, 20]
  assert all(REQUIRED <= r.keys() for r in records)
  assert records[-1]["tokens_per_sec"] > 0 and 0 < records[-1]["mfu"] < 1
  assert "balance_loss" in records[-1] and records[-1]["moe_load_max_over_mean"] >= 1.0
  assert config_lib.load(tmp_path / "config.yaml") == cfg


def test_demo_console_has_no_warnings_and_says_when_it_compiles(tmp_path, run_env):
  """The demo's console, captured from a fresh process (stdout and stderr): no third-party WARNING line (Orbax's
  type-handler notice was one), and a line for the train step's compile with its time."""
  done = subprocess.run([sys.executable, "-m", "jaxseek.train", "--config", str(CONFIGS / "demo.yaml"),
                         "train.steps=3", "data.max_bytes=300000", "checkpoint.every=2", f"train.run_dir={tmp_path}"],
                        env=run_env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout + done.stderr
  console = done.stdout + done.stderr
  assert "WARNING" not in console, console
  assert re.search(r"^compiling the train step … done in \d+\.\d s$", done.stdout, re.M), done.stdout
  assert done.stdout.index("compiling the train step") < done.stdout.index("step      1/3")


def test_bias_update_is_sign_of_load_deficit():
  load = np.array([[5.0, 1.0, 3.0, 3.0], [0.0, 8.0, 2.0, 2.0]])
  bias = np.zeros((2, 4))
  new = np.asarray(update_bias(bias, load, 0.01))
  np.testing.assert_allclose(new, 0.01 * np.sign(load.mean(-1, keepdims=True) - load))


# lr 2, 4 warm-up steps, min_lr_ratio 0.2, worked by hand from optim.schedule's docstring: warm-up step s gives
# 2·(s+1)/4; cosine step s ≥ 4 gives 2·(0.2 + 0.8·(1 + cos(π·(s−4)/span))/2), with cos(π/3) = 0.5 and
# cos(2π/3) = −0.5 at a third and two thirds of the span; wsd is flat at 2 until its decay, then falls by
# (2 − 0.4)/4 = 0.4 a step.
WARMUP = {0: 0.5, 1: 1.0, 2: 1.5, 3: 2.0}


@pytest.mark.parametrize("schedule, decay_steps, total, expected", [
    ("cosine", 0, 16, {4: 2.0, 8: 1.6, 10: 1.2, 12: 0.8, 16: 0.4, 30: 0.4}),  # span 12 = 16 − 4
    ("cosine", 6, 16, {4: 2.0, 6: 1.6, 7: 1.2, 8: 0.8, 10: 0.4, 16: 0.4}),  # span decay_steps = 6
    ("wsd", 4, 14, {4: 2.0, 9: 2.0, 10: 2.0, 11: 1.6, 12: 1.2, 13: 0.8, 14: 0.4}),  # stable 14 − 4 − 4 = 6
    ("constant", 0, 14, {4: 2.0, 14: 2.0, 100: 2.0}),
])
def test_schedule_matches_hand_values(schedule, decay_steps, total, expected):
  cfg = config_lib.OptimConfig(lr=2.0, schedule=schedule, warmup_steps=4, decay_steps=decay_steps, min_lr_ratio=0.2)
  lr = optim.schedule(cfg, total)
  steps = {**WARMUP, **expected}
  np.testing.assert_allclose([float(lr(s)) for s in steps], list(steps.values()), rtol=1e-6)


def test_weight_decay_mask_skips_norms_and_embeddings():
  from jaxseek import model as model_lib
  cfg = load_config("tiny-v3")
  params = nnx.state(nnx.eval_shape(lambda: model_lib.build(cfg.model)), nnx.Param)
  flat = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(optim.decay_mask(params, cfg.optim))}
  assert flat["embed/table_VD"] is False
  assert flat["moe_layers/blocks/attn_norm/scale_D"] is False
  assert flat["moe_layers/blocks/mlp/w_gate_EDM"] is True and flat["head_DV"] is True


@pytest.mark.parametrize("method", ["bf16", "int8", "powersgd"])
def test_compression_on_one_data_shard_says_nothing_is_compressed(method):
  """train.grad_compression with mesh.data=1 has no sum over data to compress: the start-up line says so."""
  from types import SimpleNamespace

  from jaxseek.step import compression_summary

  mesh = SimpleNamespace(shape={"data": 1, "fsdp": 2, "expert": 1, "tensor": 1, "pipeline": 1, "context": 1})
  line = compression_summary(load_config("tiny-v3", f"train.grad_compression={method}"), None, mesh)
  assert line == (f"warning: train.grad_compression={method} has nothing to compress with mesh.data=1: the gradient "
                  f"sum runs uncompressed (only the sum over data shards is compressed)")
  assert compression_summary(load_config("tiny-v3"), None, mesh) is None
