"""Pipeline parallelism (GPipe over the `pipeline` axis) against the single-device run."""

import functools
import re

import jax
import numpy as np
import pytest

from conftest import load_config
from jaxseek import checkpoint as checkpoint_lib
from jaxseek import train as train_lib
from jaxseek.errors import UserError
from jaxseek.input import GlobalBatches, global_batches
from jaxseek.sharding import pipeline
from jaxseek.sharding.mesh import make_mesh

STEPS = 5


def run(name, overrides, devices=None, steps=STEPS):
  cfg = load_config(name, *overrides)
  mesh = make_mesh(cfg, devices)
  trainer, state = train_lib.init_state(cfg, mesh)
  step_fn = train_lib.compile_step(trainer, cfg, mesh)
  batches = global_batches(cfg, mesh)
  out = []
  with jax.set_mesh(mesh):
    for _ in range(steps):
      state, metrics = step_fn(state, next(batches))
      out.append((float(metrics["loss"]), float(metrics["grad_norm"])))
  return np.array(out)


@functools.lru_cache(maxsize=None)
def single_device(name, layers):
  return run(name, ("mesh.data=1", f"model.num_hidden_layers={layers}"), jax.devices()[:1])


@pytest.mark.parametrize("name, layers, mesh, micro", [
    ("tiny-dense", 4, ("mesh.pipeline=2", "mesh.data=4"), 4),
    ("tiny-dense", 4, ("mesh.pipeline=4", "mesh.data=2"), 8),
    ("tiny-v3", 3, ("mesh.pipeline=2", "mesh.data=4"), 4),   # 1 dense layer on every stage, 2 MoE layers piped
    ("tiny-v3", 5, ("mesh.pipeline=4", "mesh.data=2"), 8),
    ("tiny-v3", 5, ("mesh.pipeline=2", "mesh.data=2", "mesh.tensor=2"), 8),
    ("tiny-v3", 3, ("mesh.pipeline=2", "mesh.data=1", "mesh.expert=2", "mesh.tensor=2"), 4),
    ("tiny-v3", 3, ("mesh.pipeline=2", "mesh.data=4", "train.remat=full"), 4),
], ids=["dense-p2-m4", "dense-p4-m8", "v3-p2-m4", "v3-p4-m8", "v3-p2d2t2-m8", "v3-p2e2t2-m4", "v3-p2-remat"])
def test_pipelined_training_equals_single_device(name, layers, mesh, micro):
  """Losses and gradient norms over 5 steps (so MoE correction biases, updated from the loads the pipeline
  gathers, matter too) equal the single-device run."""
  got = run(name, (*mesh, f"train.microbatches={micro}", f"model.num_hidden_layers={layers}"))
  np.testing.assert_allclose(got, single_device(name, layers), rtol=1e-5)


def compiled_text(*overrides):
  cfg = load_config("tiny-v3", *overrides)
  mesh = make_mesh(cfg)
  trainer = train_lib.make_trainer(cfg, mesh)
  batches = global_batches(cfg, mesh)
  with jax.set_mesh(mesh):
    return train_lib.compile_step(trainer, cfg, mesh).lower(trainer.abstract_state, next(batches)).compile().as_text()


def test_compiled_step_passes_activations_with_collective_permute():
  piped = compiled_text("mesh.pipeline=2", "mesh.data=4", "train.microbatches=4")
  flat = compiled_text("mesh.data=8")
  count = lambda text: len(re.findall(r"= \S+ collective-permute(?:-start)?\(", text))
  assert count(piped) >= 2  # forward and backward
  assert count(flat) == 0


def test_layer_stacks_are_split_into_stages():
  cfg = load_config("tiny-v3", "mesh.pipeline=2", "mesh.data=4", "train.microbatches=4")
  trainer = train_lib.make_trainer(cfg, make_mesh(cfg))
  moe_spec = jax.tree.leaves(trainer.state_shardings.params["moe_layers"])[0].spec
  dense_spec = jax.tree.leaves(trainer.state_shardings.params["dense_layers"])[0].spec
  assert moe_spec[0] == "pipeline"  # 2 MoE layers: one per stage
  assert dense_spec[0] is None  # 1 dense layer: on every stage
  assert pipeline.bubble_fraction(2, 4) == pytest.approx(1 / 5)
  summary = pipeline.summary(cfg, 2)
  assert "bubble (S-1)/(M+S-1) = 20.0%" in summary and "MoE stack 1 layers per stage" in summary
  assert "dense stack (1 layers) on every stage" in summary


def test_pipeline_that_divides_no_stack_is_refused():
  cfg = load_config("tiny-v3", "mesh.pipeline=4", "mesh.data=2")
  with pytest.raises(UserError, match="mesh.pipeline: 4 divides neither layer stack"):
    train_lib.make_trainer(cfg, make_mesh(cfg))


@pytest.mark.parametrize("before, after", [(("mesh.pipeline=2", "mesh.data=4"), ("mesh.data=4", "mesh.tensor=2")),
                                           (("mesh.data=4", "mesh.tensor=2"), ("mesh.pipeline=2", "mesh.data=4"))],
                         ids=["p2-to-p1", "p1-to-p2"])
def test_checkpoint_moves_between_pipelined_and_flat_meshes(tmp_path, before, after):
  base = ("checkpoint.async_save=false", f"train.run_dir={tmp_path}", "train.microbatches=4")
  cfg = load_config("tiny-v3", *before, *base)
  mesh = make_mesh(cfg)
  trainer, state = train_lib.init_state(cfg, mesh)
  batches = GlobalBatches(cfg, mesh)
  step_fn = train_lib.compile_step(trainer, cfg, mesh)
  with jax.set_mesh(mesh):
    for _ in range(2):
      state, _ = step_fn(state, next(batches))
  ckpt = checkpoint_lib.Checkpointer(cfg, tmp_path / "checkpoints")
  ckpt.save(2, state, batches.iterator)
  ckpt.close()
  expected = []
  with jax.set_mesh(mesh):
    for _ in range(2):
      state, metrics = step_fn(state, next(batches))
      expected.append(float(metrics["loss"]))

  new_cfg = load_config("tiny-v3", *after, *base)
  new_mesh = make_mesh(new_cfg)
  new_trainer = train_lib.make_trainer(new_cfg, new_mesh)
  new_batches = GlobalBatches(new_cfg, new_mesh)
  restored = checkpoint_lib.Checkpointer(new_cfg, tmp_path / "checkpoints").restore(
      2, new_trainer.abstract_state, new_trainer.state_shardings, new_batches.iterator)
  new_step = train_lib.compile_step(new_trainer, new_cfg, new_mesh)
  got = []
  with jax.set_mesh(new_mesh):
    for _ in range(2):
      restored, metrics = new_step(restored, next(new_batches))
      got.append(float(metrics["loss"]))
  np.testing.assert_allclose(got, expected, rtol=1e-5)
