"""Checkpoints and faults: exact resume after SIGKILL and SIGTERM, resharding, bad steps, integrity."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CONFIGS, load_config, losses, run_steps
from jaxseek import checkpoint as checkpoint_lib
from jaxseek import train as train_lib
from jaxseek import step as step_lib
from jaxseek.errors import RunStopped, UserError
from jaxseek.input import GlobalBatches
from jaxseek.metrics import read_jsonl
from jaxseek.sharding.mesh import make_mesh

RUN = ["-m", "jaxseek.train", "--config", str(CONFIGS / "tiny-v3.yaml"), "mesh.num_cpu_devices=8",
       "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "metrics.every=1", "optim.warmup_steps=5"]


def start(run_dir, env, *extra):
  return subprocess.Popen([sys.executable, *RUN, f"train.run_dir={run_dir}", *extra], env=env, cwd=run_dir.parent,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(proc, run_dir, step, timeout=300):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    path = run_dir / "metrics.jsonl"
    if path.exists() and max(losses(run_dir), default=0) >= step:
      return
    assert proc.poll() is None, proc.stdout.read()
    time.sleep(0.05)
  raise AssertionError(f"step {step} not reached")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, run_env):
  run_dir = tmp_path_factory.mktemp("straight") / "run"
  proc = start(run_dir, run_env, "train.steps=30", "checkpoint.every=5")
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out
  return losses(run_dir)


def test_resume_after_sigkill_is_exact(tmp_path, run_env, straight_run):
  run_dir = tmp_path / "run"
  proc = start(run_dir, run_env, "train.steps=30", "checkpoint.every=5")
  wait_for_step(proc, run_dir, 20 + random.Random(os.getpid()).randrange(4))
  proc.send_signal(signal.SIGKILL)  # no handler runs: a save may be in flight
  proc.wait()
  proc = start(run_dir, run_env, "train.steps=30", "checkpoint.every=5")
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out
  resumed = int(out.split("resumed from step ")[1].split()[0])
  assert resumed >= 15 and resumed % 5 == 0, out
  after = losses(run_dir)
  assert sorted(after) == sorted(straight_run)
  assert [after[s] for s in range(resumed + 1, 31)] == [straight_run[s] for s in range(resumed + 1, 31)]  # bit for bit


def test_sigterm_saves_at_the_next_step_and_exits_zero(tmp_path, run_env, straight_run):
  run_dir = tmp_path / "run"
  proc = start(run_dir, run_env, "train.steps=30", "checkpoint.every=100")
  wait_for_step(proc, run_dir, 8)
  signalled = max(losses(run_dir))
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out
  saved = int(out.split("saved step ")[1].split(";")[0])
  assert signalled <= saved <= signalled + 3, out
  assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()] == [str(saved)]
  proc = start(run_dir, run_env, "train.steps=30", "checkpoint.every=100")
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0 and f"resumed from step {saved}" in out, out
  after = losses(run_dir)
  assert [after[s] for s in range(saved + 1, 31)] == [straight_run[s] for s in range(saved + 1, 31)]


@pytest.mark.parametrize("target", [("2", "1", "4")], ids=["fsdp2_tensor4"])
def test_checkpoint_reshards_onto_another_mesh(tmp_path, target):
  base = ["checkpoint.async_save=false", f"train.run_dir={tmp_path}"]
  cfg = load_config("tiny-v3", "mesh.data=1", "mesh.fsdp=8", *base)
  mesh = make_mesh(cfg)
  trainer, state = step_lib.init_state(cfg, mesh)
  batches = GlobalBatches(cfg, mesh)
  state, _ = run_steps(cfg, mesh, trainer, state, batches, 3)
  ckpt = checkpoint_lib.Checkpointer(cfg, tmp_path / "checkpoints")
  ckpt.save(3, state, batches.iterator)
  ckpt.close()
  _, expected = run_steps(cfg, mesh, trainer, state, batches, 2)

  fsdp, data, tensor = target
  new_cfg = load_config("tiny-v3", f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}", *base)
  new_mesh = make_mesh(new_cfg)
  new_trainer = step_lib.make_trainer(new_cfg, new_mesh)
  new_batches = GlobalBatches(new_cfg, new_mesh)
  restored = checkpoint_lib.Checkpointer(new_cfg, tmp_path / "checkpoints").restore(
      3, new_trainer.abstract_state, new_trainer.state_shardings, new_batches.iterator)
  assert int(restored.step) == 3
  leaf = jax.tree.leaves(restored.params["dense_layers"])[0]
  assert leaf.sharding.mesh.shape == new_mesh.shape
  _, got = run_steps(new_cfg, new_mesh, new_trainer, restored, new_batches, 2)
  np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in expected], rtol=1e-5)


def test_nonfinite_loss_stops_and_checkpoints_stay_finite(tmp_path):
  cfg = load_config("tiny-v3", "mesh.data=8", "optim.lr=1e4", "optim.warmup_steps=1", "optim.clip_norm=1e6",
                    "train.steps=40", "checkpoint.every=1", "checkpoint.async_save=false", f"train.run_dir={tmp_path}")
  with pytest.raises(RunStopped, match="became non-finite after finite steps: lower optim.lr; the parameters were "
                                        "not updated"):
    train_lib.run(cfg)
  records = read_jsonl(tmp_path / "metrics.jsonl")
  assert records[-1]["nonfinite"] == 1
  ckpt = checkpoint_lib.Checkpointer(cfg, tmp_path / "checkpoints", read_only=True)
  mesh = make_mesh(cfg)
  trainer = step_lib.make_trainer(cfg, mesh)
  step = ckpt.latest_step()
  assert step is not None and step < records[-1]["step"] + 1
  restored = ckpt.restore(step, trainer.abstract_state, trainer.state_shardings, None, params_only=True)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored["params"]))


def test_skip_mode_leaves_the_state_unchanged_on_bad_steps():
  """A skipped step changes nothing but the step counter, and the logged lr is the rate the optimiser used: its
  warm-up (1e-3 over 4 steps: 2.5e-4, 5e-4, ...) does not advance over the skipped step."""
  cfg = load_config("tiny-v3", "mesh.data=8", "train.on_nonfinite=skip", "optim.lr=1e-3", "optim.warmup_steps=4",
                    "train.steps=100", "optim.schedule=cosine")
  mesh = make_mesh(cfg)
  trainer, state = step_lib.init_state(cfg, mesh)
  batch = next(GlobalBatches(cfg, mesh))
  bad = dict(batch, loss_mask=batch["loss_mask"] * jnp.nan)
  before = jax.tree.map(np.asarray, state.params)
  step_fn = step_lib.compile_step(trainer, cfg, mesh)
  with jax.set_mesh(mesh):
    state, metrics = step_fn(state, bad)
    assert int(metrics["skipped"]) == 1 and int(metrics["nonfinite"]) == 1 and int(state.step) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), before)
    lrs = [float(metrics["lr"])]
    for _ in range(2):
      state, metrics = step_fn(state, batch)
      assert int(metrics["skipped"]) == 0
      lrs.append(float(metrics["lr"]))
  np.testing.assert_allclose(lrs, [2.5e-4, 2.5e-4, 5e-4], rtol=1e-6)


def test_spike_detection():
  window = jnp.asarray([2.0, 2.1, 1.9, 2.0])
  assert bool(step_lib.is_spike(jnp.asarray(3.0), window, 3.0))
  assert not bool(step_lib.is_spike(jnp.asarray(2.1), window, 3.0))
  assert not bool(step_lib.is_spike(jnp.asarray(9.0), window.at[0].set(jnp.nan), 3.0))  # window not full yet
  assert not bool(step_lib.is_spike(jnp.asarray(9.0), window, None))


def test_mismatched_and_corrupt_checkpoints_are_refused(tmp_path, run_env):
  """A resume refused for another model names the key that differs (a saved config that does not describe its
  arrays: the first array whose shape differs), and a refused or unreadable checkpoint leaves the run's
  config.yaml as it was (nothing is written before the state is restored). The unreadable one is resumed by the
  command, as a user meets it: a read that fails part-way leaves TensorStore's reads in flight in the process it
  ends, which is not this test worker's to keep."""
  cfg = load_config("tiny-v3", "mesh.data=8", "train.steps=2", "checkpoint.async_save=false",
                    f"train.run_dir={tmp_path}")
  train_lib.run(cfg)
  written = (tmp_path / "config.yaml").read_text()
  other = load_config("tiny-v3", "mesh.data=8", "model.vocab_size=272", "train.steps=4", f"train.run_dir={tmp_path}")
  with pytest.raises(UserError, match=r"model.vocab_size=264 but this run has model.vocab_size=272"):
    train_lib.run(other)
  assert (tmp_path / "config.yaml").read_text() == written
  # settings that shape the optimiser and train state: named before Orbax reads, the checkpoint never called corrupt
  for override, message in (("optim.clip_norm=0", r"optimiser state of optim.clip_norm=1.0 .* this run has "
                                                  r"optim.clip_norm=0.0.*; resume with optim.clip_norm=1.0"),
                            ("train.spike_window=8", r"train state of train.spike_window=32 \(loss_window as \(32,\) "
                                                     r"where this run has \(8,\)\) and this run has train.spike_window=8")):
    changed = load_config("tiny-v3", "mesh.data=8", "train.steps=4", f"train.run_dir={tmp_path}", override)
    with pytest.raises(UserError, match=message) as refused:
      train_lib.run(changed)
    assert "incomplete or corrupt" not in str(refused.value) and "delete" not in str(refused.value)
    assert (tmp_path / "config.yaml").read_text() == written
  # kernels and exchanges are free: a clip norm that keeps clipping, another dispatch and attention kernel resume
  checkpoint_lib.Checkpointer(load_config("tiny-v3", "mesh.data=8", "optim.clip_norm=0.5", "model.moe_dispatch=fixed",
                                          "model.attention_impl=dense", "model.moe_recv_factor=3",
                                          "model.moe_matmul=ragged_dot"), tmp_path, read_only=True).check_compatible(2)
  saved = tmp_path / "checkpoints" / "2" / "config" / "metadata"  # a saved config that does not describe the arrays
  kept = saved.read_text()
  saved.write_text(json.dumps({**json.loads(kept), "model": {**json.loads(kept)["model"], "vocab_size": 272}}))
  trainer = step_lib.make_trainer(other, make_mesh(other))
  with pytest.raises(UserError, match=r"holds params embed/table_VD as \(264, 40\) where this model has \(272, 40\)"):
    checkpoint_lib.Checkpointer(other, tmp_path).restore(2, trainer.abstract_state, trainer.state_shardings, None)
  saved.write_text(kept)
  older = json.loads(kept)  # written before model.num_nextn_predict_layers existed: the run had its default, 0
  del older["model"]["num_nextn_predict_layers"]
  saved.write_text(json.dumps(older))
  checkpoint_lib.Checkpointer(cfg, tmp_path, read_only=True).check_compatible(2)
  with pytest.raises(UserError, match=r"written for model.num_nextn_predict_layers=0 but this run has model.num_nex"):
    checkpoint_lib.Checkpointer(load_config("tiny-v3", "mesh.data=8", "model.num_nextn_predict_layers=1"), tmp_path,
                                read_only=True).check_compatible(2)
  saved.write_text(kept)
  (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp").mkdir()  # a save that never finished
  assert checkpoint_lib.Checkpointer(cfg, tmp_path, read_only=True).latest_step() == 2
  for path in (tmp_path / "checkpoints" / "2" / "state").rglob("*"):
    if path.is_file() and path.stat().st_size > 0 and "zarray" not in path.name:
      path.write_bytes(b"garbage")
  out = subprocess.run([sys.executable, "-m", "jaxseek.train", "--config", str(CONFIGS / "tiny-v3.yaml"),
                        "mesh.num_cpu_devices=8", "mesh.data=8", "train.steps=4", f"train.run_dir={tmp_path}"],
                       env=run_env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr[-3000:]
  assert re.search("cannot be restored|corrupt", out.stderr) and "delete" not in out.stderr, out.stderr
  assert (tmp_path / "config.yaml").read_text() == written


# A run whose checkpoints/ folder becomes unwritable before the save of step 3 (chattr +i: root, as CI runs,
# ignores permission bits), once step 2's save has finished (`wait`) or while it may still be written. `check`
# false: jaxseek's own check before a save is off, so the failure is Orbax's.
UNWRITABLE_RUN = """
import subprocess, sys
from jaxseek import checkpoint, train
real_save, check, wait = checkpoint.Checkpointer.save, {check}, {wait}
def save(self, step, state, iterator):
  if step == 3:
    if wait:
      self.manager.wait_until_finished()
    subprocess.run(["chattr", "+i", str(self.directory)], check=True)
  return real_save(self, step, state, iterator)
checkpoint.Checkpointer.save = save
if not check:
  checkpoint.check_writable = lambda *a: None
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("check, wait", [(True, True), (False, True), (True, False)],
                         ids=["checked", "orbax", "in-flight"])
def test_a_save_that_fails_ends_the_run_with_one_line_and_keeps_the_saved_steps(check, wait, tmp_path, run_env):
  """A checkpoints/ folder that becomes unwritable mid-run: the run ends within seconds with one line and a
  non-zero status (Orbax's background folder-making thread, failing, used to leave the save waiting for ever),
  and the steps already committed stay and resume. A save still being written when the folder turns (in-flight)
  fails in Orbax's background thread: said once, at the next save or at the end, without Orbax's traceback."""
  run_dir = tmp_path / "run"
  args = [*RUN[2:], "train.steps=6", "checkpoint.every=1", f"train.run_dir={run_dir}"]
  try:
    out = subprocess.run([sys.executable, "-c", UNWRITABLE_RUN.format(check=check, wait=wait), *args],
                         env=run_env, capture_output=True, text=True, timeout=240)
  finally:
    subprocess.run(["chattr", "-i", str(run_dir / "checkpoints")], check=False)
  # (a test session's compilation cache may warn that an entry was removed under it: not the run's output)
  lines = [l for l in out.stderr.splitlines() if not (l.startswith("WARNING") or "Warning:" in l or
                                                      l.strip() == "warnings.warn(")]
  assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
  assert lines[0].startswith("error: checkpoint: saving step") and "Operation not permitted" in lines[0], lines[0]
  kept = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
  assert kept == [1, 2] if wait else kept in ([1], [1, 2]), kept
  assert f"the committed steps {kept} are kept" in lines[0], lines[0]
  if wait:
    assert ("saving step 3" in lines[0]) and ("cannot write into" in lines[0]) == check, lines[0]
  resumed = subprocess.run([sys.executable, *RUN, "train.steps=3", f"train.run_dir={run_dir}"], env=run_env,
                           capture_output=True, text=True, timeout=240)
  assert resumed.returncode == 0 and f"resumed from step {kept[-1]}" in resumed.stdout, resumed.stderr[-3000:]


def test_an_unwritable_checkpoints_folder_is_refused_before_anything_is_written(tmp_path):
  (tmp_path / "checkpoints").mkdir()
  subprocess.run(["chattr", "+i", str(tmp_path / "checkpoints")], check=True)
  try:
    with pytest.raises(UserError, match=rf"train.run_dir={tmp_path}: cannot write into {tmp_path}/checkpoints "
                                        r"\(Operation not permitted\); make it writable"):
      train_lib.run(load_config("tiny-v3", "mesh.data=8", "train.steps=1", f"train.run_dir={tmp_path}"))
  finally:
    subprocess.run(["chattr", "-i", str(tmp_path / "checkpoints")], check=True)
  assert [p.name for p in tmp_path.iterdir()] == ["checkpoints"]


@pytest.fixture(scope="module")
def truncated_run(tmp_path_factory):
  """A run directory whose checkpoint's array store was cut short (its OCDBT manifest halved)."""
  run_dir = tmp_path_factory.mktemp("truncated") / "run"
  train_lib.run(load_config("tiny-v3", "mesh.data=8", "train.steps=1", "checkpoint.async_save=false",
                            f"train.run_dir={run_dir}"))
  manifest = run_dir / "checkpoints" / "1" / "state" / "manifest.ocdbt"
  manifest.write_bytes(manifest.read_bytes()[:manifest.stat().st_size // 2])
  return run_dir


@pytest.mark.parametrize("command, repeats", [
    (["-m", "jaxseek.generate", "--tokenizer", "byte", "--prompt", "a", "--max-new-tokens", "1"], 3),
    (["-m", "jaxseek.train", "--config", str(CONFIGS / "tiny-v3.yaml"), "mesh.num_cpu_devices=8",
      "train.steps=2"], 2)], ids=["generate", "train"])
def test_truncated_checkpoint_ends_in_one_line(truncated_run, run_env, command, repeats):
  """A checkpoint cut short ends the command with one line on stderr and exit status 2, every time: the reads
  still in flight when Orbax gives up find its event loop closed, and their tracebacks (printed at random
  moments, up to the interpreter's exit) are silenced."""
  where = [f"train.run_dir={truncated_run}"] if "jaxseek.train" in command else ["--checkpoint", str(truncated_run)]
  for _ in range(repeats):
    out = subprocess.run([sys.executable, *command, *where], env=run_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr[-3000:]
    assert out.stderr.startswith("error: checkpoint ") and "corrupt" in out.stderr, out.stderr
