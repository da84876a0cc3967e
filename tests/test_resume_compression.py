"""Gradient compression across resumes and loss scales: the error-feedback residuals keep their sum over shards
when the data size or the method changes (checkpoint.CarryPlan), PowerSGD bases are kept at the same rank, and
a float16 run's residual does not depend on the dynamic loss scale."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config, losses, run_steps
from jaxseek import checkpoint as checkpoint_lib
from jaxseek import step as step_lib
from jaxseek import train as train_lib
from jaxseek.input import GlobalBatches
from jaxseek.sharding import compression
from jaxseek.sharding.mesh import make_mesh


def mesh_of(data):
  return [f"mesh.data={data}", f"mesh.fsdp={8 // data}"]


def copied(state):
  """A copy of `state` (the step donates its argument)."""
  return jax.tree.map(lambda x: x.copy(), state)


def test_compressed_residual_is_invariant_to_the_loss_scale():
  """The same int8 step from the same state (a non-zero residual) under the loss scales 2^10 and 2^11 gives the
  same residual and the same parameters: each shard's gradient is unscaled before its residual is added. (Kept
  in scaled units, the residual came out twice as large under 2^11, and the sum divided by the scale weighed the
  carried residual half as much: float16's dynamic scale changing made the stale residual count ×2 or ×0.5.)
  The step multiplies the objective by `state.loss_scale` and divides by it the same way whatever the compute
  dtype; float32 compute makes the scaled gradients exactly scale-equivariant (float16's own rounding near
  underflow would blur the comparison by a quantisation step here and there), so the two agree to rounding."""
  cfg = load_config("tiny-dense", *mesh_of(2), "train.grad_compression=int8", "optim.warmup_steps=1")
  mesh = make_mesh(cfg)
  trainer, state = step_lib.init_state(cfg, mesh)
  batches = GlobalBatches(cfg, mesh)
  step_fn = step_lib.compile_step(trainer, cfg, mesh)
  with jax.set_mesh(mesh):
    state, _ = step_fn(state.replace(loss_scale=jnp.float32(2.0 ** 10)), next(batches))
    batch = next(batches)
    after = [jax.device_get(step_fn(copied(state).replace(loss_scale=jnp.float32(2.0 ** k)), batch))
             for k in (10, 11)]
  residuals = [np.concatenate([np.ravel(x) for x in jax.tree.leaves(s.grad_residual)]) for s, _ in after]
  assert all(int(m["skipped"]) == 0 for _, m in after)
  assert np.abs(residuals[0]).max() > 0
  np.testing.assert_allclose(residuals[1], residuals[0], rtol=1e-6, atol=1e-6 * np.abs(residuals[0]).max())
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7), after[0][0].params,
               after[1][0].params)


def residual_rows(state):
  """{parameter path: its residual [shards, ...]} on the host."""
  pure = checkpoint_lib.to_pure(state.grad_residual)
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(pure)}


@pytest.fixture(scope="module")
def int8_checkpoint(tmp_path_factory):
  """A checkpoint after two int8 steps on data=4 (non-zero residuals): its folder and its residual rows."""
  path = tmp_path_factory.mktemp("int8")
  cfg = load_config("tiny-dense", *mesh_of(4), "train.grad_compression=int8", f"train.run_dir={path}")
  mesh = make_mesh(cfg)
  trainer, state = step_lib.init_state(cfg, mesh)
  batches = GlobalBatches(cfg, mesh)
  state, _ = run_steps(cfg, mesh, trainer, state, batches, 2)
  ckpt = checkpoint_lib.Checkpointer(cfg, path / "checkpoints")
  ckpt.save(2, state, batches.iterator)
  ckpt.close()
  return path, residual_rows(state)


@pytest.mark.parametrize("data, method, line", [
    (2, "int8", "int8 over data=4 folded into data=2"),
    (8, "bf16", "int8 over data=4 carried into data=8"),
    (4, "powersgd", "int8 over data=4 kept for powersgd; fresh PowerSGD bases of rank 4"),
    (4, "none", "int8 over data=4 dropped (train.grad_compression=none now)"),
], ids=["fold-4-to-2", "extend-4-to-8", "kept-for-powersgd", "dropped"])
def test_restore_keeps_the_residual_sum_across_data_sizes_and_methods(int8_checkpoint, capsys, data, method, line):
  """Restored onto another data size or method, the residuals' sum over shards is the saved one (what the next
  compressed sum adds back): folded in consecutive pairs (4 → 2), extended with zero shards (4 → 8), kept (same
  size, another method), dropped without compression; PowerSGD's bases, absent from an int8 checkpoint, are the
  ones a fresh run draws. One line says what happened."""
  path, saved = int8_checkpoint
  cfg = load_config("tiny-dense", *mesh_of(data), f"train.grad_compression={method}", f"train.run_dir={path}")
  mesh = make_mesh(cfg)
  trainer = step_lib.make_trainer(cfg, mesh)
  state = checkpoint_lib.Checkpointer(cfg, path).restore(2, trainer.abstract_state, trainer.state_shardings, None)
  said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("resume:")]
  assert len(said) == 1 and line in said[0], said
  assert int(state.step) == 2
  got = residual_rows(state)
  if method == "none":
    assert got == {}
    return
  assert got.keys() == saved.keys()
  for key, rows in saved.items():
    assert got[key].shape == (data, *rows.shape[1:])
    np.testing.assert_allclose(got[key].sum(0), rows.sum(0), rtol=1e-6, atol=1e-7 * np.abs(rows).max())
    if data > rows.shape[0]:  # old shard i kept as shard i
      np.testing.assert_array_equal(got[key][:rows.shape[0]], rows)
      assert not got[key][rows.shape[0]:].any()
  if method == "powersgd":
    fresh = jax.device_get(compression.init_basis(trainer.abstract_state.params, 4, cfg.train.seed))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.grad_basis), fresh)



BASE = ("data.source=python-stdlib", "train.batch_size=8", "optim.warmup_steps=2", "optim.schedule=constant",
        "checkpoint.async_save=false")  # the learning rate at a step does not depend on train.steps


def run(run_dir, last, *overrides):
  """Trains tiny-dense on text up to step `last` in `run_dir` (resuming what is there); its loss per step."""
  train_lib.run(load_config("tiny-dense", *BASE, f"train.run_dir={run_dir}", f"train.steps={last}", *overrides))
  return losses(run_dir)


def chain(run_dir, segments):
  """Trains `segments` [(last step, overrides)] one after the other in `run_dir`. Each segment's run goes one step
  past its end (the run that never stopped there) and its checkpoint of that step is deleted, so the next
  segment resumes from the segment's end. Returns the losses of the chain and, at each resumed step, the loss
  the run that never stopped gave there."""
  never_stopped = {}
  for i, (last, overrides) in enumerate(segments):
    if i == len(segments) - 1:
      return run(run_dir, last, *overrides), never_stopped
    never_stopped[last + 1] = run(run_dir, last + 1, f"checkpoint.every={last}", *overrides)[last + 1]
    shutil.rmtree(run_dir / "checkpoints" / str(last + 1))


def method(name, data=2):
  return (f"train.grad_compression={name}", *mesh_of(data))


def test_resumed_runs_continue_from_the_saved_step_across_methods_and_data_sizes(tmp_path, capsys):
  """int8 on data=2 → powersgd on data=4 → none on data=2, two steps each: every resume takes the saved step
  and says what became of the residuals, and its first step's loss is the one the run that never stopped gave
  there (the same parameters on the same batch; 1e-5: the forward's sums in another order on another mesh).
  The longer chains and their loss curves: the two tests below (slow)."""
  curve, never_stopped = chain(tmp_path / "run", [(2, method("int8")), (4, method("powersgd", 4)),
                                                  (6, method("none"))])
  said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("resume:", "resumed from"))]
  assert len(said) == 4, said
  assert said[0].startswith("resume: the error-feedback residuals of int8 over data=2 carried into data=4")
  assert said[0].endswith("; fresh PowerSGD bases of rank 4")
  assert said[1] == f"resumed from step 2 ({tmp_path / 'run' / 'checkpoints' / '2'})"
  assert said[2] == ("resume: the error-feedback residuals of powersgd over data=4 dropped (train.grad_compression=none "
                     "now): the gradient they still held back is lost; the PowerSGD bases of rank 4 dropped")
  assert said[3] == f"resumed from step 4 ({tmp_path / 'run' / 'checkpoints' / '4'})"
  assert sorted(curve) == list(range(1, 7))
  for step, loss in never_stopped.items():
    np.testing.assert_allclose(curve[step], loss, rtol=1e-5)


@pytest.fixture(scope="module")
def never_stopped_runs(tmp_path_factory):
  """12 steps on data=2 that never stopped: uncompressed (the exact sum), int8 and powersgd."""
  root = tmp_path_factory.mktemp("never-stopped")
  return {name: run(root / name, 12, *method(name)) for name in ("none", "int8", "powersgd")}


def quantisation(runs, methods):
  """Per step, how far the never-stopped runs of `methods` (each step's list) are from the uncompressed one:
  what the quantisation of the methods in use so far has moved the loss."""
  return {s: max([abs(runs[m][s] - runs["none"][s]) for m in ms], default=0.0) for s, ms in methods.items()}


def methods_before(segments):
  """Per step s, the compression methods of the steps before it: they moved the parameters s's loss is taken at."""
  of_step, first = {}, 1
  for last, overrides in segments:
    of_step.update({t: overrides[0].split("=")[1] for t in range(first, last + 1)})
    first = last + 1
  return {s: sorted({of_step[t] for t in range(1, s)} - {"none"}) for s in of_step}


def assert_curve(curve, reference, quantised):
  """Each step within 2 q + 1e-5 of `reference`, q the quantisation of the methods in use so far: a resumed run
  and the reference are each within q of the exact run, so within 2 q of each other; 1e-5 for the forward's sums
  in another order on another mesh."""
  for s, loss in curve.items():
    assert abs(loss - reference[s]) <= 2 * quantised[s] + 1e-5, (s, loss, reference[s], quantised[s])


@pytest.mark.slow
def test_resume_int8_none_powersgd_none_follows_the_run_that_never_stopped(tmp_path, never_stopped_runs):
  """int8 → none → powersgd → none, three steps each on data=2: each resumed run starts at the saved step with
  the loss the run that never stopped gave there, and the whole curve stays within the quantisation of the
  methods used so far of the uncompressed run that never stopped."""
  segments = [(3, method("int8")), (6, method("none")), (9, method("powersgd")), (12, method("none"))]
  curve, never_stopped = chain(tmp_path / "run", segments)
  assert sorted(curve) == list(range(1, 13))
  for step, loss in never_stopped.items():
    np.testing.assert_allclose(curve[step], loss, rtol=1e-5)
  assert_curve(curve, never_stopped_runs["none"], quantisation(never_stopped_runs, methods_before(segments)))


@pytest.mark.slow
def test_resume_powersgd_over_data_2_4_2_follows_the_run_that_never_stopped(tmp_path, never_stopped_runs):
  """powersgd on data=2 → 4 → 2, four steps each: each resumed run starts at the saved step with the loss the
  run that never stopped gave there, and the curve stays within twice PowerSGD's own quantisation of the
  powersgd run on data=2 that never stopped (bases kept, residuals carried and folded)."""
  segments = [(4, method("powersgd")), (8, method("powersgd", 4)), (12, method("powersgd"))]
  curve, never_stopped = chain(tmp_path / "run", segments)
  assert sorted(curve) == list(range(1, 13))
  for step, loss in never_stopped.items():
    np.testing.assert_allclose(curve[step], loss, rtol=1e-5)
  assert_curve(curve, never_stopped_runs["powersgd"], quantisation(never_stopped_runs, methods_before(segments)))
