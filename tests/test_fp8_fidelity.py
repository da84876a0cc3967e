"""Gradient fidelity of train.fp8 (benchmarks/fp8_fidelity.py's measurement on a tiny model): each recipe's
gradient against float32 compute on the same parameters and batch, and planted scaling faults.

Tiny V3 (configs/tiny-v3.yaml: 3 layers, 2 of them MoE with 8 routed experts) at its initialisation, one batch
of 4 × 24 random tokens; the error is ‖g − g₃₂‖ / ‖g₃₂‖, g₃₂ from train.compute_dtype=float32 without FP8, over all
parameters and over the routed experts' weights alone. Measured, bfloat16 compute (float16):

  train.fp8        whole model      routed experts
  false            1.02% (0.09%)    5.86% (0.11%)
  rowwise          5.05% (5.33%)    17.5% (20.4%)
  tensorwise       5.92% (5.87%)    23.5% (21.1%)
  mxfp8            5.36% (5.55%)    17.4% (18.5%)
  blockwise        4.87% (4.63%)    17.7% (15.0%)

The experts' errors are large because a token routed to other experts than float32 routes it moves its whole
contribution (bfloat16 routes 1 of the 96 tokens differently in one layer, rowwise 2 and 4; float16 none). BOUND and
EXPERTS_BOUND are 1.5 × the larger of the two dtypes' errors, rounded up: room for another XLA's roundings and
summation order (or one more token routed elsewhere), and still below every planted fault. Each fault is planted
in rowwise's or tensorwise's scaling code, in the projections (kernels/fp8_gemm.py) or in the routed experts
(kernels/fp8_grouped.py); whole model / experts, rowwise unless said:

  (a) wrong axis: operands divided by rowwise scales over the wrong axis (one per element of the contraction, its
      largest magnitude over the rows) while the product is multiplied by the right axis's scales:
      projections 4,660% / 62%, experts 10.1% / 54%
  (b) dropped scale: the weight's scale left out of the product (the gradient's in a projection's weight
      gradient): projections 8.5e12% / 100%, experts 165% / 100% (tensorwise 2.3e12% / 100%, 177% / 100%)
  (c) the float32 product cast to the compute dtype before its scales multiply it: in float16 the unscaled e4m3
      product (operands up to 448) overflows and the gradient is not finite, rowwise and tensorwise, either site.
      bfloat16 has float32's range: there the cast is one more rounding by at most 2⁻⁹ and no gradient error can
      tell it (rowwise 5.05% → 5.07%, tensorwise 5.92% → 5.92%); the test plants it in float16.

Out of reach by design: scales on the wrong axis applied consistently (the operand dequantised before the product,
so only the precision changes) give rowwise 5.66%, within the bound; tests/test_fp8.py's NumPy models pin each
GEMM's scaling exactly.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CONFIGS, load_config
from jaxseek import step as step_lib
from jaxseek.kernels import fp8, fp8_gemm, fp8_grouped
from jaxseek.sharding.mesh import make_mesh

sys.path.insert(0, str(CONFIGS.parent / "benchmarks"))
import common  # noqa: E402
import fp8_fidelity  # noqa: E402

B, T = 4, 24
BOUND = {"false": 0.016, "rowwise": 0.08, "tensorwise": 0.09, "mxfp8": 0.085, "blockwise": 0.075}
EXPERTS_BOUND = {"false": 0.09, "rowwise": 0.31, "tensorwise": 0.36, "mxfp8": 0.28, "blockwise": 0.27}


@pytest.fixture(scope="module")
def model():
  """(gradient(recipe, compute dtype) → (flat gradient, mask of the routed experts' weights), the float32
  reference's flat gradient, that mask) at tiny V3's initialisation on one batch."""
  cfg = load_config("tiny-v3", "mesh.data=1", f"train.batch_size={B}", f"train.seq_len={T}")
  mesh = make_mesh(cfg, jax.devices()[:1])
  state = step_lib.make_trainer(cfg, mesh).init()
  tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, T + 1), dtype=np.int32)
  batch = common.token_batch(tokens, mesh)

  def gradient(recipe, dtype):
    cfg = load_config("tiny-v3", "mesh.data=1", f"train.batch_size={B}", f"train.seq_len={T}",
                      f"train.fp8={recipe}", f"train.compute_dtype={dtype}")
    return fp8_fidelity.flat(fp8_fidelity.gradient_fn(cfg, mesh)(state.params, state.biases, batch))

  return gradient, *gradient("false", "float32")


def _wrong_axis(site, dtype, monkeypatch):
  """Rowwise scales over the wrong axis: the values divided by one scale per element of the contraction (its
  largest magnitude over the rows), the product multiplied by the right one."""
  def quant(a, axes, rowwise):
    a32 = a.astype(jnp.float32)
    other = tuple(i for i in range(a.ndim) if i not in axes)
    wrong = fp8._scale(jnp.max(jnp.abs(a32), axis=other if rowwise else None, keepdims=True))
    right = fp8._scale(jnp.max(jnp.abs(a32), axis=axes if rowwise else None, keepdims=True))
    return (a32 / wrong).astype(fp8.E4M3), right

  def q(a, axis, per_tensor, axes=()):
    a32 = a.astype(jnp.float32)
    other = tuple(i for i in range(a.ndim) if i != axis % a.ndim)
    wrong = fp8_grouped._scale(a32, other, per_tensor, axes)
    return (a32 / wrong).astype(fp8.E4M3), fp8_grouped._scale(a32, axis, per_tensor, axes)

  if site == "projections":
    monkeypatch.setattr(fp8_gemm, "_quant", quant)
  else:
    monkeypatch.setattr(fp8_grouped, "_q", q)


def _dropped_scale(site, dtype, monkeypatch):
  """The second operand's scale left out of the product: the weight's (the gradient's in a projection's weight
  gradient)."""
  gemm, q = fp8_gemm._gemm, fp8_grouped._q

  def grouped_q(a, axis, *args):  # axis 1: a weight [E, K, N]
    values, scale = q(a, axis, *args)
    return values, scale * 0 + 1 if axis == 1 else scale

  if site == "projections":
    monkeypatch.setattr(fp8_gemm, "_gemm", lambda spec, qa, sa, qb, sb, *a, **k: gemm(spec, qa, sa, qb, sb * 0 + 1,
                                                                                      *a, **k))
  else:
    monkeypatch.setattr(fp8_grouped, "_q", grouped_q)


def _cast_before_scaling(site, dtype, monkeypatch):
  """The e4m3 product cast to the compute dtype before its scales multiply it."""
  def gemm(spec, qa, sa, qb, sb, out_dtype, upcast=False):
    inputs, out = spec.split("->")
    la, lb = inputs.split(",")
    y = jnp.einsum(spec, qa, qb, preferred_element_type=jnp.float32).astype(out_dtype)
    return (y * fp8_gemm._to_output(sa, la, out) * fp8_gemm._to_output(sb, lb, out)).astype(out_dtype)

  cast = lambda f: lambda *a: f(*a).astype(dtype).astype(jnp.float32)
  if site == "projections":
    monkeypatch.setattr(fp8_gemm, "_gemm", gemm)
  else:
    monkeypatch.setattr(fp8_grouped, "_ragged", cast(fp8_grouped._ragged))
    monkeypatch.setattr(fp8_grouped, "_per_group", cast(fp8_grouped._per_group))


FAULTS = {"wrong_axis": _wrong_axis, "dropped_scale": _dropped_scale, "cast_before_scaling": _cast_before_scaling}


@pytest.fixture
def fresh_kernels():
  """The FP8 kernels' cached custom-gradient functions hold the helpers a fault replaces: rebuilt before and
  after."""
  clear = lambda: (fp8_gemm._projection.cache_clear(), fp8_grouped._ffn.cache_clear())
  clear()
  yield
  clear()


SITES = ("projections", "experts")
CASES = [(r, d, None, None) for d in ("bfloat16", "float16") for r in BOUND] + [
    (recipe, dtype, fault, site) for recipe, dtype, fault in [
        ("rowwise", "bfloat16", "wrong_axis"), ("rowwise", "bfloat16", "dropped_scale"),
        ("tensorwise", "bfloat16", "dropped_scale"), ("rowwise", "float16", "cast_before_scaling"),
        ("tensorwise", "float16", "cast_before_scaling")] for site in SITES]


@pytest.mark.parametrize("recipe,dtype,fault,site", CASES, ids=["-".join(filter(None, c)) for c in CASES])
def test_gradient_error_against_float32_tells_a_planted_scaling_fault(model, monkeypatch, fresh_kernels, recipe,
                                                                      dtype, fault, site):
  """The clean recipe's gradient lies within BOUND[recipe] of float32 compute's over the whole model and within
  EXPERTS_BOUND[recipe] over the routed experts' weights; with a fault planted in the projections' or the
  experts' GEMMs one of the two lies outside (a gradient that is not finite counts as outside)."""
  gradient, reference, expert = model
  if fault is not None:
    FAULTS[fault](site, jnp.dtype(dtype), monkeypatch)
  g, _ = gradient(recipe, dtype)
  whole, experts = fp8_fidelity.relative(g, reference), fp8_fidelity.relative(g[expert], reference[expert])
  print(f"{recipe} {dtype} {fault or 'clean'} {site or ''}: whole model {whole:.4g} (bound {BOUND[recipe]}), "
        f"experts {experts:.4g} (bound {EXPERTS_BOUND[recipe]})")
  within = whole < BOUND[recipe] and experts < EXPERTS_BOUND[recipe]
  assert within == (fault is None), (whole, experts)
