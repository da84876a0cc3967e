"""Model FLOPs against XLA's own count, and the metric outputs of a real run: Prometheus, TensorBoard, profile."""

import json
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request

import jax
import numpy as np
import pytest

from conftest import ROOT, free_port, load_config
from jaxseek import metrics as metrics_lib
from jaxseek import step as step_lib
from jaxseek.errors import UserError
from jaxseek.input import batches as batches_lib
from jaxseek.sharding.mesh import make_mesh


@pytest.mark.parametrize("attention", [["model.num_key_value_heads=4"], ["model.num_key_value_heads=2"]],
                         ids=["mha", "gqa"])
def test_flops_formula_matches_xla_cost_analysis(attention):
  """One layer, so that XLA's cost analysis (which counts a scanned loop body once) sees the whole model; seq
  64 against width 256 keeps attention's masked half (which XLA computes and the formula does not) near 2%."""
  cfg = load_config("tiny-dense", "model.hidden_size=256", "model.intermediate_size=688", "model.vocab_size=1024",
                    "model.num_attention_heads=4", "model.head_dim=64", "model.num_hidden_layers=1",
                    "train.seq_len=64", "train.batch_size=8", "mesh.data=1", *attention)
  mesh = make_mesh(cfg, jax.devices()[:1])
  trainer = step_lib.make_trainer(cfg, mesh)
  batch = {k: jax.ShapeDtypeStruct((8, 64), np.float32 if k == "loss_mask" else np.int32, sharding=s)
           for k, s in batches_lib.batch_shardings(mesh).items()}
  with jax.set_mesh(mesh):
    compiled = step_lib.compile_step(trainer, cfg, mesh).lower(trainer.abstract_state, batch).compile()
  analysis = compiled.cost_analysis()
  xla_flops = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
  formula = metrics_lib.flops_per_token(cfg, trainer.abstract_state.params) * 8 * 64
  assert abs(formula / xla_flops - 1) < 0.10, (formula, xla_flops)


def test_flops_count_only_active_experts_and_scale_with_layers(tiny_v3):
  """Routed experts count K/E of their weights; each added layer adds the same FLOPs."""
  flops = {}
  for k, layers in ((2, 3), (4, 3), (2, 4)):
    cfg = load_config("tiny-v3", f"model.num_experts_per_tok={k}", f"model.num_hidden_layers={layers}")
    flops[k, layers] = metrics_lib.flops_per_token(cfg, step_lib.make_trainer(cfg, make_mesh(cfg)).abstract_state.params)
  m = tiny_v3.model
  expert_matmuls = 3 * m.hidden_size * m.moe_intermediate_size  # gate, up, down of one expert
  moe_layers = m.num_hidden_layers - m.first_k_dense_replace
  assert flops[4, 3] - flops[2, 3] == pytest.approx(6 * 2 * expert_matmuls * moe_layers, rel=1e-9)
  per_moe_layer = flops[2, 4] - flops[2, 3]
  assert flops[2, 3] > per_moe_layer * 2 > 0


def _scrape(port: int) -> dict[str, float]:
  text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
  values = {}
  for line in text.splitlines():
    if line.startswith("jaxseek_") and "{" in line:
      name, rest = line.split("{", 1)
      values[name] = float(rest.rsplit(" ", 1)[1])
  return values


def _tensorboard_scalars(path) -> dict[str, dict[int, float]]:
  """Reads a TFRecord events file: [len u64][crc u32][Event proto][crc u32] per record."""
  from tensorboardX.proto import event_pb2

  data, out, i = path.read_bytes(), {}, 0
  while i < len(data):
    (length,) = struct.unpack("<Q", data[i:i + 8])
    event = event_pb2.Event.FromString(data[i + 12:i + 12 + length])
    i += 12 + length + 4
    for value in event.summary.value:
      out.setdefault(value.tag, {})[event.step] = value.simple_value
  return out


def test_prometheus_tensorboard_and_profile_of_a_real_run(tmp_path, run_env):
  """A run serves /metrics while it trains: step and loss there equal metrics.jsonl's; TensorBoard holds the same
  losses; the profiled steps leave a trace."""
  port, run_dir = free_port(), tmp_path / "run"
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxseek.train", "--config", str(ROOT / "configs/tiny-v3.yaml"), "train.steps=5000",
       f"train.run_dir={run_dir}", "mesh.num_cpu_devices=8", f"metrics.prometheus_port={port}",
       "metrics.tensorboard=true", "metrics.profile_steps=[2,3]"],
      env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  scraped, deadline = {}, time.time() + 240
  try:
    while time.time() < deadline and scraped.get("jaxseek_step", 0) < 4:
      assert proc.poll() is None, proc.stdout.read()
      try:
        scraped = _scrape(port)
      except OSError:
        pass
      time.sleep(0.2)
  finally:
    proc.send_signal(signal.SIGTERM)  # saves at the next step and exits 0
    out = proc.communicate(timeout=120)[0]
  assert proc.returncode == 0, out
  assert scraped.get("jaxseek_step", 0) >= 4, (scraped, out)
  records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
  step = int(scraped["jaxseek_step"])
  assert scraped["jaxseek_loss"] == records[step]["loss"]
  assert scraped["jaxseek_tokens_per_second"] == records[step]["tokens_per_sec"] > 0
  assert scraped["jaxseek_moe_load_max_over_mean"] == records[step]["moe_load_max_over_mean"] >= 1.0
  assert scraped["jaxseek_host_memory_bytes"] > 50e6
  (events,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
  scalars = _tensorboard_scalars(events)
  assert scalars["loss"] == {s: pytest.approx(r["loss"], rel=1e-6) for s, r in records.items()}
  assert len(scalars["moe_load_max_over_mean_by_layer/1"]) == len(records)
  assert list((run_dir / "profile").rglob("*.xplane.pb")), out
  assert "profile of steps 2-3 written" in out


@pytest.mark.parametrize("override, message", [
    ("metrics.profile_steps=[5]", "must be [first, last]"),
    ("metrics.profile_steps=[5,3]", "must be [first, last]"),
    ("metrics.prometheus_port=70000", "is not a port number"),
])
def test_bad_metric_settings_are_refused(override, message):
  with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
    load_config("tiny-v3", override)


def test_prometheus_port_in_use_is_a_one_line_error(tmp_path):
  with socket.socket() as busy:
    busy.bind(("", 0))
    busy.listen()
    cfg = load_config("tiny-v3", f"metrics.prometheus_port={busy.getsockname()[1]}")
    with pytest.raises(UserError, match="choose a free port"):
      metrics_lib.Writer(tmp_path, cfg)


def test_jsonl_reader_skips_a_line_being_written_and_writer_repairs_a_cut_line(tmp_path):
  """A reader racing the writer sees only whole records; a run killed mid-line leaves a partial last line, and
  the next run's writer cuts it off, so every line of the file parses after the resume."""
  path = tmp_path / "metrics.jsonl"
  sink = metrics_lib.Jsonl(path)
  sink.write(1, {"step": 1, "loss": 2.5})
  sink.write(2, {"step": 2, "loss": 2.25})
  sink.close()
  whole = path.read_bytes()
  path.write_bytes(whole + b'{"step": 3, "lo')  # killed mid-write
  assert metrics_lib.read_jsonl(path) == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}]
  sink = metrics_lib.Jsonl(path)
  assert path.read_bytes() == whole
  sink.write(3, {"step": 3, "loss": 2.0})
  sink.close()
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
  path.write_bytes(b'{"step": 1, "lo')  # a file holding only a cut line is emptied
  metrics_lib.Jsonl(path).close()
  assert path.read_bytes() == b""


def test_a_nonfinite_step_names_what_overflowed_not_always_the_learning_rate():
  """At a run's first step nothing has been updated: a non-finite loss there comes from the forward pass of finite
  parameters (float16's range, FP8 GEMMs), never from optim.lr; after finite steps the learning rate is the
  first suspect."""
  from jaxseek.metrics import nonfinite_cause

  half = load_config("tiny-v3", "train.compute_dtype=float16", "train.fp8=rowwise")
  first = nonfinite_cause(half, {"loss": float("nan"), "grad_norm": float("nan")}, first=True)
  assert first.startswith("the forward pass (the loss) overflowed at the run's first step, before any update, so "
                          "optim.lr is not the cause: float16 compute"), first
  assert "train.fp8=rowwise" in first and "lower optim.lr" not in first
  later = nonfinite_cause(load_config("tiny-v3"), {"loss": 2.0, "grad_norm": float("inf")}, first=False)
  assert later == "the backward pass (the loss was finite, its gradient is not) became non-finite after finite " \
                  "steps: lower optim.lr", later
