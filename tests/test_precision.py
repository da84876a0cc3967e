"""Precision and memory switches: optimiser-moment dtype, float16 with dynamic loss scaling, ZeRO-1 against
ZeRO-3, remat policies. Each is checked against the plain run it must not change beyond its precision."""

import re

import jax
import numpy as np
import pytest

from conftest import load_config
from jaxseek import step as step_lib
from jaxseek.config import MESH_AXES
from jaxseek.errors import UserError
from jaxseek.explore import core as explore
from jaxseek.input import global_batches
from jaxseek.sharding.mesh import make_mesh


def train(name, overrides, steps=5, devices=None, state_fn=None):
  """Losses per step and the metrics of every step; `state_fn(step, state)` may change the state first."""
  cfg = load_config(name, *overrides)
  mesh = make_mesh(cfg, devices)
  trainer, state = step_lib.init_state(cfg, mesh)
  step_fn = step_lib.compile_step(trainer, cfg, mesh)
  batches = global_batches(cfg, mesh)
  records = []
  with jax.set_mesh(mesh):
    for i in range(steps):
      if state_fn is not None:
        state = state_fn(i, state)
      before = jax.device_get(state.params)
      state, metrics = step_fn(state, next(batches))
      record = {k: np.asarray(v) for k, v in jax.device_get(metrics).items()}
      record["moved"] = any(not np.array_equal(a, b) for a, b in
                            zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state.params))))
      records.append(record)
  return records, state, trainer


def losses(records):
  return np.array([float(r["loss"]) for r in records])


def test_bfloat16_moments_halve_the_optimiser_state_and_track_float32():
  base = ("mesh.data=1", "optim.warmup_steps=2")
  f32, _, _ = train("tiny-v3", base, steps=8, devices=jax.devices()[:1])
  bf16, state, _ = train("tiny-v3", (*base, "optim.moments_dtype=bfloat16"), steps=8, devices=jax.devices()[:1])
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
  assert moments and all(x.dtype == np.dtype("bfloat16") for x in moments)
  # bfloat16 keeps 8 bits of mantissa: the moments round, the losses stay close
  np.testing.assert_allclose(losses(bf16), losses(f32), rtol=2e-3)
  assert not np.array_equal(losses(bf16), losses(f32))  # the setting really changed the arithmetic
  cfg = load_config("tiny-v3", "mesh.data=1", "optim.moments_dtype=bfloat16")
  plan = explore.plan(explore.describe(cfg), dict.fromkeys(MESH_AXES, 1), explore.hardware("h100-80g"))
  full = explore.plan(explore.describe(load_config("tiny-v3", "mesh.data=1")), dict.fromkeys(MESH_AXES, 1),
                      explore.hardware("h100-80g"))
  step_counters = 2 * 4  # adamw's and the schedule's int32 counts stay
  assert plan["memory_per_device"]["optimizer"] - step_counters == \
      (full["memory_per_device"]["optimizer"] - step_counters) // 2


def test_float16_overflow_halves_the_scale_and_skips_the_step():
  """A loss scale pushed too high (×2²⁰ at step 3) makes the float16 gradients overflow: each such step is
  skipped (parameters unchanged, not counted as non-finite) and halves the scale until the gradients are finite
  again; every `loss_scale_window` clean steps the scale doubles. Training goes on and tracks bfloat16."""
  base = ("mesh.data=1", "train.loss_scale_window=3", "optim.warmup_steps=2")
  inject = lambda i, state: state.replace(loss_scale=state.loss_scale * 2.0 ** 20) if i == 2 else state
  records, _, _ = train("tiny-dense", (*base, "train.compute_dtype=float16"), steps=40, devices=jax.devices()[:1],
                        state_fn=inject)
  over = [int(r["overflow"]) for r in records]
  scale = [float(r["loss_scale"]) for r in records]
  assert over[:2] == [0, 0] and over[2] == 1, over
  assert sum(over) >= 2  # more than one halving to come back from ×2²⁰
  # the rule, step by step: halve on overflow, double after `window` clean steps, else keep
  good = 0
  for i in range(len(records) - 1):
    expected = scale[i]
    if over[i]:
      expected, good = scale[i] / 2, 0
    else:
      good += 1
      if good == 3:
        expected, good = scale[i] * 2, 0
    if i + 1 == 2:  # the injection happens before step 3 runs
      expected *= 2.0 ** 20
    assert scale[i + 1] == expected, (i, scale[i], scale[i + 1], over[i])
  for r, o in zip(records, over):
    assert r["skipped"] == o and r["moved"] == (not o) and int(r["nonfinite"]) == 0
  assert any(scale[i + 1] == 2 * scale[i] for i in range(len(scale) - 1))  # it grew again
  bf16, _, _ = train("tiny-dense", (*base, "train.compute_dtype=bfloat16"), steps=40, devices=jax.devices()[:1])
  # the skipped steps leave float16 behind by their count; it still learns as bfloat16 does
  f16_loss, bf16_loss = losses(records), losses(bf16)
  print("float16 vs bfloat16, last 5 steps:", f16_loss[-5:].mean(), bf16_loss[-5:].mean())
  np.testing.assert_allclose(f16_loss[:3], bf16_loss[:3], rtol=1e-2)
  assert abs(f16_loss[-5:].mean() / bf16_loss[-5:].mean() - 1) < 0.05


def test_loss_scale_hysteresis_and_floor():
  """DeepSpeed's rule: with hysteresis 2 the first overflow only spends the budget; later ones halve the scale,
  never below the floor; a clean window doubles it and refills the budget."""
  import jax.numpy as jnp

  cfg = load_config("tiny-dense", "train.compute_dtype=float16", "train.loss_scale_window=2",
                    "train.loss_scale_hysteresis=2", "train.loss_scale_min=4").train
  state = step_lib.TrainState(step=None, params=None, biases=None, opt_state=None, loss_window=None,
                              loss_scale=jnp.float32(16), good_steps=jnp.int32(0), overflow_budget=jnp.int32(2),
                              grad_residual=None)
  scales = []
  for overflow in [1, 1, 1, 1, 0, 0, 1, 1]:
    scale, good, budget = step_lib._next_loss_scale(state, jnp.bool_(overflow), cfg)
    state = state.replace(loss_scale=scale, good_steps=good, overflow_budget=budget)
    scales.append(float(scale))
  assert scales == [16, 8, 4, 4, 4, 8, 8, 4]


@pytest.mark.parametrize("mesh", [("mesh.fsdp=2", "mesh.data=2", "mesh.tensor=2")], ids=["f2d2t2"])
def test_zero1_equals_zero3_and_holds_what_the_explorer_predicts(mesh):
  z3, state3, trainer3 = train("tiny-v3", mesh)
  z1, state1, trainer1 = train("tiny-v3", (*mesh, "train.zero=1"))
  np.testing.assert_allclose(losses(z1), losses(z3), rtol=1e-5)
  for state, zero in ((state3, 3), (state1, 1)):
    cfg = load_config("tiny-v3", *mesh, f"train.zero={zero}")
    sizes = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    sizes["data"] = 8 // (sizes["fsdp"] * sizes["tensor"])
    predicted = explore.plan(explore.describe(cfg), sizes, explore.hardware("h100-80g"))["memory_per_device"]
    held = {}
    for leaf in jax.tree.leaves((state.params, state.biases)):
      for shard in leaf.addressable_shards:
        held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    assert set(held.values()) == {predicted["parameters"]}, zero
  fsdp_split = lambda tr: sum("fsdp" in str(s.spec) for s in jax.tree.leaves(tr.state_shardings.params))
  assert fsdp_split(trainer3) > 0 and fsdp_split(trainer1) == 0
  assert sum("fsdp" in str(s.spec) for s in jax.tree.leaves(trainer1.state_shardings.opt_state)) > 0


def test_remat_policies_give_identical_losses():
  runs = {policy: losses(train("tiny-v3", ("mesh.data=2", "mesh.tensor=2", "mesh.fsdp=2",
                                           f"train.remat={policy}"), steps=3)[0])
          for policy in ("none", "minimal", "full")}
  for policy, got in runs.items():
    np.testing.assert_allclose(got, runs["none"], rtol=1e-6, err_msg=policy)


def test_offload_is_refused_on_cpu():
  cfg = load_config("tiny-v3", "train.remat=offload")
  with pytest.raises(UserError, match="train.remat: offload .* cpu backend"):
    step_lib.make_trainer(cfg, make_mesh(cfg))


@pytest.mark.parametrize("k", [384, 200])  # 200: a partial tile and block, zero-padded
def test_fp8_matmul_error_is_within_e4m3_bounds(k):
  """Each product's error is bounded by the rounding of both operands: per element at most 2⁻⁴ of it (3
  mantissa bits), or 2⁻¹⁰ of its tile's scale below e4m3's normal range."""
  from jaxseek.model import fp8

  rng = np.random.default_rng(k)
  x = rng.standard_normal((64, k)).astype(np.float32) * rng.lognormal(0, 2, (64, 1)).astype(np.float32)
  w = (rng.standard_normal((k, 256)) * 0.05).astype(np.float32)
  xq, wq = np.asarray(fp8.quantize_tiles(x)), np.asarray(fp8.quantize_blocks(w))
  y = x.astype(np.float64) @ w.astype(np.float64)
  got = np.asarray(jax.numpy.einsum("xk,kn->xn", xq, wq, precision="highest"), np.float64)

  def elem_bound(a, tile_amax):
    return np.maximum(2.0 ** -4 * np.abs(a), 2.0 ** -10 * tile_amax / 448.0)

  pad = -k % 128
  x_amax = np.repeat(np.abs(np.pad(x, ((0, 0), (0, pad)))).reshape(64, -1, 128).max(-1), 128, axis=1)[:, :k]
  wp = np.abs(np.pad(w, ((0, pad), (0, 0)))).reshape(-1, 128, 2, 128).max(axis=(1, 3))
  w_amax = np.repeat(np.repeat(wp, 128, axis=0), 128, axis=1)[:k]
  assert np.all(np.abs(xq - x) <= elem_bound(x, x_amax) * (1 + 1e-6))
  assert np.all(np.abs(wq - w) <= elem_bound(w, w_amax) * (1 + 1e-6))
  bound = elem_bound(x, x_amax) @ np.abs(wq) + np.abs(x) @ elem_bound(w, w_amax) + 1e-6 * np.abs(x) @ np.abs(w)
  assert np.all(np.abs(got - y) <= bound)
  rel = np.linalg.norm(got - y) / np.linalg.norm(y)
  assert 2.0 ** -9 < rel < 2.0 ** -4, rel  # rounded for real, and at e4m3's precision


def test_fp8_scales_each_tile_on_its_own():
  """A tile holding an outlier does not flush its neighbours: 1×128 scaling keeps their relative precision,
  where one scale for the tensor would round them to zero."""
  from jaxseek.model import fp8

  x = np.full((1, 256), 0.01, np.float32)
  x[0, 0] = 1e4
  xq = np.asarray(fp8.quantize_tiles(x))
  np.testing.assert_allclose(xq[0, 128:], 0.01, rtol=2.0 ** -4)
  np.testing.assert_allclose(xq[0, 0], 1e4, rtol=1e-6)  # the outlier sets its tile's scale
  per_tensor = np.asarray(fp8.quantize_tiles(x, tile=256))
  assert np.all(per_tensor[0, 128:] == 0)


def test_fp8_training_tracks_bfloat16():
  base = ("mesh.data=1", "train.compute_dtype=bfloat16", "optim.warmup_steps=10", "optim.lr=0.003",
          "data.source=python-stdlib", "data.max_bytes=1000000")
  ref, _, _ = train("tiny-v3", base, steps=30, devices=jax.devices()[:1])
  got, _, _ = train("tiny-v3", (*base, "train.fp8=true"), steps=30, devices=jax.devices()[:1])
  a, b = losses(ref), losses(got)
  assert not np.array_equal(a, b)  # the FP8 rounding is really applied
  assert b[-1] < 0.9 * b[0]  # it trains
  print("fp8 vs bf16 loss, last 10 steps, max relative difference:", np.abs(b[-10:] / a[-10:] - 1).max())
  np.testing.assert_allclose(b[-10:], a[-10:], rtol=2e-4)  # measured 1.4e-4 (docs/precision.md)


def test_remat_policies_order_compiled_memory_as_the_explorer_predicts():
  """XLA's temporaries of the real step shrink none > minimal > full, and the explorer's estimates follow."""
  from jaxseek.explore import compile as explore_compile

  temps = {}
  for policy in ("none", "minimal", "full"):
    cfg = load_config("tiny-v3", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.seq_len=64",
                      f"train.remat={policy}")
    sizes = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    sizes["data"] = 2
    compiled = explore_compile.compare(cfg, explore.describe(cfg), sizes, explore.hardware("h100-80g"))
    temps[policy] = (compiled["temp_bytes"], compiled["predicted_temp_bytes"])
    assert abs(compiled["predicted_temp_bytes"] / compiled["temp_bytes"] - 1) < 0.25, (policy, compiled)
  assert temps["none"][0] > temps["minimal"][0] > temps["full"][0], temps
  assert temps["none"][1] > temps["minimal"][1] > temps["full"][1], temps


COMPRESS_MESH = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")


MOE_COMPRESS_MESH = ("mesh.data=2", "mesh.expert=2", "mesh.tensor=2")


@pytest.mark.parametrize("name, mesh, method", [("tiny-dense", COMPRESS_MESH, "bf16"),
                                                ("tiny-dense", COMPRESS_MESH, "int8"),
                                                ("tiny-v3", MOE_COMPRESS_MESH, "bf16")])
def test_compressed_gradient_sum_tracks_the_exact_one(name, mesh, method):
  """Compressed data-axis sums with error feedback: the same losses to the compression's precision, and the
  parameters still move every step. For MoE (expert dispatch and tensor-parallel experts inside the per-shard
  gradient): the first step's gradient norm to bfloat16's precision (a gradient counted twice, as a wrong psum
  transpose would, is off by far more) and the same expert loads, summed over the data shards."""
  exact_records = train(name, mesh, steps=8)[0]
  exact = losses(exact_records)
  records, state, _ = train(name, (*mesh, f"train.grad_compression={method}"), steps=8)
  got = losses(records)
  assert not np.array_equal(got, exact)
  np.testing.assert_allclose(got, exact, rtol=5e-3 if method == "int8" else 1e-3)
  np.testing.assert_allclose(float(records[0]["grad_norm"]), float(exact_records[0]["grad_norm"]), rtol=1e-4)
  if name == "tiny-v3":
    assert float(records[0]["moe_load_max_over_mean"]) == float(exact_records[0]["moe_load_max_over_mean"])
  residual = jax.tree.leaves(state.grad_residual)
  assert residual and all(r.shape[0] == 2 for r in residual)  # one residual per data shard
  assert max(float(np.abs(r).max()) for r in residual) > 0  # compression dropped something, kept for next step


def test_grad_compression_refused_with_a_pipeline():
  cfg = load_config("tiny-v3", "train.grad_compression=int8", "mesh.data=2", "mesh.pipeline=2")
  with pytest.raises(UserError, match="train.grad_compression: not supported together with mesh.pipeline > 1"):
    step_lib.make_trainer(cfg, make_mesh(cfg, jax.devices()[:4]))


def test_optimizer_state_in_host_memory_is_refused_on_cpu():
  cfg = load_config("tiny-v3", "train.optimizer_memory=host")
  with pytest.raises(UserError, match="train.optimizer_memory: host .* cpu backend does not have"):
    step_lib.make_trainer(cfg, make_mesh(cfg))
