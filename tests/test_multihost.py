"""Real multi-process runs: 2 local processes × 4 simulated CPU devices joined by jax.distributed (gloo)."""

import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import CONFIGS, ROOT, load_config
from jaxseek.errors import UserError
from jaxseek.train import run

COMMON = ["metrics.every=1", "optim.schedule=constant", "optim.warmup_steps=2", "checkpoint.every=3"]


def losses(run_dir):
  out = {}
  for line in (run_dir / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    out[record["step"]] = record["loss"]
  return [out[s] for s in sorted(out)]


def launch(run_dir, env, *overrides, timeout=600):
  command = [sys.executable, str(ROOT / "scripts/launch_local.py"), "-n", "2", "--", sys.executable, "-m",
             "jaxseek.train", "--config", str(CONFIGS / "tiny-v3.yaml"), "mesh.num_cpu_devices=4",
             f"train.run_dir={run_dir}", *COMMON, *overrides]
  proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def reference(tmp_path, *overrides):
  run(load_config("tiny-v3", f"train.run_dir={tmp_path / 'reference'}", *COMMON, *overrides))
  return losses(tmp_path / "reference")


def test_tensor_axis_across_processes_is_refused(tmp_path, run_env):
  command = [sys.executable, str(ROOT / "scripts/launch_local.py"), "-n", "2", "--", sys.executable, "-m",
             "jaxseek.train", "--config", str(CONFIGS / "tiny-v3.yaml"), "mesh.num_cpu_devices=4",
             f"train.run_dir={tmp_path}", "mesh.data=1", "mesh.tensor=8", "model.num_attention_heads=8",
             "model.moe_intermediate_size=24"]
  proc = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  assert "mesh.tensor=8 would span processes [0, 1]" in proc.stdout and "mesh.allow_cross_host=true" in proc.stdout
  assert "on 2 nodes" in proc.stdout


def test_processes_of_one_node_may_share_a_tensor_group(monkeypatch):
  """With one process per GPU, a node's processes share its NVLink: a tensor group may span them, not nodes."""
  from types import SimpleNamespace

  from jaxseek.config import MESH_AXES
  from jaxseek.sharding import mesh as mesh_lib

  devices = [SimpleNamespace(process_index=p, id=p) for p in range(4)]  # one device per process
  grid = np.array(devices, dtype=object).reshape((1, 2, 1, 1, 1, 2))  # data 2 × tensor 2: {0, 1}, {2, 3}
  assert grid.shape == tuple(1 if a not in ("data", "tensor") else 2 for a in MESH_AXES)
  monkeypatch.setattr(mesh_lib, "_NODES", {0: 0, 1: 0, 2: 2, 3: 2})  # two nodes of two processes
  mesh_lib.check_host_local(grid)
  monkeypatch.setattr(mesh_lib, "_NODES", {0: 0, 1: 1, 2: 2, 3: 3})  # a node per process
  with pytest.raises(UserError, match=r"mesh.tensor=2 would span processes \[0, 1\] on 2 nodes"):
    mesh_lib.check_host_local(grid)


PROBE = """
import jax
from jaxseek.config import DistConfig
from jaxseek.sharding import mesh
mesh.simulate_cpu_devices(4)
assert mesh.initialize_distributed(DistConfig())
print("joined", jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
"""


def free_port():
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_slurm_environment_is_detected(run_env):
  port = str(free_port())
  procs = []
  for i in range(2):
    env = dict(run_env, SLURM_JOB_ID="42", SLURM_NTASKS="2", SLURM_PROCID=str(i), SLURM_LOCALID=str(i),
               SLURM_STEP_NODELIST="localhost", SLURM_NODELIST="localhost", JAX_COORDINATOR_PORT=port)
    procs.append(subprocess.Popen([sys.executable, "-c", PROBE], env=env, stdout=subprocess.PIPE, text=True))
  outputs = [p.communicate(timeout=120)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0]
  assert "joined 0 2 4 8" in outputs[0] and "joined 1 2 4 8" in outputs[1]


def start_pair(run_dir, env, *overrides):
  """Two training processes joined directly (not through the launcher, so each can be signalled or killed)."""
  port = free_port()
  procs = []
  for i in range(2):
    penv = dict(env, JAXSEEK_COORDINATOR=f"127.0.0.1:{port}", JAXSEEK_NUM_PROCESSES="2", JAXSEEK_PROCESS_ID=str(i))
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "jaxseek.train", "--config", str(CONFIGS / "tiny-v3.yaml"), "mesh.num_cpu_devices=4",
         f"train.run_dir={run_dir}", *overrides], env=penv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True))
  return procs


def wait_for_metrics(run_dir, procs, n):
  deadline = time.monotonic() + 300
  while not ((run_dir / "metrics.jsonl").exists() and len((run_dir / "metrics.jsonl").read_text().splitlines()) > n):
    assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
    time.sleep(0.1)


def test_a_dead_peer_ends_the_other_process(tmp_path, run_env):
  """A killed peer: the survivor exits 1, by gloo's error if a collective was reading from the closed socket,
  else by the watchdog (which of the two depends on the moment of the kill)."""
  procs = start_pair(tmp_path, run_env, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.steps=100000",
                     "metrics.every=1", "train.step_timeout_s=10")
  wait_for_metrics(tmp_path, procs, 3)
  procs[1].send_signal(signal.SIGKILL)
  killed = time.monotonic()
  out, _ = procs[0].communicate(timeout=120)
  assert procs[0].returncode == 1, out[-2000:]
  assert re.search(r"error: process 0: (UNKNOWN: Gloo .* failed: .*(reset|closed) by peer|step \d+ did not finish "
                   r"within train.step_timeout_s=10 s)", out), out[-2000:]
  assert time.monotonic() - killed < 10 + 5 + 15, out[-2000:]  # timeout + the watchdog's 5 s poll + exit


def test_a_hung_peer_is_ended_by_the_watchdog(tmp_path, run_env):
  """A stopped peer keeps its sockets open, so the survivor waits in a collective until its watchdog fires."""
  procs = start_pair(tmp_path, run_env, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.steps=100000",
                     "metrics.every=1", "train.step_timeout_s=10")
  try:
    wait_for_metrics(tmp_path, procs, 3)
    procs[1].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    out, _ = procs[0].communicate(timeout=120)
    elapsed = time.monotonic() - stopped
  finally:
    procs[1].kill()
    procs[1].communicate()
  assert procs[0].returncode == 1, out[-2000:]
  assert re.search(r"error: process 0: step \d+ did not finish within train.step_timeout_s=10 s", out), out[-2000:]
  assert 10 - 5 < elapsed < 10 + 5 + 15, (elapsed, out[-2000:])  # the last beat was a step before the stop


def test_sigterm_to_one_process_saves_the_same_step_on_both(tmp_path, run_env):
  """Data split over 2 processes, expert dispatch and tensor sums inside each. A signal that reaches one process
  only: both agree on a step, save it (each its own iterator state), exit 0, and the rerun resumes exactly: its
  losses equal one process's."""
  mesh = ["mesh.data=2", "mesh.expert=2", "mesh.tensor=2"]
  run_dir = tmp_path / "run"
  procs = start_pair(run_dir, run_env, *mesh, *COMMON, "train.steps=100000", "checkpoint.every=100000",
                     "train.step_timeout_s=60")
  try:
    wait_for_metrics(run_dir, procs, 3)
    procs[1].send_signal(signal.SIGTERM)
    procs[1].send_signal(signal.SIGTERM)  # a second signal changes nothing
    outs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
  saved = [re.findall(rf"process {i}/2: pre-empted \(.*\): saved step (\d+);", out) for i, out in enumerate(outs)]
  assert len(saved[0]) == 1 and saved[0] == saved[1], saved
  n = int(saved[0][0])
  assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()] == [str(n)]
  data = sorted(p.name for p in (run_dir / "checkpoints" / str(n) / "data").glob("process_*"))
  assert data == ["process_0-of-2.json", "process_1-of-2.json"]
  out = launch(run_dir, run_env, *mesh, f"train.steps={n + 3}", "checkpoint.every=100000")
  assert "[0] process 0/2: 4 local of 8 cpu devices" in out and "[1] process 1/2: 4 local of 8 cpu devices" in out
  assert f"resumed from step {n}" in out
  np.testing.assert_allclose(losses(run_dir), reference(tmp_path, *mesh, f"train.steps={n + 3}"), rtol=1e-5)


def test_processes_whose_compiles_end_40_s_apart_still_train(tmp_path, run_env):
  """XLA:CPU gives processes 30 s to join a Gloo communicator on a program's first run. Process 1 reaches its
  first step 40 s after process 0 here (a slow compile on a loaded machine): the step waits at a coordination
  barrier after compiling (faults.Aligned), so the run trains. Without it: `Gloo context initialization failed:
  DEADLINE_EXCEEDED` on one process, SIGABRT from the coordination service on the other."""
  late = tmp_path / "late.py"
  late.write_text("import os, sys, time\nfrom jaxseek import train\nreal = train.compile_step\n"
                  "def slow(*a, **k):\n  if os.environ['JAXSEEK_PROCESS_ID'] == '1':\n    time.sleep(40)\n"
                  "  return real(*a, **k)\ntrain.compile_step = slow\nsys.exit(train.main(sys.argv[1:]))\n")
  command = [sys.executable, str(ROOT / "scripts/launch_local.py"), "-n", "2", "--", sys.executable, str(late),
             "--config", str(CONFIGS / "tiny-v3.yaml"), "mesh.num_cpu_devices=2", "mesh.data=2", "mesh.fsdp=2",
             "train.steps=2", f"train.run_dir={tmp_path / 'run'}"]
  proc = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "done: loss" in proc.stdout and "Gloo context initialization failed" not in proc.stdout
