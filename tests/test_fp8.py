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
