"""End to end: the run loop on real text, its run directory and metrics; the optimiser pieces."""

import json

import numpy as np
from flax import nnx

from conftest import CONFIGS, load_config
from jaxseek import config as config_lib
from jaxseek import optim
from jaxseek.step import update_bias
from jaxseek.train import run

REQUIRED = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "step_time_s", "tflops_per_device", "mfu"}


def test_demo_model_learns_python_source(tmp_path):
  cfg = config_lib.load(CONFIGS / "demo.yaml", ["train.steps=30", "metrics.every=10", "optim.warmup_steps=10",
                                                f"train.run_dir={tmp_path}", "data.max_bytes=1000000"])
  summary = run(cfg)
  assert summary["last_loss"] < 0.67 * summary["first_loss"], summary  # ln 256 ≈ 5.55 at the start
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 10, 20, 30]
  assert all(REQUIRED <= r.keys() for r in records)
  assert records[-1]["tokens_per_sec"] > 0 and 0 < records[-1]["mfu"] < 1
  assert "balance_loss" in records[-1] and records[-1]["moe_load_max_over_mean"] >= 1.0
  assert config_lib.load(tmp_path / "config.yaml") == cfg


def test_bias_update_is_sign_of_load_deficit():
  load = np.array([[5.0, 1.0, 3.0, 3.0], [0.0, 8.0, 2.0, 2.0]])
  bias = np.zeros((2, 4))
  new = np.asarray(update_bias(bias, load, 0.01))
  np.testing.assert_allclose(new, 0.01 * np.sign(load.mean(-1, keepdims=True) - load))


def test_schedules():
  base = dict(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
  cos = optim.schedule(config_lib.OptimConfig(schedule="cosine", **base), 14)
  assert [float(cos(s)) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
  assert abs(float(cos(14)) - 0.1) < 1e-6 and float(cos(9)) < 1.0
  wsd = optim.schedule(config_lib.OptimConfig(schedule="wsd", decay_steps=4, **base), 14)
  assert float(wsd(4)) == 1.0 and float(wsd(9)) == 1.0
  assert abs(float(wsd(12)) - 0.55) < 1e-6 and abs(float(wsd(14)) - 0.1) < 1e-6


def test_weight_decay_mask_skips_norms_and_embeddings():
  from jaxseek import model as model_lib
  cfg = load_config("tiny-v3")
  params = nnx.state(nnx.eval_shape(lambda: model_lib.build(cfg.model)), nnx.Param)
  flat = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(optim.decay_mask(params, cfg.optim))}
  assert flat["embed/table_VD"] is False
  assert flat["moe_layers/blocks/attn_norm/scale_D"] is False
  assert flat["moe_layers/blocks/mlp/w_gate_EDM"] is True and flat["head_DV"] is True
