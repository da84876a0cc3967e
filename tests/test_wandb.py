"""Weights & Biases (metrics.wandb) for real, in W&B's offline mode: what a run wrote, read back from its
`.wandb` record file, equals metrics.jsonl; a resumed run continues the same W&B run."""

import json
import subprocess
import sys

import pytest

from conftest import CONFIGS, losses
from jaxseek import config as config_lib
from jaxseek.errors import UserError
from jaxseek.metrics import read_jsonl

BLOCK = 32768  # the record file is a LevelDB-style log: 32 KiB blocks of (crc32, length, type) chunks
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path):
  """The protobuf Records of a `.wandb` file."""
  from wandb.proto import wandb_internal_pb2 as pb

  data = path.read_bytes()
  assert data[:4] == b":W&B"
  pos, pending, out = 7, b"", []
  while pos + 7 <= len(data):
    if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
      pos += BLOCK - pos % BLOCK
      continue
    length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
    pending += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (FULL, LAST):
      record = pb.Record()
      record.ParseFromString(pending)
      out.append(record)
      pending = b""
  return out


def history(run_dir):
  """{step: {key: value}} of every history record of every offline W&B run under `run_dir`, and the runs' ids."""
  steps, ids, config = {}, set(), None
  for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
    for record in wandb_records(path):
      kind = record.WhichOneof("record_type")
      if kind == "history":
        items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
        steps.setdefault(items.pop("_step"), {}).update({k: v for k, v in items.items() if not k.startswith("_")})
      elif kind == "run":
        ids.add(record.run.run_id)
        if record.run.config.update:
          config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
  return steps, ids, config


def test_offline_wandb_run_logs_what_metrics_jsonl_holds_and_resumes_into_the_same_run(tmp_path, run_env):
  """tiny-v3 with evaluation every 2 steps, 3 steps then resumed to 5: every step's metrics (eval ones too, lists
  as name/i) in the W&B history equal metrics.jsonl's; one W&B run id (kept in the run directory); the config."""
  env = {**run_env, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
  run_dir = tmp_path / "run"
  base = [sys.executable, "-m", "jaxseek.train", "--config", str(CONFIGS / "tiny-v3.yaml"), "mesh.num_cpu_devices=2",
          "metrics.wandb=true", f"train.run_dir={run_dir}", "checkpoint.every=3", "eval.source=holdout",
          "eval.holdout=0.1", "data.source=python-stdlib", "data.max_bytes=200000", "eval.every=2"]
  for steps in (3, 5):  # the second run resumes from step 3's checkpoint
    done = subprocess.run([*base, f"train.steps={steps}"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
  assert "resumed from step 3" in done.stdout
  logged, ids, config = history(run_dir)
  assert ids == {(run_dir / "wandb_id").read_text().strip()}  # both processes wrote the same W&B run
  records = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}
  assert sorted(logged) == sorted(records) == [1, 2, 3, 4, 5]
  for step, record in records.items():
    want = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
    want.update({f"{k}/{i}": x for k, v in record.items() if isinstance(v, list) for i, x in enumerate(v)})
    assert logged[step] == pytest.approx(want), step
  assert "eval_loss" in logged[2] and "eval_loss" in logged[4]
  assert config["model"]["hidden_size"] == 40 and config["train"]["steps"] == 5  # the resolved config, resumed run
  assert losses(run_dir)[5] == records[5]["loss"]


def test_wandb_without_the_package_is_one_line(monkeypatch):
  import importlib.util

  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
  with pytest.raises(UserError, match=r'metrics.wandb: true needs the wandb package: pip install -e "\.\[wandb\]"'):
    config_lib.load(CONFIGS / "tiny-dense.yaml", ["metrics.wandb=true"])
