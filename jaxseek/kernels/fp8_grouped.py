"""FP8 GEMMs of the routed experts' grouped SwiGLU (train.fp8): the counterpart of kernels/fp8_gemm.py for rows
sorted by expert.

y = SwiGLU(x·W_in[e])·W_down[e] for the rows of each expert group e, with its five GEMMs (two forward, the input
gradients of both, the weight gradients of both) multiplying float8 e4m3 operands in float32. Each operand is
scaled along what its GEMM contracts, so the scales multiply the float32 product outside the GEMM:

  forward, input gradients  a row's scale over its width; a weight's per expert and output column
  weight gradients          per expert group and column, over the group's rows (its rows' e4m3 values from the
                            forward, re-scaled), so each expert's gradient is one scaled GEMM of its own rows

rowwise and mxfp8 scale so (a grouped GEMM with 1×32 block scales is not in tokamax 0.0.12 for Hopper, so
Blackwell's routed experts also scale rowwise); tensorwise takes one scale per tensor. On GPU the grouped GEMMs are
tokamax's Triton kernel on e4m3 operands; elsewhere `lax.ragged_dot` on their values (XLA:CPU has no FP8 GEMM).
Shape key as kernels/grouped.py: R rows, E experts, D model, m expert hidden.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxseek.kernels import fp8, gpu

E4M3 = fp8.E4M3
CONTRACT_ROWS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def ffn(x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD, recipe: str, on_gpu: bool,
        axes: tuple[str, ...] = ()) -> jax.Array:
  """The grouped SwiGLU of rows sorted by expert (rows past the groups give zeros) with FP8 GEMMs. `axes`: the
  manual mesh axes the expert hidden width m is split over (inside shard_map): the scales of the GEMMs that
  contract m take their maximum over them, so every shard scales as one device would."""
  w_in_ED2m = jnp.concatenate([w_gate_EDm, w_up_EDm], axis=-1)
  return _ffn(recipe == "tensorwise", on_gpu, tuple(axes))(x_RD, sizes_E, w_in_ED2m, w_down_EmD)


def _scale(a32: jax.Array, axis, per_tensor: bool, axes: tuple[str, ...] = ()) -> jax.Array:
  amax = jnp.max(jnp.abs(a32), axis=None if per_tensor else axis, keepdims=True)
  return fp8._scale(jax.lax.pmax(amax, axes) if axes else amax)


def _q(a: jax.Array, axis, per_tensor: bool, axes: tuple[str, ...] = ()) -> tuple[jax.Array, jax.Array]:
  """a as e4m3 and its float32 scales along `axis` (one for the tensor when `per_tensor`; over the mesh `axes`
  too, where `axis` is split over them)."""
  a32 = a.astype(jnp.float32)
  s = _scale(a32, axis, per_tensor, axes)
  return (a32 / s).astype(E4M3), s


def _q_groups(a_RN: jax.Array, group_R: jax.Array, E: int, per_tensor: bool,
              axes: tuple[str, ...] = ()) -> tuple[jax.Array, jax.Array]:
  """a as e4m3 with one scale per expert group and column over the group's rows: (values [R, N], scales [E, N]);
  per tensor, one scale over the mesh `axes` too."""
  a32 = a_RN.astype(jnp.float32)
  if per_tensor:
    s = _scale(a32, None, True, axes)
    return (a32 / s).astype(E4M3), jnp.broadcast_to(s, (E, a32.shape[1]))
  amax = jax.ops.segment_max(jnp.abs(a32), group_R, num_segments=E + 1)[:E]  # rows past the groups: segment E
  s_EN = fp8._scale(jnp.maximum(amax, 0))
  return (a32 / s_EN.at[group_R].get(mode="clip")).astype(E4M3), s_EN


def _ragged(q_RK, q_EKN, sizes_E, on_gpu: bool) -> jax.Array:
  """[R, K] × [E, K, N] by group → float32 [R, N] (unscaled e4m3 operands of up to 448: its sums reach K·448²,
  past float16's 65,504, so it stays float32 until the scales have multiplied it)."""
  if on_gpu:
    return gpu.tokamax_module().ragged_dot(q_RK, q_EKN, sizes_E, preferred_element_type=jnp.float32,
                                           implementation="triton")
  return jax.lax.ragged_dot(q_RK.astype(jnp.float32), q_EKN.astype(jnp.float32), sizes_E,
                            preferred_element_type=jnp.float32)


def _per_group(q_RK, q_RN, sizes_E, on_gpu: bool) -> jax.Array:
  """Σ over each group's rows of a[r]ᵀ·b[r] → float32 [E, K, N] (the weight gradient's GEMM; the size of the
  weights, so float32 costs little)."""
  if on_gpu:
    return gpu.tokamax_module().ragged_dot_general(
        q_RK, q_RN, sizes_E, ragged_dot_dimension_numbers=CONTRACT_ROWS, preferred_element_type=jnp.float32,
        implementation="triton")
  return jax.lax.ragged_dot_general(q_RK.astype(jnp.float32), q_RN.astype(jnp.float32), sizes_E, CONTRACT_ROWS,
                                    preferred_element_type=jnp.float32)


def _group_of_rows(sizes_E: jax.Array, R: int) -> jax.Array:
  """Each row's expert group (E for rows past the groups)."""
  return (jnp.arange(R)[:, None] >= jnp.cumsum(sizes_E)[None, :]).sum(-1, dtype=jnp.int32)


@functools.lru_cache(maxsize=None)
def _ffn(per_tensor: bool, on_gpu: bool, axes: tuple[str, ...]):
  """The custom-gradient grouped SwiGLU for one scaling (per tensor, or rowwise) and kernel. `q_m` quantises an
  operand of a GEMM that contracts m (split over `axes`); `q` any other (one scale per tensor spans the shards)."""
  q_m = lambda a, axis: _q(a, axis, per_tensor, axes)
  q = lambda a, axis: _q(a, axis, per_tensor, axes if per_tensor else ())

  def gemm(name, q_a, s_a, q_w, s_w_EN, sizes_E, group_R, dtype):
    """Rows × their expert's weight, the row scales [R, 1] and the weight's [E, 1, N] applied outside to the
    float32 product, then cast to `dtype` (the unscaled product overflows float16)."""
    s_RN = s_w_EN.reshape(()) if per_tensor else s_w_EN.reshape(s_w_EN.shape[0], -1).at[group_R].get(mode="clip")
    with jax.named_scope(name):  # the GEMM's letters in its HLO name
      return (_ragged(q_a, q_w, sizes_E, on_gpu) * s_a * s_RN).astype(dtype)

  def forward(x_RD, sizes_E, w_in_ED2m, w_down_EmD):
    R, E = x_RD.shape[0], w_in_ED2m.shape[0]
    group_R = _group_of_rows(sizes_E, R)
    qx, sx = q(x_RD, -1)
    dtype = x_RD.dtype
    gate_up_R2m = gemm("RD,EDM->RM", qx, sx, *q(w_in_ED2m, 1), sizes_E, group_R, dtype)
    gate_Rm, up_Rm = jnp.split(gate_up_R2m.astype(jnp.float32), 2, axis=-1)
    h_Rm = (jax.nn.silu(gate_Rm) * up_Rm).astype(dtype)
    y_RD = gemm("RM,EMD->RD", *q_m(h_Rm, -1), *q_m(w_down_EmD, 1), sizes_E, group_R, dtype)
    return y_RD, (qx, sx, gate_up_R2m, sizes_E, w_in_ED2m, w_down_EmD)

  @jax.custom_vjp
  def run(x_RD, sizes_E, w_in_ED2m, w_down_EmD):
    return forward(x_RD, sizes_E, w_in_ED2m, w_down_EmD)[0]

  def backward(residuals, dy_RD):
    qx, sx, gate_up_R2m, sizes_E, w_in_ED2m, w_down_EmD = residuals
    R, E, dtype = qx.shape[0], w_in_ED2m.shape[0], gate_up_R2m.dtype
    group_R = _group_of_rows(sizes_E, R)
    gate_Rm, up_Rm = jnp.split(gate_up_R2m.astype(jnp.float32), 2, axis=-1)
    sig_Rm = jax.nn.sigmoid(gate_Rm)
    h_Rm = (gate_Rm * sig_Rm * up_Rm).astype(dtype)
    # input gradients: contract the output width (each weight scaled per expert and input row)
    w_down_T = jnp.swapaxes(w_down_EmD, 1, 2)  # [E, D, m]
    dh_Rm = gemm("RD,EMD->RM", *q(dy_RD, -1), *q(w_down_T, 1), sizes_E, group_R, dtype).astype(jnp.float32)
    d_up = dh_Rm * gate_Rm * sig_Rm
    d_gate = dh_Rm * up_Rm * sig_Rm * (1 + gate_Rm * (1 - sig_Rm))
    d_gate_up_R2m = jnp.concatenate([d_gate, d_up], axis=-1).astype(dtype)
    w_in_T = jnp.swapaxes(w_in_ED2m, 1, 2)  # [E, 2m, D]
    dx_RD = gemm("RM,EDM->RD", *q_m(d_gate_up_R2m, -1), *q_m(w_in_T, 1), sizes_E, group_R, dtype)
    # weight gradients: contract each group's rows (both operands scaled per group and column)
    x_RD = qx.astype(jnp.float32) * sx  # the forward's e4m3 rows

    def weight_grad(name, a_RK, b_RN, like):
      qa, sa_EK = _q_groups(a_RK, group_R, E, per_tensor, axes)
      qb, sb_EN = _q_groups(b_RN, group_R, E, per_tensor, axes)
      with jax.named_scope(name):
        product = _per_group(qa, qb, sizes_E, on_gpu)
      return (product * sa_EK[:, :, None] * sb_EN[:, None, :]).astype(like.dtype)

    dw_in = weight_grad("RD,RM->EDM", x_RD, d_gate_up_R2m, w_in_ED2m)
    dw_down = weight_grad("RM,RD->EMD", h_Rm, dy_RD, w_down_EmD)
    return dx_RD, None, dw_in, dw_down

  run.defvjp(forward, backward)
  return run
