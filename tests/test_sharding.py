"""Sharding invariance against the single-device run, the collectives each mesh implies, one compilation."""

import re

import jax
import numpy as np
import pytest

from conftest import load_config, run_steps
from jaxseek import step as step_lib
from jaxseek.input import global_batches
from jaxseek.sharding.mesh import make_mesh

MESHES = {"fsdp8": (1, 8, 1), "d2f2t2": (2, 2, 2), "f2t4": (1, 2, 4)}  # data alone: tests/test_moe.py's expert1
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


def mesh_overrides(data, fsdp, tensor):
  return [f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}"]


def train_on(cfg, devices, steps=3):
  """Losses, gradient norms and final MoE biases of `steps` training steps on `devices`."""
  mesh = make_mesh(cfg, devices)
  trainer, state = step_lib.init_state(cfg, mesh)
  state, records = run_steps(cfg, mesh, trainer, state, global_batches(cfg, mesh), steps)
  biases = [np.asarray(b) for b in jax.tree.leaves(state.biases)]
  return np.array([r["loss"] for r in records]), np.array([r["grad_norm"] for r in records]), biases


@pytest.fixture(scope="module")
def single_device_run():
  cfg = load_config("tiny-v3", *mesh_overrides(1, 1, 1))
  return train_on(cfg, jax.devices()[:1])


@pytest.mark.parametrize("name", MESHES)
def test_sharded_training_equals_single_device(name, single_device_run):
  cfg = load_config("tiny-v3", *mesh_overrides(*MESHES[name]))
  losses, norms, biases = train_on(cfg, jax.devices())
  ref_losses, ref_norms, ref_biases = single_device_run
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
  assert len(biases) == len(ref_biases) == 1
  np.testing.assert_allclose(biases[0], ref_biases[0], rtol=1e-5, atol=1e-7)
  assert np.abs(ref_biases[0]).max() > 0  # the correction bias did move


def test_microbatch_accumulation_equals_full_batch():
  full = train_on(load_config("tiny-v3", *mesh_overrides(2, 2, 2)), jax.devices(), steps=2)
  accumulated = train_on(load_config("tiny-v3", *mesh_overrides(2, 2, 2), "train.microbatches=2"),
                         jax.devices(), steps=2)
  np.testing.assert_allclose(accumulated[0], full[0], rtol=1e-5)
  np.testing.assert_allclose(accumulated[1], full[1], rtol=1e-5)
  np.testing.assert_allclose(accumulated[2][0], full[2][0], rtol=1e-5, atol=1e-7)


def compiled_text(cfg):
  mesh = make_mesh(cfg)
  trainer, state = step_lib.init_state(cfg, mesh)
  step_fn = step_lib.compile_step(trainer, cfg, mesh)
  batch = next(global_batches(cfg, mesh))
  with jax.set_mesh(mesh):
    return step_fn.lower(state, batch).compile().as_text()


def collectives(text):
  counts = {}
  for m in COLLECTIVE.finditer(text):
    counts[m.group(1)] = counts.get(m.group(1), 0) + 1
  return counts


def all_gather_shapes(text):
  return set(re.findall(r"= (f32\[[\d,]+\])[^=]*? all-gather(?:-start)?\(", text))


def test_fsdp_all_gathers_weights_and_all_reduces_gradients():
  cfg = load_config("tiny-v3", *mesh_overrides(1, 8, 1))
  text = compiled_text(cfg)
  counts = collectives(text)
  assert counts.get("all-gather", 0) > 0 and counts.get("all-reduce", 0) > 0, counts
  # The dense MLP weight W_gate[D_fsdp, F] is gathered whole for its layer: [layers, D, F] or one layer [D, F].
  m = cfg.model
  shapes = all_gather_shapes(text)
  assert {f"f32[{m.hidden_size},{m.intermediate_size}]", f"f32[1,{m.hidden_size},{m.intermediate_size}]"} & shapes, shapes


def test_tensor_parallel_all_reduces_partial_sums_and_data_parallel_gathers_nothing():
  tensor = collectives(compiled_text(load_config("tiny-v3", *mesh_overrides(2, 1, 4))))
  data = collectives(compiled_text(load_config("tiny-v3", *mesh_overrides(8, 1, 1))))
  assert tensor.get("all-reduce", 0) > data.get("all-reduce", 0) > 0, (tensor, data)
  assert data.get("all-gather", 0) == 0, data
  assert "all-to-all" not in tensor and "all-to-all" not in data


def test_step_compiles_once(monkeypatch):
  traces = []
  original = step_lib.train_step

  def counting(*args):
    traces.append(1)
    return original(*args)

  monkeypatch.setattr(step_lib, "train_step", counting)
  cfg = load_config("tiny-v3", *mesh_overrides(2, 2, 2))
  mesh = make_mesh(cfg)
  trainer, state = step_lib.init_state(cfg, mesh)
  step_fn = step_lib.compile_step(trainer, cfg, mesh)
  batches = global_batches(cfg, mesh)
  with jax.set_mesh(mesh):
    for _ in range(4):
      state, _ = step_fn(state, next(batches))
  assert len(traces) == 1
  assert step_fn._cache_size() == 1


def gradient_sums(*overrides):
  """Bytes per device per step of the all-reduces over batch axes in the compiled step, each loop body weighted
  by its trip count, by the axes they span."""
  from jaxseek.explore import compile as explore_compile

  cfg = load_config("tiny-v3", *overrides)
  mesh = make_mesh(cfg)
  trainer = step_lib.make_trainer(cfg, mesh)
  with jax.set_mesh(mesh):
    text = step_lib.compile_step(trainer, cfg, mesh).lower(
        trainer.abstract_state, explore_compile.abstract_batch(cfg, mesh)).compile().as_text()
  sums = explore_compile.collective_bytes(text, tuple(mesh.devices.shape)).get("all-reduce", {})
  return {axes: b for axes, b in sums.items() if set(axes.split("+")) & {"data", "expert"}}


@pytest.mark.parametrize("mesh, micro", [
    (("mesh.data=2", "mesh.expert=2", "mesh.tensor=2"), (1, 4)),
    (("mesh.pipeline=2", "mesh.data=2", "mesh.expert=2", "model.num_hidden_layers=5",
      "train.pipeline_schedule=1f1b"), (2, 4)),
], ids=["d2e2t2-accumulated", "p2d2e2-1f1b"])
def test_gradients_are_summed_over_data_and_expert_once_per_step(mesh, micro):
  """More microbatches (a longer scan, more schedule ticks) add no gradient all-reduce over data or expert: the
  sums follow the loop (sharding/gradsum.py)."""
  few, many = (gradient_sums(*mesh, "train.batch_size=16", f"train.microbatches={m}") for m in micro)
  assert few and few.keys() == many.keys()
  for axes in few:
    assert many[axes] == pytest.approx(few[axes], rel=0.01), (axes, few, many)
