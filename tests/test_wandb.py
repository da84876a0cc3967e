"""Weights & Biases (metrics.wandb) for real, in W&B's offline mode: what a run wrote, read back from its
`.wandb` record file, equals metrics.jsonl; a resumed run continues the same W&B run, the steps it repeats
included. A stand-in for the wandb module checks the resumes W&B's server sees; online without a key is refused
before anything is written."""

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import CONFIGS, losses
from jaxseek import config as config_lib
from jaxseek.errors import UserError
from jaxseek import metrics as metrics_lib
from jaxseek.metrics import read_jsonl
from jaxseek.train import main

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
  """The history rows of every offline W&B run under `run_dir` (run after run, each {key: value} with W&B's _step),
  the runs' ids and the last config."""
  rows, ids, config = [], set(), None
  for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
    for record in wandb_records(path):
      kind = record.WhichOneof("record_type")
      if kind == "history":
        items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
        rows.append({k: v for k, v in items.items() if k == "_step" or not k.startswith("_")})
      elif kind == "run":
        ids.add(record.run.run_id)
        if record.run.config.update:
          config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
  return rows, ids, config


def test_offline_wandb_run_logs_what_metrics_jsonl_holds_and_resumes_into_the_same_run(tmp_path, run_env):
  """tiny-v3 with evaluation every 2 steps, 3 steps, then step 3's checkpoint removed (as if killed before it was
  saved) and resumed from step 2 to 5: every record of metrics.jsonl (step 3 twice, eval ones, lists as name/i)
  is a W&B history row in order, W&B's steps increasing across both runs; one W&B run id; the config."""
  env = {**run_env, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
  run_dir = tmp_path / "run"
  base = [sys.executable, "-m", "jaxseek.train", "--config", str(CONFIGS / "tiny-v3.yaml"), "mesh.num_cpu_devices=2",
          "metrics.wandb=true", f"train.run_dir={run_dir}", "checkpoint.every=2", "eval.source=holdout",
          "eval.holdout=0.1", "data.source=python-stdlib", "data.max_bytes=200000", "eval.every=2"]
  for steps in (3, 5):
    done = subprocess.run([*base, f"train.steps={steps}"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    shutil.rmtree(run_dir / "checkpoints" / "3", ignore_errors=True)  # the second run resumes from step 2
  assert "resumed from step 2" in done.stdout
  assert "W&B: step 3 was logged before the resume and now again, at W&B's own steps from 4" in done.stdout
  rows, ids, config = history(run_dir)
  assert ids == {(run_dir / "wandb_id").read_text().strip()}  # both processes wrote the same W&B run
  records = read_jsonl(run_dir / "metrics.jsonl")
  assert [r["step"] for r in records] == [r["step"] for r in rows] == [1, 2, 3, 3, 4, 5]
  assert [r["_step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # W&B keeps each run's rows: its steps only increase
  for record, row in zip(records, rows):
    want = {k: v for k, v in record.items() if isinstance(v, (int, float))}
    want.update({f"{k}/{i}": x for k, v in record.items() if isinstance(v, list) for i, x in enumerate(v)})
    assert {k: v for k, v in row.items() if k != "_step"} == pytest.approx(want), record["step"]
  assert "eval_loss" in rows[1] and "eval_loss" in rows[4]
  assert config["model"]["hidden_size"] == 40 and config["train"]["steps"] == 5  # the resolved config, resumed run
  assert losses(run_dir)[5] == records[-1]["loss"]


class FakeWandB:
  """Stands in for the wandb module: one history per run id that, like W&B's server, drops a record whose step is
  not above the last it holds; online, a resumed run starts after that step (offline, at 0: the server is not
  asked, and the drop happens at `wandb sync`)."""

  def __init__(self, online: bool):
    self.online, self.histories, self.metrics = online, {}, {}
    self.errors = SimpleNamespace(UsageError=type("UsageError", (Exception,), {}))

  def init(self, *, id, resume, **kwargs):
    assert resume == "allow"
    history = self.histories.setdefault(id, [])
    return SimpleNamespace(starting_step=history[-1]["_step"] + 1 if self.online and history else 0,
                           define_metric=lambda name, step_metric=None: self.metrics.update({name: step_metric}),
                           log=lambda data, step: self._log(history, data, step), finish=lambda: None)

  @staticmethod
  def _log(history, data, step):
    if not history or step > history[-1]["_step"]:
      history.append({"_step": step, **data})


@pytest.mark.parametrize("online", [True, False], ids=["online", "offline"])
def test_wandb_keeps_the_steps_a_resume_repeats(tmp_path, monkeypatch, capsys, online):
  """Killed after step 7 (saved at 5), then after step 9 (saved at 8), then to the end: W&B holds every record,
  the repeats too, at increasing steps of its own, each with its training `step` as the charts' x-axis."""
  cfg = config_lib.load(CONFIGS / "tiny-v3.yaml", ["metrics.wandb=true", "train.steps=12"])
  fake = FakeWandB(online)
  monkeypatch.setitem(sys.modules, "wandb", fake)
  runs = (range(1, 8), range(6, 10), range(9, 13))
  for steps in runs:
    writer = metrics_lib.Writer(tmp_path, cfg)
    for step in steps:
      writer.write(step, {"loss": 5.0 - step / 10, "lr": 1e-3, "grad_norm": 1.0})
  writer.close()
  (logged,) = fake.histories.values()
  assert [(r["step"], r["loss"]) for r in logged] == [(s, 5.0 - s / 10) for steps in runs for s in steps]
  assert [r["_step"] for r in logged] == list(range(1, 16))  # up to the first repeat, W&B's step is the step
  assert fake.metrics == {"step": None, "*": "step"}
  out = capsys.readouterr().out
  assert "W&B: steps 6–7 were logged before the resume and now again, at W&B's own steps from 8" in out
  assert "W&B: step 9 was logged before the resume and now again, at W&B's own steps from 12" in out


def test_wandb_without_the_package_is_one_line(monkeypatch):
  import importlib.util

  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
  with pytest.raises(UserError, match=r'metrics.wandb: true needs the wandb package: pip install -e "\.\[wandb\]"'):
    config_lib.load(CONFIGS / "tiny-dense.yaml", ["metrics.wandb=true"])


WANDB_ENV = ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL",
             "WANDB_CONFIG_DIR", "NETRC")


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch):
  """A home, working folder and environment with no W&B credentials and no W&B settings."""
  for name in WANDB_ENV:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path))
  monkeypatch.chdir(tmp_path)
  return tmp_path


def test_online_wandb_without_a_key_is_one_line_before_anything_is_written(no_wandb_login, capsys):
  run_dir = no_wandb_login / "run"
  assert main(["--config", str(CONFIGS / "tiny-v3.yaml"), "metrics.wandb=true", f"train.run_dir={run_dir}"]) == 2
  err = capsys.readouterr().err
  assert err == ("error: metrics.wandb=true logs to W&B online, but no W&B API key is set (WANDB_API_KEY, or the "
                 "netrc entry `wandb login` writes); run `wandb login`, or set WANDB_MODE=offline to log locally\n")
  assert not run_dir.exists()


NETRC_ENTRY = "machine {} login user password " + "k" * 40 + "\n"


@pytest.mark.parametrize("env,files,ok", [
    ({}, {}, False),
    ({"WANDB_MODE": "online"}, {}, False),
    ({"WANDB_MODE": "offline"}, {}, True),
    ({"WANDB_MODE": "disabled"}, {}, True),
    ({"WANDB_DISABLED": "true"}, {}, True),
    ({"WANDB_API_KEY": "k" * 40}, {}, True),
    ({"WANDB_IDENTITY_TOKEN_FILE": "token"}, {}, True),
    ({}, {".netrc": NETRC_ENTRY.format("api.wandb.ai")}, True),  # what `wandb login` writes
    ({}, {".netrc": NETRC_ENTRY.format("github.com")}, False),
    ({"NETRC": "elsewhere/netrc"}, {"elsewhere/netrc": NETRC_ENTRY.format("api.wandb.ai")}, True),
    ({"WANDB_BASE_URL": "https://wandb.example.com"}, {".netrc": NETRC_ENTRY.format("wandb.example.com")}, True),
    ({"WANDB_BASE_URL": "https://wandb.example.com"}, {".netrc": NETRC_ENTRY.format("api.wandb.ai")}, False),
    ({}, {"wandb/settings": "[default]\nmode = offline\n"}, True),  # `wandb offline` in this folder
    ({"WANDB_MODE": "online"}, {"wandb/settings": "[default]\nmode = offline\n"}, False),
    ({"WANDB_CONFIG_DIR": "conf"}, {"conf/settings": "[default]\nmode = disabled\n"}, True),
])
def test_wandb_credentials_are_looked_for_where_wandb_looks(no_wandb_login, monkeypatch, env, files, ok):
  for name, text in files.items():
    (no_wandb_login / name).parent.mkdir(parents=True, exist_ok=True)
    (no_wandb_login / name).write_text(text)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  cfg = config_lib.load(CONFIGS / "tiny-dense.yaml", ["metrics.wandb=true"])
  if ok:
    metrics_lib.check_wandb(cfg)
  else:
    with pytest.raises(UserError, match="run `wandb login`, or set WANDB_MODE=offline"):
      metrics_lib.check_wandb(cfg)
  metrics_lib.check_wandb(config_lib.load(CONFIGS / "tiny-dense.yaml"))  # metrics.wandb=false: nothing to check


def test_unknown_wandb_mode_is_one_line(no_wandb_login, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "ofline")
  with pytest.raises(UserError, match=r"WANDB_MODE=ofline is not a W&B mode \(online, offline"):
    metrics_lib.check_wandb(config_lib.load(CONFIGS / "tiny-dense.yaml", ["metrics.wandb=true"]))
