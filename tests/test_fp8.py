"""train.fp8's GEMMs (kernels/fp8_gemm.py): each recipe's forward, input-gradient and weight-gradient products
against a NumPy model of its quantisation (e4m3 values and scales, float64 sums), their error against float32
within the recipe's bound, and the model's projections running through them."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxseek.errors import UserError
from jaxseek.kernels import fp8_gemm

E4M3 = ml_dtypes.float8_e4m3fn


def e4m3(a):
  return a.astype(E4M3).astype(np.float64)


def quantise(a, recipe, axis):
  """NumPy model of one operand of a 2-D GEMM contracting `axis`: its e4m3 values times their scales."""
  a = a.astype(np.float32)
  if recipe in ("tensorwise", "rowwise"):
    amax = np.abs(a).max(axis=axis if recipe == "rowwise" else None, keepdims=True).astype(np.float32)
    scale = np.where(amax > 0, amax * np.float32(1 / 448), np.float32(1)).astype(np.float32)
    return e4m3(a / scale) * scale
  if recipe == "mxfp8":
    moved = np.moveaxis(a, axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    exp = np.ceil(np.log2(np.where(amax > 0, amax / np.float32(448), 1)))
    scale = np.where(amax > 0, 2.0 ** exp, 1).astype(np.float32)
    q = e4m3(np.clip(blocks / scale, -448, 448)) * scale
    return np.moveaxis(q.reshape(moved.shape), -1, axis)
  raise AssertionError(recipe)


def reference(x, w, g, recipe):
  """y = x·w, dx = g·wᵀ, dw = xᵀ·g for x [M, K], w [K, N], g [N, ...] as the recipe quantises each GEMM's
  operands along its contraction (the weight gradient re-scales x from its forward e4m3 values)."""
  y = quantise(x, recipe, 1) @ quantise(w, recipe, 0)
  dx = quantise(g, recipe, 1) @ quantise(w, recipe, 1).T
  x_kept = x if recipe == "tensorwise" else quantise(x, recipe, 1)  # the forward's e4m3 x, re-scaled
  dw = quantise(x_kept, recipe, 0).T @ quantise(g, recipe, 0)
  return y, dx, dw


def run(spec, x, w, g, recipe):
  y, pull = jax.vjp(lambda x, w: fp8_gemm.einsum(spec, x, w, recipe), x, w)
  return (np.asarray(a, np.float64) for a in (y, *pull(g)))


def operands(seed, m=64, k=256, n=96):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, k)).astype(np.float32) * rng.lognormal(0, 1.5, (m, 1)).astype(np.float32)
  w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32) * rng.lognormal(0, 1, (1, n)).astype(np.float32)
  g = rng.standard_normal((m, n)).astype(np.float32) * rng.lognormal(0, 1, (m, 1)).astype(np.float32)
  return x, w, g


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
def test_each_gemm_equals_the_numpy_model_of_its_recipe(recipe):
  """Forward, input and weight gradients of "BTD,DF->BTF" equal the NumPy model of the recipe's quantisation
  (the same e4m3 values and scales; float32 against float64 sums)."""
  x, w, g = operands(1)
  got = run("BTD,DF->BTF", x.reshape(2, 32, -1), w, g.reshape(2, 32, -1), recipe)
  for name, a, b in zip(("y", "dx", "dw"), got, reference(x, w, g, recipe)):
    a = a.reshape(b.shape)
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * np.abs(b).max(), err_msg=f"{recipe} {name}")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
def test_a_projection_over_two_contracted_axes_is_the_flattened_gemm(recipe):
  """"BTNP,NPD->BTD" (attention's output projection: heads and head dim contracted) is the [B·T, N·P] × [N·P, D]
  GEMM of the same recipe."""
  x, w, g = operands(2, k=4 * 64, n=64)
  got = run("BTNP,NPD->BTD", x.reshape(2, 32, 4, 64), w.reshape(4, 64, 64), g.reshape(2, 32, 64), recipe)
  for name, a, b in zip(("y", "dx", "dw"), got, reference(x, w, g, recipe)):
    np.testing.assert_allclose(a.reshape(b.shape), b, rtol=2e-5, atol=2e-5 * np.abs(b).max(), err_msg=name)


# the relative (Frobenius) error of each GEMM against float32: e4m3 keeps 3 mantissa bits, so each operand's
# element is off by at most 2⁻⁴ of itself in the normal range; the errors of many products average out
BOUND = {"tensorwise": 2.0 ** -4, "rowwise": 2.0 ** -4, "mxfp8": 2.0 ** -4, "blockwise": 2.0 ** -4}


@pytest.mark.parametrize("recipe", sorted(BOUND))
def test_each_gemm_stays_within_the_recipe_bound_of_float32(recipe):
  x, w, g = operands(3)
  exact = (x.astype(np.float64) @ w, g.astype(np.float64) @ w.T, x.astype(np.float64).T @ g)
  got = run("BTD,DF->BTF", x.reshape(2, 32, -1), w, g.reshape(2, 32, -1), recipe)
  for name, a, b in zip(("y", "dx", "dw"), got, exact):
    rel = np.linalg.norm(a.reshape(b.shape) - b) / np.linalg.norm(b)
    lower = 2.0 ** -9 if recipe != "blockwise" or name == "y" else 0  # blockwise's gradients pass straight
    assert lower <= rel < BOUND[recipe], (recipe, name, rel)


def test_rowwise_scales_each_row_on_its_own():
  """A token 10⁴ times larger than the others leaves their precision alone under rowwise scaling, where one
  scale per tensor flushes them to zero."""
  x = np.full((4, 128), 0.01, np.float32)
  x[0] *= 1e6
  w = np.eye(128, dtype=np.float32)
  row = np.asarray(fp8_gemm.einsum("TD,DF->TF", x, w, "rowwise"))
  tensor = np.asarray(fp8_gemm.einsum("TD,DF->TF", x, w, "tensorwise"))
  np.testing.assert_allclose(row[1:], 0.01, rtol=2.0 ** -4)
  assert np.all(tensor[1:] == 0)


def test_the_activation_is_kept_for_the_backward_in_float8():
  """What the projection keeps for its backward: the activation as e4m3 (1 byte an element) and its scales,
  not the activation itself."""
  x = jnp.ones((2, 64, 256), jnp.bfloat16)
  w = jnp.ones((256, 128), jnp.bfloat16)
  _, pull = jax.vjp(lambda x: fp8_gemm.einsum("BTD,DF->BTF", x, w, "rowwise"), x)
  kept = [a for a in jax.tree.leaves(pull) if a.shape == x.shape]
  assert kept and all(a.dtype == jnp.float8_e4m3fn for a in kept), [(a.dtype, a.shape) for a in kept]


@pytest.mark.parametrize("setting,where,cc,expected", [
    (True, "gpu", 9.0, "rowwise"), ("auto", "gpu", 10.0, "mxfp8"), ("auto", "cpu", None, "rowwise"),
    (False, "gpu", 9.0, None), ("none", "cpu", None, None), ("blockwise", "gpu", 8.0, "blockwise"),
    ("tensorwise", "gpu", 8.9, "tensorwise")])
def test_the_recipe_follows_the_device(setting, where, cc, expected):
  assert fp8_gemm.resolve(setting, where, cc) == expected


@pytest.mark.parametrize("setting,cc,message", [
    ("auto", 8.0, r"sm_89 or later\), and this GPU is sm_80"), ("rowwise", 8.6, "sm_86"),
    ("mxfp8", 9.0, "mxfp8 needs Blackwell")])
def test_a_gpu_without_the_gemm_is_refused(setting, cc, message):
  with pytest.raises(UserError, match=message):
    fp8_gemm.resolve(setting, "gpu", cc)


def grouped_reference(x, sizes, w_in, w_down, dy):
  """NumPy model of the routed experts' FP8 grouped SwiGLU (rowwise): forward and input gradients scale rows over
  their width and weights per expert and output column; weight gradients scale per group and column over the
  group's rows, x from its forward e4m3 values. Returns y, dx, dw_in, dw_down."""
  E, m = w_in.shape[0], w_in.shape[2] // 2
  group = np.repeat(np.arange(E), sizes)
  R = len(group)
  q_rows = lambda a: quantise(a, "rowwise", 1)
  q_w = lambda w, axis: np.stack([quantise(w[e], "rowwise", axis) for e in range(E)])
  by_group = lambda a, w: np.stack([a[r] @ w[group[r]] for r in range(R)])
  gate_up = by_group(q_rows(x[:R]), q_w(w_in, 0))
  gate, up = gate_up[:, :m], gate_up[:, m:]
  sig = 1 / (1 + np.exp(-gate))
  h = gate * sig * up
  y = by_group(q_rows(h), q_w(w_down, 0))
  dh = by_group(q_rows(dy[:R]), q_w(np.swapaxes(w_down, 1, 2), 0))
  d_gate_up = np.concatenate([dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig], -1)
  dx = by_group(q_rows(d_gate_up), q_w(np.swapaxes(w_in, 1, 2), 0))
  x_kept = q_rows(x[:R])
  def per_group(a, b):
    return np.stack([quantise(a[group == e], "rowwise", 0).T @ quantise(b[group == e], "rowwise", 0)
                     if (group == e).any() else np.zeros((a.shape[1], b.shape[1])) for e in range(E)])

  return y, dx, per_group(x_kept, d_gate_up), per_group(h, dy[:R])


def test_the_experts_grouped_gemms_equal_the_numpy_model_of_rowwise_fp8():
  """The routed experts' five FP8 GEMMs (kernels/fp8_grouped.py): output, input gradient and both weight
  gradients equal the NumPy model of their scaling, with 6 rows past the groups giving zeros and nothing back."""
  from jaxseek.kernels import fp8_grouped

  rng = np.random.default_rng(4)
  R, D, m, E = 96, 64, 32, 4
  sizes = np.array([30, 0, 40, 20])
  x = rng.standard_normal((R, D)).astype(np.float32) * rng.lognormal(0, 1, (R, 1)).astype(np.float32)
  w_gate, w_up = (rng.standard_normal((2, E, D, m)) * 0.1).astype(np.float32)
  w_down = (rng.standard_normal((E, m, D)) * 0.1).astype(np.float32)
  dy = rng.standard_normal((R, D)).astype(np.float32)
  f = lambda x, wg, wu, wd: fp8_grouped.ffn(x, jnp.asarray(sizes, jnp.int32), wg, wu, wd, "rowwise", False)
  y, pull = jax.vjp(f, x, w_gate, w_up, w_down)
  dx, dwg, dwu, dwd = (np.asarray(a, np.float64) for a in pull(dy))
  ry, rdx, rdw_in, rdw_down = grouped_reference(x, sizes, np.concatenate([w_gate, w_up], -1), w_down, dy)
  close = lambda a, b, name: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max(), err_msg=name)
  y = np.asarray(y, np.float64)
  close(y[:90], ry, "y")
  close(dx[:90], rdx, "dx")
  assert not y[90:].any() and not dx[90:].any()
  close(np.concatenate([dwg, dwu], -1), rdw_in, "dw_in")
  close(dwd, rdw_down, "dw_down")


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_the_experts_grouped_gemms_scale_before_casting_to_float16(recipe):
  """With float16 compute the grouped GEMMs' e4m3 products (operands scaled to 448: sums far past float16's
  65,504) take their scales in float32 before the cast, so all five GEMMs are finite (casting first gave inf and
  NaN) and within the recipe's bound 2⁻⁴ of float32 compute: float16's roundings of the hidden activations move
  some e4m3 roundings by a step (measured up to 1.8e-2 tensorwise, 2.6e-3 rowwise)."""
  from jaxseek.kernels import fp8_grouped

  rng = np.random.default_rng(5)
  R, D, m, E = 96, 64, 32, 4
  sizes = jnp.asarray([30, 0, 40, 26], jnp.int32)
  x = rng.standard_normal((R, D)) * rng.lognormal(0, 1, (R, 1))
  w_gate, w_up = rng.standard_normal((2, E, D, m)) * 0.1
  w_down = rng.standard_normal((E, m, D)) * 0.1
  dy = rng.standard_normal((R, D))
  f16 = [np.asarray(a, np.float16) for a in (x, w_gate, w_up, w_down, dy)]  # the same values in both dtypes
  qx, _ = fp8_grouped._q(jnp.asarray(f16[0], jnp.float32), -1, recipe == "tensorwise")
  qw, _ = fp8_grouped._q(jnp.asarray(f16[1], jnp.float32), 1, recipe == "tensorwise")
  unscaled = jax.lax.ragged_dot(qx.astype(jnp.float32), qw.astype(jnp.float32), sizes)
  assert np.abs(unscaled).max() > np.finfo(np.float16).max  # what a cast before the scales overflows

  def run(dtype):
    x, wg, wu, wd, dy = (jnp.asarray(a, dtype) for a in f16)
    y, pull = jax.vjp(lambda *a: fp8_grouped.ffn(a[0], sizes, *a[1:], recipe, False), x, wg, wu, wd)
    return [np.asarray(a, np.float64) for a in (y, *pull(dy))]

  for name, a, b in zip(("y", "dx", "dw_gate", "dw_up", "dw_down"), run(jnp.float16), run(jnp.float32)):
    assert np.isfinite(a).all(), name
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    print(f"{recipe} {name}: float16 vs float32 {rel:.2e}")
    assert rel < BOUND[recipe], (name, rel)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "mxfp8", "blockwise"])
def test_fp8_with_float16_compute_trains_an_moe_model_as_float32_does(recipe):
  """train.fp8 with train.compute_dtype=float16 on tiny V3 (routed experts through kernels/fp8_grouped.py, except
  blockwise): three steps' losses and gradient norms are finite and track float32 compute to 1e-3 and 1e-2, six
  to eleven times what float16's roundings move them over the four recipes (at most 9.1e-5 and 1.7e-3)."""
  from test_precision import losses, train

  base = ("mesh.data=1", f"train.fp8={recipe}")
  f32, _, _ = train("tiny-v3", (*base, "train.compute_dtype=float32"), steps=3, devices=jax.devices()[:1])
  f16, _, _ = train("tiny-v3", (*base, "train.compute_dtype=float16"), steps=3, devices=jax.devices()[:1])
  norms = lambda records: np.array([float(r["grad_norm"]) for r in records])
  print(f"{recipe} float16 vs float32: loss {np.abs(losses(f16) / losses(f32) - 1).max():.1e}, "
        f"gradient norm {np.abs(norms(f16) / norms(f32) - 1).max():.1e}")
  assert np.isfinite(losses(f16)).all() and np.isfinite(norms(f16)).all()
  assert not any(r["skipped"] for r in f16)
  np.testing.assert_allclose(losses(f16), losses(f32), rtol=1e-3)
  np.testing.assert_allclose(norms(f16), norms(f32), rtol=1e-2)


@pytest.mark.parametrize("mesh", [("mesh.expert=2", "mesh.tensor=2"), ("mesh.fsdp=2", "mesh.tensor=2")])
def test_fp8_experts_on_a_mesh_equal_one_device(mesh):
  """Tiny V3's MoE layer with rowwise FP8 over expert × tensor and fsdp × tensor shards scales as one device does
  (a scale over the expert width split on `tensor` takes its maximum over the shards): its output and input
  gradient agree with one device's to 1e-6 (relative norm). Every e4m3 operand has the same bits on the mesh, so
  only float32's summation order differs (6.6e-8 to 8.0e-8 over 5 seeds and two shapes; 2.2e-7 without FP8):
  1e-6 is five times that floor, and per-shard scales give 2.3e-2 to 2.7e-2. Three steps' losses cannot tell the
  two apart (the optimiser amplifies rounding: 1.1e-4 with the fix, 2.3e-6 without, on some seeds)."""
  from flax import nnx
  from jax.sharding import NamedSharding

  from conftest import load_config
  from jaxseek.model.moe import MoE
  from jaxseek.sharding.mesh import make_mesh
  from jaxseek.sharding.rules import activation_spec

  B, T = 8, 6
  cfg = load_config("tiny-v3", "mesh.data=1", *mesh)
  layer = MoE(cfg.model, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(0), fp8="rowwise")
  rng = np.random.default_rng(0)
  x, dy = rng.standard_normal((2, B, T, cfg.model.hidden_size)).astype(np.float32)
  graphdef, state = nnx.split(layer)

  @jax.jit
  def y_and_dx(state, x, dy):
    y, pull = jax.vjp(lambda x: nnx.merge(graphdef, state)(x, jnp.ones((B, T), jnp.float32))[0], x)
    return y, pull(dy)[0]

  one = y_and_dx(state, x, dy)
  device_mesh = make_mesh(cfg, jax.devices()[:4])
  with jax.set_mesh(device_mesh):
    put = lambda a: jax.device_put(a, NamedSharding(device_mesh, activation_spec(("batch", "length", None))))
    got = y_and_dx(state, put(x), put(dy))
  for name, a, b in zip(("y", "dx"), got, one):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    print(f"fp8 experts on {mesh} vs one device, {name}: {rel:.1e}")
    assert rel < 1e-6, (name, rel)
