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
from jaxseek.sharding import compression
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
  from jaxseek.kernels import fp8

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
  from jaxseek.kernels import fp8

  x = np.full((1, 256), 0.01, np.float32)
  x[0, 0] = 1e4
  xq = np.asarray(fp8.quantize_tiles(x))
  np.testing.assert_allclose(xq[0, 128:], 0.01, rtol=2.0 ** -4)
  np.testing.assert_allclose(xq[0, 0], 1e4, rtol=1e-6)  # the outlier sets its tile's scale
  per_tensor = np.asarray(fp8.quantize_tiles(x, tile=256))
  assert np.all(per_tensor[0, 128:] == 0)


FP8_BASE = ("mesh.data=1", "train.compute_dtype=bfloat16", "optim.warmup_steps=10", "optim.lr=0.003",
            "data.source=python-stdlib", "data.max_bytes=1000000")


@pytest.fixture(scope="module")
def bf16_losses():
  return losses(train("tiny-v3", FP8_BASE, steps=30, devices=jax.devices()[:1])[0])


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8", "blockwise"])  # auto's two and the reference
def test_fp8_training_tracks_bfloat16(recipe, bf16_losses):
  """Each train.fp8 recipe trains a tiny V3 on real text to within DeepSeek's bound of the bfloat16 run (0.25%
  relative loss error, DeepSeek-V3 §3.3) over its last 10 of 30 steps."""
  a = bf16_losses
  got, _, _ = train("tiny-v3", (*FP8_BASE, f"train.fp8={recipe}"), steps=30, devices=jax.devices()[:1])
  b = losses(got)
  assert not np.array_equal(a, b)  # the FP8 GEMMs really round
  assert b[-1] < 0.9 * b[0]  # it trains
  print(f"fp8 {recipe} vs bf16 loss, last 10 steps, max relative difference:", np.abs(b[-10:] / a[-10:] - 1).max())
  np.testing.assert_allclose(b[-10:], a[-10:], rtol=2.5e-3)


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


def shard_gradients(name: str, shards: int) -> dict[str, np.ndarray]:
  """Each data shard's gradient [shards, ...] as the compressed step's vmap computes it, on one device: the step on
  the shard's rows (the batch's s-th contiguous 1/shards), ÷ shards. On one device its cross entropy is normalised
  by the shard's tokens and its balance term by one group; in the compressed step by the whole batch's tokens
  (shards × as many: the synthetic batch counts every token) and by `shards` groups."""
  from test_gradsum import recorded_steps

  cfg = load_config(name, "mesh.data=1")
  batch = next(global_batches(cfg, make_mesh(cfg, jax.devices()[:1])))
  rows = cfg.train.batch_size // shards
  halves = iter([{k: v[s * rows:(s + 1) * rows] for k, v in batch.items()} for s in range(shards)])
  first = {}
  runs = recorded_steps(name, ("mesh.data=1", f"train.batch_size={rows}"), steps=shards, devices=jax.devices()[:1],
                        state_fn=lambda i, trainer, state: first.setdefault("state", state), batches=halves)[0]
  return {k: np.stack([r["grads"][k] for r in runs]) / shards for k in runs[0]["grads"]}


def two_phase_limit(v_S: np.ndarray, sharding, method: str) -> np.ndarray:
  """Per element of a parameter, the largest difference its two-phase sum may have from the exact sum of v_S
  [shards, ...]: tests/test_compression.py's `bound` of each device's own block (the exchange quantises the
  block, flattened, in chunks and 256-value scale blocks); zero for a leaf summed in float32."""
  from test_compression import bound

  limit = np.zeros(v_S.shape[1:])
  for index in {tuple((i.start, i.stop) for i in idx) for idx in sharding.devices_indices_map(v_S.shape[1:]).values()}:
    where = tuple(slice(a, b) for a, b in index)
    block = v_S[(slice(None), *where)]
    if compression.two_phase_leaf(block[0].size, v_S.shape[0], method):
      limit[where] = bound(block, method)
  return limit


@pytest.mark.parametrize("name, mesh, methods", [("tiny-dense", COMPRESS_MESH, ("int8", "bf16")),
                                                 ("tiny-v3", MOE_COMPRESS_MESH, ("int8",))],
                         ids=["dense-f2d2t2", "moe-d2e2t2"])
def test_compressed_gradient_sum_is_within_the_quantisation_bound(name, mesh, methods):
  """The gradient the optimiser receives under compressed data-axis sums, leaf by leaf against the shards'
  gradients computed on one device (their sum: the one-device gradient): each element within the two-phase
  bound of its device's block (test_compression.bound) plus float32 reassociation, a leaf too small to compress
  exact; the new residuals hold exactly what was dropped; the MoE loads are the whole batch's. (MoE: int8 only,
  for time; bf16 differs from it only in what the dense case checks, the packing.)"""
  from test_gradsum import REASSOCIATION, assert_leaves_close, one_device, recorded_steps

  exact = one_device(name)[0]
  v_S = shard_gradients(name, 2)
  assert_leaves_close({k: v.sum(0) for k, v in v_S.items()}, exact["grads"], REASSOCIATION)  # the oracle holds
  for method in methods:
    got, _, trainer = recorded_steps(name, (*mesh, f"train.grad_compression={method}"))
    got = got[0]
    shardings = {k: s for k, s in zip(v_S, jax.tree.leaves(trainer.state_shardings.params))}
    worst, used = {}, 0.0
    for key, g in got["grads"].items():
      want = exact["grads"][key]
      slack = REASSOCIATION * np.abs(want).max()
      limit = two_phase_limit(v_S[key], shardings[key], method) + slack
      err = np.abs(g - want)
      assert (err <= limit).all(), (method, key, (err / limit).max())
      np.testing.assert_allclose(g + got["residual"][key].sum(0), want, atol=slack, err_msg=key)  # nothing lost
      worst[key] = err.max() / np.abs(want).max()
      used = max(used, (err / limit).max())
    print(f"{name} {method}: worst leaf {max(worst.values()):.2%} of its max, "
          f"{sum(w > REASSOCIATION for w in worst.values())} of {len(worst)} leaves compressed, "
          f"largest error / bound {used:.2f}")
    assert used > 0.05  # compressed for real, and the bound is not loose by orders of magnitude
    if name == "tiny-v3":
      assert float(got["metrics"]["moe_load_max_over_mean"]) == float(exact["metrics"]["moe_load_max_over_mean"])


def test_grad_compression_refused_with_a_pipeline():
  cfg = load_config("tiny-v3", "train.grad_compression=int8", "mesh.data=2", "mesh.pipeline=2")
  with pytest.raises(UserError, match="train.grad_compression: not supported together with mesh.pipeline > 1"):
    step_lib.make_trainer(cfg, make_mesh(cfg, jax.devices()[:4]))


def test_optimizer_state_in_host_memory_is_refused_on_cpu():
  cfg = load_config("tiny-v3", "train.optimizer_memory=host")
  with pytest.raises(UserError, match="train.optimizer_memory: host .* cpu backend does not have"):
    step_lib.make_trainer(cfg, make_mesh(cfg))
