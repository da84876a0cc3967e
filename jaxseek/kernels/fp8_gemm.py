"""FP8 training GEMMs (`train.fp8`): the projections DeepSeek-V3 runs in FP8, forward and backward.

A projection is an einsum of an activation x and a weight w whose contracted letters end x and begin w
("BTD,DF->BTF", "BTNP,NPD->BTD"). With a recipe, its three GEMMs, the forward y = x·w, the input gradient
dx = dy·wᵀ and the weight gradient dw = xᵀ·dy, each multiply float8 e4m3 operands with float32 accumulation.
Every operand is scaled along the dimension its GEMM contracts, so one scale multiplies each output element:

  tensorwise  one scale per tensor (amax / 448), current scaling: XLA's native FP8 GEMM (cuBLASLt, sm_89+)
  rowwise     one scale per row of the contraction: per token for x and dy, per output column for w in the
              forward, per input row for w in dx, per channel over the tokens for x and dy in dw. The scales
              multiply the float32 product outside the GEMM, so it is still one FP8 GEMM (sm_89+)
  mxfp8       one power-of-two (e8m0) scale per 32 consecutive elements of the contraction: Blackwell's
              block-scaled GEMM (`jax.nn.scaled_matmul`, cuDNN, sm_100)
  blockwise   DeepSeek's 1×128 activation tiles and 128×128 weight blocks (kernels/fp8.py): emulated, the
              numerics reference (no XLA GEMM takes scales inside the contraction on Hopper)

The activation is kept for the backward as e4m3 with its forward scales (1 byte an element, not 2); the weight
gradient re-scales it along the tokens from those values, as DeepSeek's recipe turns 1×128 tiles into 128×1.
On CPU, where XLA has no FP8 GEMM, the same code runs and XLA:CPU multiplies the e4m3 values after upcasting
them: the numbers are the recipe's, checked against NumPy references in tests/test_precision.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxseek.errors import UserError
from jaxseek.kernels import fp8, gpu

E4M3, E4M3_MAX = fp8.E4M3, fp8.E4M3_MAX
RECIPES = ("tensorwise", "rowwise", "mxfp8", "blockwise")
SETTINGS = ("none", "auto", *RECIPES)
FP8_SM = 8.9  # Ada and Hopper: float8 GEMMs in cuBLASLt
MXFP8_SM = 10.0  # Blackwell: block-scaled (MX) GEMMs
MX_BLOCK = 32
# the projections the model runs through `einsum` (their letters name their GEMMs in HLO, forward and backward),
# and the routed experts' scope (kernels/grouped.py): what DeepSeek's recipe runs in FP8
PROJECTIONS = ("BTD,DF->BTF", "BTF,FD->BTD", "BTD,DNH->BTNH", "BTD,DGH->BTGH", "BTNH,NHD->BTD", "BTD,DQ->BTQ",
               "BTQ,QNH->BTNH", "BTQ,QNR->BTNR", "BTD,DNR->BTNR", "BTD,DC->BTC", "BTD,DR->BTR", "BSC,CNH->BSNH",
               "BSC,CNP->BSNP", "BTNP,NPD->BTD")
EXPERTS_SCOPE = "routed_experts"


def in_recipe(op_name: str) -> bool:
  """Whether an HLO op named `op_name` is a GEMM the FP8 recipe covers: a projection's (forward, or its gradients:
  the FP8 backward's own letters sit under the forward's scope) or the routed experts'."""
  return EXPERTS_SCOPE in op_name or "/fp8_" in op_name or any(p in op_name for p in PROJECTIONS)


LABELS = {"tensorwise": "float8 GEMMs, one scale per tensor", "rowwise": "float8 GEMMs, one scale per row",
          "mxfp8": "float8 block-scaled GEMMs, one e8m0 scale per 32", "blockwise":
          "DeepSeek's 1×128 / 128×128 scaling, emulated in the compute dtype"}


def resolve(setting: bool | str, where: str, cc: float | None) -> str | None:
  """train.fp8 as the recipe that runs on platform `where` with CUDA compute capability `cc` (None: off).
  auto (and true) is mxfp8 from sm_100, rowwise on sm_89 and sm_90, and rowwise off GPUs (XLA upcasts there);
  a GPU below sm_89 has no FP8 GEMM and is refused."""
  setting = {True: "auto", False: "none"}.get(setting, setting) if isinstance(setting, bool) else setting
  if setting == "none":
    return None
  if setting not in SETTINGS:
    raise UserError(f"config key train.fp8: {setting!r} is not one of false, true, {', '.join(SETTINGS)}")
  if where == "gpu" and setting != "blockwise":
    if cc is None or cc < FP8_SM:
      raise UserError(f"config key train.fp8: {setting} needs float8 GEMMs (CUDA sm_89 or later), and this GPU is "
                      f"{'not CUDA' if cc is None else f'sm_{int(cc)}{round(cc % 1 * 10)}'}; use train.fp8=blockwise "
                      f"(emulated) or false")
    if setting == "mxfp8" and cc < MXFP8_SM:
      raise UserError(f"config key train.fp8: mxfp8 needs Blackwell's block-scaled GEMMs (sm_100); this GPU is "
                      f"sm_{int(cc)}{round(cc % 1 * 10)}: use rowwise or auto")
  if setting == "auto":
    return "mxfp8" if where == "gpu" and cc is not None and cc >= MXFP8_SM else "rowwise"
  return setting


class Letters:
  """The letters of a projection einsum "xs,ws->ys": c the contracted (ending xs, beginning ws), xb the rest of
  x, wo the rest of w; ys must be xb + wo."""

  def __init__(self, spec: str):
    inputs, self.ys = spec.replace(" ", "").split("->")
    self.xs, self.ws = inputs.split(",")
    self.c = "".join(a for a in self.xs if a in self.ws and a not in self.ys)
    self.xb, self.wo = self.xs[:len(self.xs) - len(self.c)], self.ws[len(self.c):]
    if self.xs != self.xb + self.c or self.ws != self.c + self.wo or self.ys != self.xb + self.wo:
      raise ValueError(f"{spec}: a projection contracts the letters ending x with those beginning w")


def einsum(spec: str, x: jax.Array, w: jax.Array, recipe: str | None, upcast: bool = False) -> jax.Array:
  """jnp.einsum(spec, x, w) with its forward and both gradients' GEMMs run as `recipe` says (None: as is);
  `upcast`: each GEMM multiplies float32 copies of its e4m3 operands (the same sums; the GPU check's reference)."""
  if recipe is None:
    return _flat(spec, x, w) if flat_gemm() else jnp.einsum(spec, x, w)
  if recipe == "blockwise":
    return _blockwise(spec, x, w)
  return _projection(spec, recipe, upcast)(x, w)


def flat_gemm() -> bool:
  """Whether a projection runs as one matrix product of x's rows (its leading letters merged) and w's columns:
  on CPU, where no mesh axis splits x past its leading dimension (context and tensor of size 1)."""
  if gpu.platform() != "cpu":
    return False
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.empty or all(mesh.shape.get(a, 1) == 1 for a in ("context", "tensor"))


def _flat(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """jnp.einsum(spec, x, w) as [rows, K] · [K, columns]: XLA:CPU then gives the weight gradient one contracted
  dimension (the rows) and runs it without first copying the gradient transposed."""
  n = Letters(spec)
  lead, out = x.shape[:len(n.xb)], w.shape[len(n.c):]
  K = math.prod(w.shape[:len(n.c)])
  with jax.named_scope(spec):
    return _rows(x.reshape(-1, K), w.reshape(K, -1)).reshape(*lead, *out)


def _rows(x: jax.Array, w: jax.Array) -> jax.Array:
  """x·w of two matrices; 16-bit ones by `_rows16`."""
  if x.dtype != w.dtype or x.dtype.itemsize != 2:
    return jnp.dot(x, w)
  return _rows16(x, w)


@jax.custom_vjp
def _rows16(x: jax.Array, w: jax.Array) -> jax.Array:
  """x·w of 16-bit matrices accumulated in float32 and rounded once, and so both gradients: XLA:CPU runs a 16-bit
  product with a 16-bit output on float32 copies of its operands (40 ms at [2048, 512]·[512, 4096] on the 2-core
  test machine), with a float32 output on the 16-bit operands (16 ms; docs/cpu.md)."""
  return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _rows16_fwd(x, w):
  return _rows16(x, w), (x, w)


def _rows16_bwd(residuals, dy):
  x, w = residuals
  return (jnp.matmul(dy, w.T, preferred_element_type=jnp.float32).astype(x.dtype),
          jnp.matmul(x.T, dy, preferred_element_type=jnp.float32).astype(w.dtype))


_rows16.defvjp(_rows16_fwd, _rows16_bwd)


def _blockwise(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """The emulated DeepSeek recipe: x rounded per 1×128 tile of its contraction, w per 128×128 block of its
  [contraction, output] matrix, gradients straight through."""
  n = Letters(spec)
  k = len(n.c)
  K = math.prod(w.shape[:k])
  x_t = fp8.tiles(x.reshape(*x.shape[:x.ndim - k], K)).reshape(x.shape)
  w_b = fp8.blocks(w.reshape(K, -1)).reshape(w.shape)
  return jnp.einsum(spec, x_t, w_b)


@functools.lru_cache(maxsize=None)
def _projection(spec: str, recipe: str, upcast: bool):
  """The custom-gradient projection `spec` under `recipe` (tensorwise, rowwise or mxfp8)."""
  n = Letters(spec)
  dx_spec, dw_spec = f"{n.ys},{n.ws}->{n.xs}", f"{n.xs},{n.ys}->{n.ws}"
  quant = _mx_quant if recipe == "mxfp8" else functools.partial(_quant, rowwise=recipe == "rowwise")
  gemm = functools.partial(_mx_gemm if recipe == "mxfp8" else _gemm, upcast=upcast)

  @jax.custom_vjp
  def project(x, w):
    return forward(x, w)[0]

  def forward(x, w):
    with jax.named_scope(f"fp8_{recipe}"):
      qx, sx = quant(x, _axes(n.xs, n.c))
      qw, sw = quant(w, _axes(n.ws, n.c))
      y = gemm(spec, qx, sx, qw, sw, jnp.result_type(x, w))
    return y, (qx, sx, w, jnp.zeros((), x.dtype))

  def backward(residuals, g):
    qx, sx, w, x_like = residuals
    with jax.named_scope(f"fp8_{recipe}_backward"):
      qg, sg = quant(g, _axes(n.ys, n.wo))
      qw, sw = quant(w, _axes(n.ws, n.wo))
      dx = gemm(dx_spec, qg, sg, qw, sw, x_like.dtype)
      if recipe == "tensorwise":  # one scale whatever the contraction: the forward's operands serve again
        qx_t, sx_t = qx, sx
      else:
        x = _dequant(qx, sx, recipe)[tuple(slice(0, d) for d in (*g.shape[:len(n.xb)], *w.shape[:len(n.c)]))]
        qx_t, sx_t = quant(x, _axes(n.xs, n.xb))
      qg_t, sg_t = quant(g, _axes(n.ys, n.xb)) if recipe != "tensorwise" else (qg, sg)
      dw = gemm(dw_spec, qx_t, sx_t, qg_t, sg_t, w.dtype)
    return dx, dw

  project.defvjp(forward, backward)
  return project


def _axes(letters: str, contracted: str) -> tuple[int, ...]:
  return tuple(i for i, a in enumerate(letters) if a in contracted)


def _quant(a: jax.Array, axes: tuple[int, ...], rowwise: bool) -> tuple[jax.Array, jax.Array]:
  """a as e4m3 and float32 scales (amax / 448), one per slice along `axes` (rowwise) or one for the tensor,
  with a's rank (size 1 along the axes)."""
  a32 = a.astype(jnp.float32)
  amax = jnp.max(jnp.abs(a32), axis=axes if rowwise else None, keepdims=True)
  scale = fp8._scale(amax)
  return (a32 / scale).astype(E4M3), scale


def _dequant(q: jax.Array, scale: jax.Array, recipe: str) -> jax.Array:
  if recipe == "mxfp8":
    return _mx_dequant(q, scale)
  return q.astype(jnp.float32) * scale


def _gemm(spec: str, qa, sa, qb, sb, dtype, upcast: bool = False) -> jax.Array:
  """einsum of two e4m3 operands accumulated in float32, times their scales (each constant along the
  contraction), in `dtype`."""
  inputs, out = spec.split("->")
  la, lb = inputs.split(",")
  if upcast:
    qa, qb = qa.astype(jnp.float32), qb.astype(jnp.float32)
  y = jnp.einsum(spec, qa, qb, preferred_element_type=jnp.float32)
  return (y * _to_output(sa, la, out) * _to_output(sb, lb, out)).astype(dtype)


def _to_output(scale: jax.Array, letters: str, out: str) -> jax.Array:
  """A keepdims scale in `letters` layout, broadcast against the output's `out` layout (its contracted axes,
  size 1, dropped)."""
  kept = {a: scale.shape[i] for i, a in enumerate(letters) if a in out}
  return scale.reshape([kept.get(a, 1) for a in out])


def _mx_quant(a: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """a as e4m3 with one power-of-two scale per block of 32 along the last of `axes` (OCP MX: the block's amax
  / 448 rounded up to a power of two, so nothing overflows), that axis zero-padded to whole blocks; scales
  [..., n / 32, ...] as float32."""
  axis = axes[-1]
  a32 = fp8._pad_to(jnp.moveaxis(a.astype(jnp.float32), axis, -1), -1, MX_BLOCK)  # zeros add nothing to a sum
  blocks = a32.reshape(*a32.shape[:-1], a32.shape[-1] // MX_BLOCK, MX_BLOCK)
  amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
  mant, exp = jnp.frexp(amax / E4M3_MAX)  # amax / 448 = mant · 2^exp, mant in [0.5, 1)
  scale = jnp.where(amax > 0, jnp.ldexp(jnp.ones_like(mant), exp - (mant == 0.5)), 1.0)
  q = jnp.clip(blocks / scale, -E4M3_MAX, E4M3_MAX).astype(E4M3).reshape(a32.shape)
  return jnp.moveaxis(q, -1, axis), jnp.moveaxis(scale[..., 0], -1, axis)


def _mx_dequant(q: jax.Array, scale: jax.Array) -> jax.Array:
  """The values `_mx_quant` encoded (the scales' blocks lie along the axis where q is 32× longer)."""
  axis = next(i for i, (a, b) in enumerate(zip(q.shape, scale.shape)) if a != b)
  return q.astype(jnp.float32) * jnp.repeat(scale, MX_BLOCK, axis=axis)


def _mx_gemm(spec: str, qa, sa, qb, sb, dtype, upcast: bool = False) -> jax.Array:
  """The block-scaled product: Blackwell's MX GEMM (jax.nn.scaled_matmul) on GPU, the dequantised operands'
  float32 einsum elsewhere (the same sums)."""
  if upcast or gpu.platform() != "gpu":
    return jnp.einsum(spec, _mx_dequant(qa, sa), _mx_dequant(qb, sb),
                      preferred_element_type=jnp.float32).astype(dtype)
  with jax.named_scope(spec):  # the einsum's letters in the GEMM's HLO name
    return _mx_scaled_matmul(spec, qa, sa, qb, sb).astype(dtype)


def _mx_scaled_matmul(spec: str, qa, sa, qb, sb) -> jax.Array:
  """`spec` as one [1, M, K] × [1, N, K] block-scaled matmul: each operand's kept letters flattened first and its
  contracted letters last, in the order a lists them."""
  inputs, out = spec.split("->")
  la, lb = inputs.split(",")
  c = "".join(a for a in la if a in lb and a not in out)
  ka, kb = "".join(a for a in la if a not in c), "".join(a for a in lb if a not in c)

  def as_3d(q, s, letters, kept):
    order = [letters.index(a) for a in kept + c]
    q, s = jnp.transpose(q, order), jnp.transpose(s, order)
    rows = math.prod(q.shape[:len(kept)])
    return q.reshape(1, rows, -1), s.reshape(1, rows, -1).astype(jnp.float8_e8m0fnu)

  a3, sa3 = as_3d(qa, sa, la, ka)
  b3, sb3 = as_3d(qb, sb, lb, kb)
  y = jax.nn.scaled_matmul(a3, b3, sa3, sb3, preferred_element_type=jnp.float32)
  shape = {a: d for a, d in zip(la, qa.shape)} | {a: d for a, d in zip(lb, qb.shape)}
  y = y.reshape([shape[a] for a in ka + kb])
  return jnp.transpose(y, [(ka + kb).index(a) for a in out])
