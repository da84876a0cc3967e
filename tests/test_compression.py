"""Gradient compression over `data` (sharding/compression.py): the two-phase bf16 / int8 sums within their
quantisation bound, PowerSGD exact at full rank and at a sum's rank, its error between the bounds its rank gives,
the train step's PowerSGD gradient against the exact one, error feedback losing nothing over steps, the bytes of
the compiled step, and exact resume after a kill."""

import math
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import CONFIGS, load_config, losses
from jaxseek import step as step_lib
from jaxseek.explore import core as explore
from jaxseek.input import global_batches
from jaxseek.sharding import compression
from jaxseek.sharding.mesh import make_mesh

SHARDS = 4


def data_mesh(shards=SHARDS):
  cfg = load_config("tiny-dense", f"mesh.data={shards}")
  return make_mesh(cfg, jax.devices()[:shards])


def blocky(rng, shape):
  """Random values whose magnitude changes by orders of magnitude from one stretch of 256 to the next (per-block
  scales matter)."""
  x = rng.standard_normal(shape)
  flat = x.reshape(shape[0], -1)
  flat *= 10.0 ** rng.uniform(-3, 3, (shape[0], -(-flat.shape[1] // 256))).repeat(256, 1)[:, :flat.shape[1]]
  return flat.reshape(shape).astype(np.float32)


def run_reduce(mesh, method, grads, residual, basis=None, views=None):
  specs = jax.tree.map(lambda g: P("data", *([None] * (g.ndim - 1))), grads)
  with jax.set_mesh(mesh):
    fn = jax.jit(lambda g, s: compression.reduce(g, s, method, specs, views=views or {}))
    summed, state = jax.device_get(fn(grads, compression.State(residual, basis or {})))
    return summed, state.residual, state.basis


def bound(v_S, method):
  """Per element, the largest difference the two-phase sum may have from the exact sum: phase 1 rounds every
  copy but the chunk owner's own (int8: half a step of its block's scale, max |x| / 127; bf16: 2^-8 relative),
  phase 2 rounds the owner's sum (bounded by the exact sum plus phase 1's error), plus float32 rounding."""
  n = v_S.shape[0]
  flat = v_S.reshape(n, -1).astype(np.float64)
  L = flat.shape[1]
  unit = n * (compression.BLOCK if method == "int8" else 1)
  padded = -(-L // unit) * unit
  x = np.pad(flat, ((0, 0), (0, padded - L)))
  C = padded // n
  owner = np.arange(padded) // C
  if method == "int8":
    half_step = lambda a: np.abs(a).reshape(*a.shape[:-1], -1, compression.BLOCK).max(-1).repeat(
        compression.BLOCK, -1) / 254
  else:
    half_step = lambda a: np.abs(a) * 2.0 ** -8
  steps = half_step(x)
  phase1 = steps.sum(0) - steps[owner, np.arange(padded)]
  phase2 = half_step(np.abs(x.sum(0)) + phase1)
  slack = 1e-6 * np.abs(x).sum(0)
  return (phase1 + phase2 + slack)[:L].reshape(v_S.shape[1:])


@pytest.mark.parametrize("method", ["int8", "bf16"])
def test_two_phase_sum_is_within_the_quantisation_bound(method):
  """On 4 data shards: each element of the compressed sum within the bound computed from the values sent (and
  not exact: it was compressed); a leaf too small for the exchange is summed exactly; one step's sum and the
  new residuals add up to the exact sum (the residual is exactly what was dropped)."""
  rng = np.random.default_rng(0)
  grads = {"w": blocky(rng, (SHARDS, 5, 1000)), "norm": rng.standard_normal((SHARDS, 40)).astype(np.float32)}
  zeros = jax.tree.map(np.zeros_like, grads)
  summed, residual, _ = run_reduce(data_mesh(), method, grads, zeros)
  exact = grads["w"].astype(np.float64).sum(0)
  err = np.abs(summed["w"] - exact)
  limit = bound(grads["w"], method)
  assert err.max() > 0
  assert (err <= limit).all(), (err / limit).max()
  assert (err / limit).max() > 0.05  # the bound is not loose by orders of magnitude
  np.testing.assert_allclose(summed["norm"], grads["norm"].sum(0), rtol=1e-6)
  assert not residual["norm"].any()
  np.testing.assert_allclose(summed["w"] + residual["w"].sum(0), exact, rtol=1e-5, atol=1e-6 * np.abs(exact).max())


def test_powersgd_at_full_rank_equals_the_sum():
  """Rank min(rows, columns): the sum of the shards' matrices exactly, step after step with the basis warm-started,
  also when the gradients are of lower rank (which leaves the carried basis degenerate)."""
  rng = np.random.default_rng(1)
  for m, n in ((24, 16), (16, 24)):
    r = min(m, n)
    Q = jnp.asarray(rng.standard_normal((3, n, r)), jnp.float32)
    for step in range(3):
      low = rng.standard_normal((SHARDS, 3, m, 2)) @ rng.standard_normal((SHARDS, 3, 2, n))  # rank 2 per shard
      M_S = jnp.asarray(low if step else rng.standard_normal((SHARDS, 3, m, n)), jnp.float32)
      summed, dropped, Q = compression.powersgd_matrix(M_S, Q)
      np.testing.assert_allclose(summed, M_S.sum(0), rtol=1e-4, atol=1e-4)
      np.testing.assert_allclose(dropped.sum(0), 0, atol=1e-4)


def test_powersgd_low_rank_keeps_the_leading_direction():
  """Rank 1 of a sum that is one outer product plus noise: the outer product comes back after a few warm-started
  steps (power iteration), the noise does not."""
  rng = np.random.default_rng(2)
  u, v = rng.standard_normal((32, 1)), rng.standard_normal((1, 20))
  Q = jnp.asarray(rng.standard_normal((20, 1)), jnp.float32)
  for _ in range(4):
    M_S = jnp.asarray(u @ v / SHARDS + 0.01 * rng.standard_normal((SHARDS, 32, 20)), jnp.float32)
    summed, _, Q = compression.powersgd_matrix(M_S, Q)
  assert np.abs(np.asarray(summed) - u @ v).max() < 0.05 * np.abs(u @ v).max()


def projected(M, Q):
  """PowerSGD's sum of M [..., m, n] with the basis Q [..., n, r], in float64: M projected on the columns of
  P = M·orthonormal(Q), P·Pᵀ·M (the power step; a projection, so what it drops is orthogonal to what it keeps)."""
  P_ = np.linalg.qr(M @ np.linalg.qr(Q)[0])[0]
  return P_ @ np.swapaxes(P_, -1, -2) @ M


def tail(M, r):
  """√Σ_{i>r} σ_i² of each matrix of M [..., m, n]: the least error of any rank-r matrix (Eckart–Young)."""
  s = np.linalg.svd(M, compute_uv=False)
  return np.sqrt((s[..., r:] ** 2).sum(-1))


def test_powersgd_sum_of_rank_at_most_r_is_exact_at_once():
  """Rank 4 of shards whose matrices share one column space of dimension k ≤ 4 (the sum's rank is k): one step
  from a random basis returns the sum to float32 rounding (P spans M·Q, which is all of the sum's columns) and
  drops nothing from any shard."""
  rng = np.random.default_rng(4)
  for k in (2, 4):
    U = rng.standard_normal((3, 32, k))
    M_S = (U[None] @ rng.standard_normal((SHARDS, 3, k, 20))).astype(np.float32)
    summed, dropped, _ = compression.powersgd_matrix(jnp.asarray(M_S), jnp.asarray(rng.standard_normal((3, 20, 4)),
                                                                                    jnp.float32))
    exact = M_S.astype(np.float64).sum(0)
    scale = np.abs(exact).max()
    assert np.abs(np.asarray(summed) - exact).max() <= 1e-5 * scale, k
    assert np.abs(np.asarray(dropped)).max() <= 1e-5 * scale, k


def test_powersgd_error_meets_the_tail_singular_values_bound():
  """Rank r = 4 of a fixed sum M = U·diag(σ)·Vᵀ over 4 shards, stepped with the basis carried (no residual): step
  t's P spans (M·Mᵀ)^(t−1)·M·Q₀ (subspace iteration), so its error ||M − P·Qᵀ||_F lies between the tail
  √Σ_{i>r} σ_i² (Eckart–Young: P·Qᵀ has rank r) and √(tail² + (ρ^(2t−1) · tan θ · ||σ_1..r||)²), ρ = σ_5/σ_4, θ the
  largest principal angle between Q₀ and V's leading r columns. Each step's sum is M projected on P's columns."""
  rng = np.random.default_rng(5)
  r, m, n = 4, 32, 20
  U = np.linalg.qr(rng.standard_normal((m, n)))[0]
  V = np.linalg.qr(rng.standard_normal((n, n)))[0]
  sigma = np.concatenate([[8.0, 7.0, 6.0, 5.0], np.linspace(1.0, 0.05, n - r)])
  parts = rng.standard_normal((SHARDS, m, n))
  M_S = ((U * sigma) @ V.T / SHARDS + parts - parts.mean(0)).astype(np.float32)  # shards that sum to U·Σ·Vᵀ
  M = M_S.astype(np.float64).sum(0)
  U_, s, Vt = np.linalg.svd(M)
  rho, lead = s[r] / s[r - 1], np.sqrt((s[:r] ** 2).sum())
  Q = rng.standard_normal((n, r))
  X = Vt @ np.linalg.qr(Q)[0]  # the first basis in M's right singular vectors
  tan_theta = np.linalg.norm(X[r:] @ np.linalg.inv(X[:r]), 2)
  floor, slack = tail(M, r), 1e-5 * np.linalg.norm(M)
  errors = []
  basis = jnp.asarray(Q, jnp.float32)
  for t in range(1, 5):
    want = projected(M, np.asarray(basis, np.float64))
    summed, _, basis = compression.powersgd_matrix(jnp.asarray(M_S), basis)
    summed = np.asarray(summed, np.float64)
    assert np.abs(summed - want).max() <= 1e-5 * np.abs(M).max(), t
    err = np.linalg.norm(M - summed)
    ceiling = np.sqrt(floor ** 2 + (rho ** (2 * t - 1) * tan_theta * lead) ** 2)
    assert floor - slack <= err <= ceiling + slack, (t, floor, err, ceiling)
    errors.append(err)
  print("error / tail per step:", np.array(errors) / floor)
  assert errors[0] > 1.01 * floor  # the first step is short of the best rank-r error: the carried basis matters
  assert errors[-1] < (1 + 1e-4) * floor


@pytest.mark.parametrize("method", ["int8", "bf16", "powersgd"])
def test_error_feedback_loses_nothing_over_steps(method):
  """Over 6 steps with the residual carried: Σ applied sums + the residuals left = Σ gradients (what compression
  dropped is delayed, never lost), while the applied sums alone differ from the gradients' (it did drop)."""
  rng = np.random.default_rng(3)
  shape = (SHARDS, 2, 64, 40)  # 5120 values per device: enough for the two-phase exchange
  views = {"w": compression.matrix_view(shape[1:], ("layers", "embed", "mlp"))} if method == "powersgd" else {}
  basis = {"w": jnp.asarray(rng.standard_normal((2, 40, 4)), jnp.float32)} if method == "powersgd" else None
  residual = {"w": np.zeros(shape, np.float32)}
  applied, total = 0.0, 0.0
  mesh = data_mesh()
  for _ in range(6):
    grads = {"w": rng.standard_normal(shape).astype(np.float32)}
    summed, residual, basis = run_reduce(mesh, method, grads, residual, basis, views)
    applied = applied + summed["w"].astype(np.float64)
    total = total + grads["w"].astype(np.float64).sum(0)
  scale = np.abs(total).max()
  assert np.abs(applied - total).max() > 1e-4 * scale
  np.testing.assert_allclose(applied + residual["w"].sum(0), total, atol=2e-5 * scale)


def test_matrix_views_split_stacked_parameters_into_matrices():
  assert compression.matrix_view((4, 64, 32), ("layers", "embed", "mlp")) == (1, 64, 32)
  assert compression.matrix_view((4, 8, 64, 32), ("layers", "experts", "embed", "expert_mlp")) == (2, 64, 32)
  # heads × head_dim × embed: rows × columns nearest to square (40 × 40, not 4 × 400)
  assert compression.matrix_view((2, 4, 10, 40), ("layers", "heads", "head_dim", "embed")) == (1, 40, 40)
  assert compression.matrix_view((2, 40), ("layers", "embed")) is None
  assert not compression.compressed_view((0, 8, 8), 4)  # 4 · 16 values would not save any of the 64
  assert not compression.compressed_view((0, 40, 8), 4)  # 192 of 320: not half
  assert compression.compressed_view((0, 64, 32), 4)


WIDER = ("model.hidden_size=128", "model.intermediate_size=384", "model.head_dim=32", "model.vocab_size=512")


def compiled_wire_bytes(*overrides, shards=SHARDS, config="tiny-dense"):
  """(Bytes each device sends per step in the compiled step's collectives that span `data`, scalars left out
  (benchmarks/compression_bytes.py), the count `step_lib.compression_bytes` gives for the same setup, which the
  explorer's table repeats, and the collectives by kind and axes) on data = `shards` times the mesh axes that
  `overrides` set."""
  from jaxseek.explore import compile as explore_compile

  sys.path.insert(0, str(CONFIGS.parent / "benchmarks"))
  from compression_bytes import data_wire

  cfg = load_config(config, f"mesh.data={shards}", *overrides)
  sizes = cfg.mesh.sizes()
  mesh = make_mesh(cfg, jax.devices()[:math.prod(sizes.values())])
  trainer = step_lib.make_trainer(cfg, mesh)
  with jax.set_mesh(mesh):
    text = step_lib.compile_step(trainer, cfg, mesh).lower(
        trainer.abstract_state, explore_compile.abstract_batch(cfg, mesh)).compile().as_text()
  counted = step_lib.compression_bytes(cfg, trainer, mesh)
  table = explore.plan(explore.describe(cfg), sizes, explore.hardware("h100-80g"))["gradient_compression"]
  assert table["bytes_per_device"][cfg.train.grad_compression] == pytest.approx(counted, abs=0.5)  # the explorer's
  return data_wire(text, dict(mesh.shape)), counted, explore_compile.collective_bytes(text, tuple(mesh.devices.shape))


def test_compressed_sums_send_a_fraction_of_the_bytes_at_any_data_size():
  """From the compiled step's collectives on 4 data shards (the ratios hold at any size: both phases send
  (n − 1)/n of the block): int8 ≤ 0.3×, bf16 ≤ 0.55×, PowerSGD rank 4 ≤ 0.12× the float32 all-reduce; the count
  the explorer and the start-up line use equals the compiled bytes to the byte."""
  none, none_counted, coll = compiled_wire_bytes(*WIDER)
  assert set(coll) == {"all-reduce"}
  assert none_counted == pytest.approx(none, abs=0.5)
  # powersgd: rank-4 factors of the layers' matrices, and the embedding and head (a third of this model's values,
  # vocabulary 512 × 128) as int8: 0.25 × 1/3 + the factors
  for method, ceiling in (("int8", 0.3), ("bf16", 0.55), ("powersgd", 0.12)):
    got, counted, coll = compiled_wire_bytes(*WIDER, f"train.grad_compression={method}")
    assert got / none <= ceiling, (method, got / none)
    assert counted == pytest.approx(got, abs=0.5), (method, coll)
    if method != "powersgd":  # the two phases: an all-to-all of int8 (bfloat16 bits) and an all-gather of them
      assert {"all-to-all", "all-gather"} <= set(coll), coll


@pytest.mark.parametrize("config, mesh", [
    ("tiny-dense", ("mesh.fsdp=2", "mesh.tensor=2")),
    ("tiny-dense", ("mesh.tensor=2",)),
    ("tiny-dense", ("mesh.fsdp=4",)),
    ("tiny-v3", ("mesh.expert=2", "mesh.tensor=2")),
], ids=["d2f2t2", "d2t2", "d2f4", "v3-d2e2t2"])
def test_powersgd_count_equals_the_compiled_bytes_on_mixed_meshes(config, mesh):
  """On data 2 × fsdp / tensor / expert, PowerSGD's count (the start-up line's and the explorer's) equals to the
  byte what the compiled step sends in its collectives over `data`: the factors split over every mesh axis of
  their matrix, the stacked experts over `expert`, the embedding and head int8 padded to whole chunks (tiny-v3:
  132 × 40 per device). (Left to XLA, P went split as the matrix's rows and Q as its columns: 73,472 bytes where
  54,016 were counted on d2f2t2.) On tiny-v3 the routers' statistics are summed over `data` too: per MoE layer
  the loads of its E experts, its dropped and extra-round counts, float32 (none of them gradients)."""
  wider = WIDER if config == "tiny-dense" else ()
  got, counted, coll = compiled_wire_bytes(*wider, *mesh, "train.grad_compression=powersgd", shards=2,
                                           config=config)
  m = load_config(config).model
  moe_layers = m.num_hidden_layers - m.first_k_dense_replace if m.n_routed_experts else 0
  statistics = compression.wire_bytes(moe_layers * ((m.n_routed_experts or 0) + 2), 2, "none")
  assert counted + statistics == pytest.approx(got, abs=0.5), coll
  # nothing fetched from another data shard's devices (which hold the same sums)
  assert not [axes for axes in coll.get("collective-permute", {}) if "data" in axes.split("+")], coll


def test_powersgd_step_sums_the_projection_of_the_exact_gradient():
  """tiny-v3 (MoE) over data 2 × expert 2 × tensor 2, rank 2, two steps: for each matrix PowerSGD compresses, the
  gradient the optimiser receives is M = the exact gradient (the uncompressed step's, at the same parameters) +
  the residuals carried in, projected on the columns of M·Q with Q the carried basis (`projected`, float64): its
  error between Eckart–Young's tail and ||M||_F; the embedding and head are int8 sums; every other leaf is the
  exact gradient; what the residuals keep is exactly what was dropped."""
  from test_gradsum import REASSOCIATION, recorded_steps

  mesh = ("mesh.data=2", "mesh.expert=2", "mesh.tensor=2")
  psgd, _, trainer = recorded_steps("tiny-v3", (*mesh, "train.grad_compression=powersgd", "train.powersgd_rank=2",
                                                "train.powersgd_start_step=0"), steps=2)
  same_point = lambda i, _, state: state.replace(params=psgd[i]["state"].params, biases=psgd[i]["state"].biases)
  exact = recorded_steps("tiny-v3", mesh, steps=2, state_fn=same_point)[0]
  views = compression.matrix_views(trainer.abstract_state.params, 2)
  assert views and views.keys() == psgd[0]["basis"].keys()
  quantised = {k for k in psgd[0]["grads"] if k.startswith(("embed", "head"))}
  assert len(quantised) == 2 and not quantised & views.keys()
  carried = {k: 0.0 for k in psgd[0]["grads"]}
  worst = 0.0
  for t, (got, want) in enumerate(zip(psgd, exact)):
    for key, g in got["grads"].items():
      M = want["grads"][key] + carried[key]
      scale = np.abs(M).max()
      kept = got["residual"][key].sum(0)
      np.testing.assert_allclose(g + kept, M, atol=REASSOCIATION * scale, err_msg=key)  # nothing lost
      if key in quantised:  # the embedding and head go int8: two roundings of at most half a step of a block's
        # max each, on blocks of two shards' values (their max ≤ twice the sum's here), so within 2/127 of the
        # leaf's max; and not exact
        err = np.abs(g - M).max() / scale
        assert 0 < err <= 2 / 127, (key, err)
        continue
      if key not in views:
        np.testing.assert_allclose(g, M, atol=REASSOCIATION * scale, err_msg=key)
        continue
      b, m, n = views[key]
      M_bmn, g_bmn = M.reshape(-1, m, n), g.reshape(-1, m, n)
      Q = got["basis_before"][key].reshape(-1, n, 2)
      worst = max(worst, np.abs(g_bmn - projected(M_bmn, Q)).max() / scale)
      err = np.linalg.norm(M_bmn - g_bmn, axis=(1, 2))
      assert (tail(M_bmn, 2) * (1 - 1e-4) <= err).all() and (err <= np.linalg.norm(M_bmn, axis=(1, 2))).all(), key
      assert (err > 1e-3 * np.linalg.norm(M_bmn, axis=(1, 2))).all(), key  # compressed for real
    carried = {k: v.sum(0) for k, v in got["residual"].items()}
  print("worst difference from the float64 projection, of the leaf's max:", worst)
  assert worst <= REASSOCIATION


def test_powersgd_start_step_sums_in_float32_before_it():
  """train.powersgd_start_step=3: steps 1–3 are the float32 sum (the uncompressed run's losses and gradient norms
  to float32 reassociation, bases untouched), step 4 compresses (its rank-2 gradient has a smaller norm)."""
  from test_precision import train

  mesh = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
  exact = train("tiny-dense", mesh, steps=4)[0]
  warm = (*mesh, "train.grad_compression=powersgd", "train.powersgd_rank=2", "train.powersgd_start_step=3")
  records, state, trainer = train("tiny-dense", warm, steps=3)
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose([float(r[key]) for r in records], [float(r[key]) for r in exact[:3]], rtol=1e-5)
  start = jax.device_get(trainer.init().grad_basis)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(jax.device_get(
      state.grad_basis))))
  fourth = train("tiny-dense", warm, steps=4)[0][3]
  assert float(fourth["grad_norm"]) < 0.99 * float(exact[3]["grad_norm"])


def test_powersgd_rank_must_be_positive():
  from jaxseek.errors import UserError

  with pytest.raises(UserError, match="train.powersgd_rank: 0 must be ≥ 1"):
    load_config("tiny-dense", "train.grad_compression=powersgd", "train.powersgd_rank=0")
  with pytest.raises(UserError, match="train.powersgd_start_step: -1 must be ≥ 0"):
    load_config("tiny-dense", "train.grad_compression=powersgd", "train.powersgd_start_step=-1")


RUN = ["-m", "jaxseek.train", "--config", str(CONFIGS / "tiny-dense.yaml"), "mesh.num_cpu_devices=2", "mesh.data=2",
       "metrics.every=1", "train.steps=16", "checkpoint.every=4", "train.grad_compression=powersgd",
       "train.powersgd_rank=2", "optim.warmup_steps=3"]


def test_resume_after_a_kill_with_powersgd_is_exact(tmp_path, run_env):
  """The residuals and bases are in the checkpoint: killed after step 9 and resumed from the last checkpoint
  (step 4, 8 or 12), the losses of every step after it equal the uninterrupted run's bit for bit."""
  straight = tmp_path / "straight"
  done = subprocess.run([sys.executable, *RUN, f"train.run_dir={straight}"], env=run_env, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stdout + done.stderr
  run_dir = tmp_path / "killed"
  proc = subprocess.Popen([sys.executable, *RUN, f"train.run_dir={run_dir}"], env=run_env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  deadline = time.monotonic() + 300
  while not ((run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= 9):
    assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  done = subprocess.run([sys.executable, *RUN, f"train.run_dir={run_dir}"], env=run_env, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stdout + done.stderr
  resumed = int(done.stdout.split("resumed from step ")[1].split()[0])
  assert resumed in (4, 8, 12), done.stdout  # the last checkpoint finished before the kill
  want, got = losses(straight), losses(run_dir)
  assert sorted(got) == list(range(1, 17))
  assert [got[s] for s in range(resumed + 1, 17)] == [want[s] for s in range(resumed + 1, 17)]
