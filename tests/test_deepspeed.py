"""scripts/from_deepspeed.py: each mapping rule, unknown and contradictory keys, the 67B example on 4 × 8 GPUs,
and the same file on 8 simulated CPU devices with a tiny model, trained."""

import importlib.util
import json
import math

import numpy as np
import pytest
import yaml

from conftest import CONFIGS, ROOT
from jaxseek import config as config_lib
from jaxseek import deepspeed, metrics, optim
from jaxseek.errors import UserError

_spec = importlib.util.spec_from_file_location("from_deepspeed", ROOT / "scripts" / "from_deepspeed.py")
from_deepspeed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(from_deepspeed)

GUIDE = """ds_config = {
  "train_micro_batch_size_per_gpu": 8,
  "gradient_accumulation_steps": 4,
  "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
  "fp16": {"enabled": True},
  "pipeline_parallelism": {"enabled": True, "stages": 4}
}
"""


def values(ds, nodes=1, gpus=8, platform="gpu"):
  t = deepspeed.translate(ds, deepspeed.Cluster(nodes, gpus, platform))
  flat = {f"{s}.{k}": v for s, kv in t.values.items() for k, v in kv.items()}
  return flat, t


def test_batch_is_micro_times_accumulation_times_data_parallel_size():
  v, _ = values({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, nodes=2, gpus=8)
  assert v["train.batch_size"] == 4 * 2 * 16 and v["train.microbatches"] == 2
  # pipeline and tensor ranks are not data-parallel: 16 devices / (2 stages × 2 tensor) = 4 replicas
  v, _ = values({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "pipeline": {"stages": 2},
                 "tensor_parallel": {"autotp_size": 2}}, nodes=2, gpus=8)
  assert (v["train.batch_size"], v["mesh.pipeline"], v["mesh.tensor"], v["mesh.data"]) == (4 * 2 * 4, 2, 2, 4)
  # train_batch_size with one of the others gives the third, as DeepSpeed derives it
  v, _ = values({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 8})
  assert (v["train.batch_size"], v["train.microbatches"]) == (256, 4)
  v, _ = values({"train_batch_size": 256, "gradient_accumulation_steps": 2})
  assert (v["train.batch_size"], v["train.microbatches"]) == (256, 2)
  v, _ = values({"train_batch_size": 64})
  assert (v["train.batch_size"], v["train.microbatches"]) == (64, 1)
  with pytest.raises(UserError, match=r"train_batch_size=100 and .* = 64 contradict"):
    values({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
  with pytest.raises(UserError, match="not divisible by pipeline 3"):
    values({"pipeline": {"stages": 3}})
  v, t = values({"pipeline_parallelism": {"enabled": False, "stages": 4}})
  assert v["mesh.pipeline"] == 1 and t.sources["mesh.pipeline"].startswith("pipeline_parallelism.enabled=false")


@pytest.mark.parametrize("stage, data, fsdp, zero", [(0, 8, 1, None), (1, 1, 8, 1), (2, 1, 8, 1), (3, 1, 8, 3)])
def test_each_zero_stage(stage, data, fsdp, zero):
  v, _ = values({"zero_optimization": {"stage": stage}})
  assert (v["mesh.data"], v["mesh.fsdp"], v.get("train.zero")) == (data, fsdp, zero)


def test_offload():
  v, t = values({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}})
  assert v["train.optimizer_memory"] == "host"
  assert ("zero_optimization.offload_optimizer.pin_memory", deepspeed._NOT_NEEDED[
      "zero_optimization.offload_optimizer.pin_memory"]) in t.not_needed
  v, t = values({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
  assert "train.optimizer_memory" not in v and [k for k, _ in t.unmapped] == ["zero_optimization.offload_param.device"]
  v, t = values({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, platform="cpu")
  assert "train.optimizer_memory" not in v and "needs a GPU" in dict(t.unmapped)[
      "zero_optimization.offload_optimizer.device"]
  with pytest.raises(UserError, match="offload_param needs zero_optimization.stage 3, not 2"):
    values({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})


def test_fp16_block_and_deepspeed_defaults():
  v, _ = values({"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 3,
                          "min_loss_scale": 4}})
  assert (v["train.compute_dtype"], v["train.loss_scale_init"], v["train.loss_scale_window"],
          v["train.loss_scale_hysteresis"], v["train.loss_scale_min"]) == ("float16", 4096.0, 500, 3, 4.0)
  v, t = values({"fp16": {"enabled": True}})  # DeepSpeed's defaults, written out
  assert (v["train.loss_scale_init"], v["train.loss_scale_window"], v["train.loss_scale_hysteresis"],
          v["train.loss_scale_min"]) == (65536.0, 1000, 2, 1.0)
  assert "DeepSpeed's default" in t.sources["train.loss_scale_hysteresis"]
  v, t = values({"fp16": {"enabled": True, "loss_scale": 128}, "communication_data_type": "fp16"})
  assert (v["train.loss_scale_init"], v["train.loss_scale_min"]) == (128.0, 128.0)  # static: never halved
  assert v["train.loss_scale_window"] >= 2**31 - 1  # nor grown
  assert "train.grad_compression" in dict(t.unmapped)["communication_data_type"]  # the rules after it still run


def test_bf16_and_float32():
  assert values({"bf16": {"enabled": True}})[0]["train.compute_dtype"] == "bfloat16"
  assert values({"fp16": {"enabled": False, "initial_scale_power": 8}})[0]["train.compute_dtype"] == "float32"
  with pytest.raises(UserError, match="fp16.enabled and bf16.enabled are both true"):
    values({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_optimizer_block():
  v, t = values({"optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                                           "weight_decay": 0.1}}, "gradient_clipping": 0.5})
  assert (v["optim.lr"], v["optim.b1"], v["optim.b2"], v["optim.eps"], v["optim.weight_decay"],
          v["optim.clip_norm"]) == (2e-4, 0.9, 0.95, 1e-6, 0.1, 0.5)
  assert not t.unmapped
  v, t = values({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}})
  assert v["optim.lr"] == 1e-3 and "AdamW only" in dict(t.unmapped)["optimizer.type"]


def ds_lr(kind, p, lr, s):
  """DeepSpeed's learning rate at step s ≥ warm-up (deepspeed/runtime/lr_schedules.py, as documented)."""
  warmup, top, low = p.get("warmup_num_steps", 1000), p.get("warmup_max_lr", 0.001), p.get("warmup_min_lr", 0)
  if kind == "WarmupLR":
    return top
  if kind == "WarmupDecayLR":
    return low + (top - low) * max(0.0, (p["total_num_steps"] - s) / (p["total_num_steps"] - warmup))
  ratio = (1 + math.cos(math.pi * (s - warmup + 1) / (p["total_num_steps"] - warmup))) / 2
  return lr * (p["cos_min_ratio"] + (1 - p["cos_min_ratio"]) * ratio)


@pytest.mark.parametrize("kind, params", [
    ("WarmupLR", {"warmup_max_lr": 3e-4, "warmup_num_steps": 10, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 10, "total_num_steps": 110,
                       "warmup_type": "linear"}),
    ("WarmupCosineLR", {"warmup_num_steps": 10, "total_num_steps": 110, "cos_min_ratio": 0.1,
                        "warmup_type": "linear"}),
])
def test_each_scheduler_follows_deepspeeds_curve_after_warmup(kind, params):
  ds = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "scheduler": {"type": kind, "params": params}}
  v, t = values(ds)
  assert not t.unmapped, t.unmapped
  raw = {"optim": {k.split(".", 1)[1]: x for k, x in v.items() if k.startswith("optim.")}}
  cfg = config_lib.from_dict(raw)
  steps = v.get("train.steps", 200)
  schedule = optim.schedule(cfg.optim, steps)
  for s in range(10, steps, 7):
    # the same curve; WarmupCosineLR counts its decay from step warm-up + 1, optax from warm-up: one step apart
    slope = 3e-4 * math.pi / 100
    assert abs(float(schedule(s)) - ds_lr(kind, params, 3e-4, s)) <= slope + 1e-9, (s, float(schedule(s)))
  if kind == "WarmupLR":
    assert v["optim.schedule"] == "constant" and float(schedule(150)) == pytest.approx(3e-4)


def test_log_warmup_and_unknown_keys_are_listed_not_dropped(capsys, tmp_path):
  ds = {"train_micro_batch_size_per_gpu": 2, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "wandb": {"enabled": True}, "my_custom_flag": 3, "zero_optimization": {"stage": 1, "overlap_comm": True},
        "wall_clock_breakdown": False}
  path = tmp_path / "ds.json"
  path.write_text(json.dumps(ds))
  code = from_deepspeed.main([str(path), "--gpus-per-node", "8", "--model", str(CONFIGS / "tiny-dense.yaml")])
  out, err = capsys.readouterr()
  assert code == 0
  tail = out.split("# Not translated")[1]
  for key in ("scheduler.params.warmup_type", "wandb.enabled", "my_custom_flag"):
    assert f"#   {key}:" in tail and f"not translated: {key}:" in err
  assert "#   zero_optimization.overlap_comm:" in out and "#   wall_clock_breakdown:" in out  # not needed, and why
  cfg = config_lib.from_dict(yaml.safe_load(out))
  assert cfg.train.batch_size == 16 and cfg.train.zero == 1 and cfg.model.num_hidden_layers == 2


def test_contradictory_values_exit_2_naming_them(capsys, tmp_path):
  path = tmp_path / "ds.json"
  path.write_text(json.dumps({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2,
                              "gradient_accumulation_steps": 1}))
  assert from_deepspeed.main([str(path), "--gpus-per-node", "8"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "train_batch_size=30" in err and "contradict" in err
  assert from_deepspeed.main([str(path)]) == 2
  assert "--gpus-per-node" in capsys.readouterr().err


@pytest.mark.parametrize("args,words", [
    (["model.num_hidden_layers=["], "config key model.num_hidden_layers: expected an integer, got '['"),
    (["model.num_hidden_layers"], "override 'model.num_hidden_layers' must look like section.key=value"),
    (["model.=3"], "override 'model.=3' must look like section.key=value"),
    (["model.rope_scaling.factor=3"], "must look like section.key=value, e.g. model.num_hidden_layers=8"),
    (["--model", "BINARY"], "is not text (byte 0 is not UTF-8); give a jaxseek YAML config"),
    (["--model", "BROKEN"], "is not valid YAML; fix its syntax"),
])
def test_malformed_overrides_and_files_exit_2_in_one_line(args, words, capsys, tmp_path):
  path = tmp_path / "ds.json"
  path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
  (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00model")
  (tmp_path / "broken.yaml").write_text("model: {hidden_size: 8\n")
  args = [a.replace("BINARY", str(tmp_path / "binary.yaml")).replace("BROKEN", str(tmp_path / "broken.yaml"))
          for a in args]
  assert from_deepspeed.main([str(path), "--gpus-per-node", "8", "--platform", "cpu", *args]) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and words in err, err


def test_guide_example_translates_for_67b_on_4_by_8_gpus(capsys, tmp_path):
  path = tmp_path / "ds_config.py"
  path.write_text(GUIDE)
  code = from_deepspeed.main([str(path), "--model", "deepseek-llm-67b", "--nodes", "4", "--gpus-per-node", "8",
                              "--device-memory", "h100-80g"])
  out, err = capsys.readouterr()
  assert code == 0, err
  run = tmp_path / "run.yaml"
  run.write_text(out)
  cfg = config_lib.load(run)  # the same validation as python -m jaxseek.train
  assert cfg.model.num_hidden_layers == 95 and cfg.mesh.sizes() == {
      "pipeline": 4, "data": 1, "fsdp": 8, "expert": 1, "context": 1, "tensor": 1}
  assert (cfg.train.batch_size, cfg.train.microbatches, cfg.train.compute_dtype, cfg.train.zero,
          cfg.train.optimizer_memory) == (8 * 4 * 8, 4, "float16", 3, "host")
  assert "train_micro_batch_size_per_gpu=8 × gradient_accumulation_steps=4 × data-parallel size 8" in out
  assert "zero_optimization.offload_param.device" in out.split("# Not translated")[1]
  # the explorer's memory per device for one of the 4 stages: 95 layers stored as 4 × 24 (one identity layer)
  assert "Memory per device (each of 4 pipeline stages: 24 dense layers" in " ".join(err.split())
  assert "h100-80g" in err


def test_guide_example_trains_a_tiny_model_on_8_simulated_devices(tmp_path, capsys):
  from jaxseek import train as train_lib

  path = tmp_path / "ds_config.py"
  path.write_text(GUIDE)
  model = tmp_path / "tiny.yaml"  # tiny-dense with 9 layers: 4 stages hold 3 rows each, 3 of them padding
  raw = yaml.safe_load((CONFIGS / "tiny-dense.yaml").read_text())
  raw["model"]["num_hidden_layers"] = 9
  model.write_text(yaml.safe_dump(raw))
  assert from_deepspeed.main([str(path), "--model", str(model), "--nodes", "1", "--gpus-per-node", "8",
                              "--platform", "cpu"]) == 0
  out, err = capsys.readouterr()
  assert "zero_optimization.offload_optimizer.device: host offload needs a GPU" in out
  run = tmp_path / "run.yaml"
  run.write_text(out)
  code = train_lib.main(["--config", str(run), "train.steps=4", f"train.run_dir={tmp_path / 'run'}",
                         "train.seq_len=16", "metrics.every=1"])
  assert code == 0
  records = metrics.read_jsonl(tmp_path / "run" / "metrics.jsonl")
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  assert all(np.isfinite(r["loss"]) and r["loss_scale"] == 65536.0 and r["skipped"] == 0 for r in records)
  saved = config_lib.load(tmp_path / "run" / "config.yaml")
  assert saved.mesh.pipeline == 4 and saved.mesh.fsdp == 2 and saved.train.batch_size == 64
