"""Gradient compression across resumes and loss scales: the error-feedback residuals a resumed run starts from are
the saved ones kept, zero-extended or folded as checkpoint.CarryPlan says when the data size or the method
changes (so their sum over shards is kept), PowerSGD bases are kept at the same rank, and a float16 run's
residual does not depend on the dynamic loss scale."""

import contextlib
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


def planned(rows, shards):
  """The residual rows [shards, ...] that CarryPlan says a resume onto `shards` data shards starts from, given
  the saved `rows` [old, ...]: kept (same size), zero-extended (old shard i stays shard i), or folded (old shard i
  added into new shard ⌊i · shards / old⌋)."""
  old = rows.shape[0]
  if shards >= old:
    return np.concatenate([rows, np.zeros((shards - old, *rows.shape[1:]), rows.dtype)])
  out = np.zeros((shards, *rows.shape[1:]), rows.dtype)
  for i in range(old):
    out[i * shards // old] += rows[i]
  return out


def assert_carried(got, saved, shards, method):
  """`got` (residual rows restored onto `shards` data shards under `method`) is what the plan makes of `saved`:
  nothing without compression, zeros where none were saved, else `planned` leaf by leaf."""
  if method == "none":
    assert got == {}
    return
  assert got and all(rows.shape[0] == shards for rows in got.values())
  if not saved:
    assert not any(rows.any() for rows in got.values())
    return
  assert got.keys() == saved.keys() and any(rows.any() for rows in saved.values())
  for key, rows in saved.items():
    np.testing.assert_allclose(got[key], planned(rows, shards), rtol=1e-6, atol=1e-7 * np.abs(rows).max(),
                               err_msg=key)


@contextlib.contextmanager
def carries():
  """While it lasts: the residual rows of every checkpoint saved, {step: rows}, and of every state restored,
  [(step, rows)] (what a resumed run took up, beside what was saved)."""
  saved, restored = {}, []
  save, restore = checkpoint_lib.Checkpointer.save, checkpoint_lib.Checkpointer.restore

  def saving(self, step, state, data_iterator):
    saved[step] = residual_rows(state)
    return save(self, step, state, data_iterator)

  def restoring(self, step, *args, **kwargs):
    state = restore(self, step, *args, **kwargs)
    restored.append((step, residual_rows(state)))
    return state

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(checkpoint_lib.Checkpointer, "save", saving)
    patch.setattr(checkpoint_lib.Checkpointer, "restore", restoring)
    yield saved, restored


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
  """Restored onto another data size or method, the residuals are what the plan says, so their sum over shards
  is the saved one (what the next compressed sum adds back): folded in consecutive pairs (4 → 2: old shards 0 and
  1 into 0), extended with zero shards (4 → 8: old shard i kept as shard i), kept (same size, another method),
  dropped without compression; PowerSGD's bases, absent from an int8 checkpoint, are the ones a fresh run
  draws. One line says what happened."""
  path, saved = int8_checkpoint
  cfg = load_config("tiny-dense", *mesh_of(data), f"train.grad_compression={method}", f"train.run_dir={path}")
  mesh = make_mesh(cfg)
  trainer = step_lib.make_trainer(cfg, mesh)
  state = checkpoint_lib.Checkpointer(cfg, path).restore(2, trainer.abstract_state, trainer.state_shardings, None)
  said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("resume:")]
  assert len(said) == 1 and line in said[0], said
  assert int(state.step) == 2
  got = residual_rows(state)
  assert_carried(got, saved, data, method)
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
  segment resumes from the segment's end. Every resume starts from the residuals the plan makes of the saved
  ones (`assert_carried`: the first resumed loss depends on the parameters alone, so it cannot show a wrong
  carry). Returns the losses of the chain and, at each resumed step, the loss the run that never stopped gave
  there."""
  never_stopped = {}
  with carries() as (saved, restored):
    for i, (last, overrides) in enumerate(segments):
      if i == len(segments) - 1:
        curve = run(run_dir, last, *overrides)
        break
      never_stopped[last + 1] = run(run_dir, last + 1, f"checkpoint.every={last}", *overrides)[last + 1]
      shutil.rmtree(run_dir / "checkpoints" / str(last + 1))
  assert [step for step, _ in restored] == [last for last, _ in segments[:-1]]
  for (step, rows), (_, overrides) in zip(restored, segments[1:]):
    settings = dict(o.split("=", 1) for o in overrides)
    assert_carried(rows, saved[step], int(settings["mesh.data"]), settings["train.grad_compression"])
  return curve, never_stopped


def method(name, data=2):
  return (f"train.grad_compression={name}", *mesh_of(data))


def test_resumed_runs_continue_from_the_saved_step_across_methods_and_data_sizes(tmp_path, capsys):
  """int8 on data=2 → powersgd on data=4 → none on data=2, two steps each: every resume takes the saved step,
  starts from the residuals the plan makes of the saved ones (`chain`: int8's two shards kept and two zero ones
  added; none dropped) and says so, and its first step's loss is the one the run that never stopped gave there
  (the same parameters on the same batch; 1e-5: the forward's sums in another order on another mesh).
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


def test_fold_shards_adds_each_old_shard_into_its_planned_one():
  """fold_shards on sizes that divide (a reshape: 4 → 2, 6 → 3) and that do not (segment_sum: 3 → 2, 5 → 2,
  5 → 3, 7 → 4) gives `planned`: new shard j holds the sum of the old shards i with ⌊i · new / old⌋ = j."""
  rng = np.random.default_rng(0)
  fold = jax.jit(checkpoint_lib.fold_shards, static_argnums=1)
  for old, new in ((4, 2), (6, 3), (3, 2), (5, 2), (5, 3), (7, 4)):
    rows = rng.standard_normal((old, 3, 5)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(fold(jnp.asarray(rows), new)), planned(rows, new), rtol=1e-6, atol=1e-6,
                               err_msg=f"{old} → {new}")


def test_resume_folds_data_3_into_data_2(tmp_path, capsys):
  """A PowerSGD checkpoint of data=3 × fsdp=2 (two steps: residuals on every shard) resumed by a run on data=2 ×
  fsdp=2 × tensor=2: 3 → 2 does not divide (fold_shards' segment_sum), and the run starts from old shards 0 + 1
  as shard 0 and old shard 2 as shard 1, says so, and trains on."""
  run_dir = tmp_path / "run"
  both = ("train.grad_compression=powersgd", "train.batch_size=12", "mesh.fsdp=2")
  cfg = load_config("tiny-dense", *BASE, *both, "mesh.data=3", f"train.run_dir={run_dir}")
  mesh = make_mesh(cfg, jax.devices()[:6])
  trainer, state = step_lib.init_state(cfg, mesh)
  batches = GlobalBatches(cfg, mesh)
  state, _ = run_steps(cfg, mesh, trainer, state, batches, 2)
  with carries() as (saved, restored):
    ckpt = checkpoint_lib.Checkpointer(cfg, run_dir / "checkpoints")
    ckpt.save(2, state, batches.iterator)
    ckpt.close()
    curve = run(run_dir, 3, *both, "mesh.data=2", "mesh.tensor=2")
  assert all(any(rows[i].any() for rows in saved[2].values()) for i in range(3))
  assert [step for step, _ in restored] == [2]
  assert_carried(restored[0][1], saved[2], 2, "powersgd")
  said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("resume:")]
  assert said == ["resume: the error-feedback residuals of powersgd over data=3 folded into data=2 (consecutive "
                  "shards summed: their sum is kept); the PowerSGD bases of rank 4 kept (they do not depend on the "
                  "data size)"]
  assert sorted(curve) == [3] and np.isfinite(curve[3])


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
