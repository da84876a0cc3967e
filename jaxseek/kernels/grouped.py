"""The experts' grouped SwiGLU: rows sorted by expert, one GEMM per expert group.

`expert_ffn` runs the grouped matmul `model.moe_matmul` resolves to (`choice.matmul_kind`): `ffn_blocked` (row
blocks padded per expert, visited in a loop, with a custom backward whose weight-gradient loop a zero-bubble
pipeline can run apart), `ffn_ragged` (`lax.ragged_dot`, TPU) or `ffn_tokamax` (tokamax's GPU grouped GEMM).
`experts_local` is the dropless computation on one shard: sort the token copies by expert, the grouped SwiGLU,
the weighted unsort. Shape key: R rows sorted by expert, E experts (e local), D model, m expert hidden (a tensor
shard's), n rows of a block, N blocks; X tokens, K experts per token.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxseek.kernels import choice, fp8_gemm, fp8_grouped, gpu

EXPERT_SCOPE = fp8_gemm.EXPERTS_SCOPE


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) ⊙ up in float32 from the GEMMs' outputs, cast back to their dtype, as the FP8 recipes' grouped GEMMs
  compute it (kernels/fp8_grouped.py): the experts in bfloat16 and in FP8 differ in their GEMMs only. The backward
  keeps gate and up in their own dtype and takes the derivative in float32 from them (autodiff would keep their
  float32 copies: 2.2 GiB more on bench-v3-1b at batch 8 on an H200)."""
  return _swiglu_fwd(gate, up)[0]


def _swiglu_fwd(gate, up):
  return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype), (gate, up)


def _swiglu_bwd(residuals, dy):
  gate, up = residuals
  g, u, d = gate.astype(jnp.float32), up.astype(jnp.float32), dy.astype(jnp.float32)
  sig = jax.nn.sigmoid(g)
  return (d * u * sig * (1 + g * (1 - sig))).astype(gate.dtype), (d * g * sig).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def ffn_ragged(x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD):
  """SwiGLU per expert group with `lax.ragged_dot` (a grouped GEMM on accelerators)."""
  gate_Rm = jax.lax.ragged_dot(x_RD, w_gate_EDm, sizes_E)
  up_Rm = jax.lax.ragged_dot(x_RD, w_up_EDm, sizes_E)
  return jax.lax.ragged_dot(swiglu(gate_Rm, up_Rm), w_down_EmD, sizes_E)


def ffn_blocked(x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD):
  """SwiGLU per expert group over row blocks, each block padded to one expert (the CPU grouped matmul).

  XLA:CPU lowers `ragged_dot` to a dense product with every group (E× the work). Here each group is padded to a
  multiple of the block size n and a loop visits the blocks in use, each block one expert's matmuls with that
  expert's weights read in place, so the work is at most R + E·n rows and nothing E-sized is materialised.
  On CPU the blocks are twice as tall (a taller matmul keeps both cores of a small machine busy) and, in float32,
  the backward reads the forward's gate and up products instead of computing them again (docs/cpu.md; in 16-bit
  compute XLA:CPU carries the recomputed products into SwiGLU in float32, which kept ones would round). Other
  platforms keep the memory instead.
  """
  R, D = x_RD.shape
  E = w_gate_EDm.shape[0]
  cpu = choice.platform() == "cpu"
  n = 2 ** int(math.log2(min(max(R // ((2 if cpu else 4) * E), 8), 256)))
  blocks = -(-(R + E * (n - 1)) // n)
  padded_E = -(-sizes_E // n) * n
  ends_E, padded_ends_E = jnp.cumsum(sizes_E), jnp.cumsum(padded_E)
  row_R = jnp.arange(R)
  group_R = _count_at_most(ends_E, row_R)  # E past the last group: rows outside every group
  dest_R = jnp.where(group_R < E, (padded_ends_E - padded_E).at[group_R].get(mode="clip") + row_R
                     - (ends_E - sizes_E).at[group_R].get(mode="clip"), blocks * n)
  x_NnD = jnp.zeros((blocks * n, D), x_RD.dtype).at[dest_R].set(x_RD, mode="drop").reshape(blocks, n, D)
  expert_N = jnp.minimum(_count_at_most(padded_ends_E, jnp.arange(blocks) * n), E - 1)
  # Under shard_map, give every operand the same varying mesh axes here, where autodiff turns that broadcast's
  # transpose into the reductions the gradients need, so the custom backward below works on equal types.
  zero = varying_zero(x_NnD, w_gate_EDm, w_up_EDm, w_down_EmD)
  x_NnD, w_gate_EDm, w_up_EDm, w_down_EmD = (a + zero.astype(a.dtype)
                                             for a in (x_NnD, w_gate_EDm, w_up_EDm, w_down_EmD))
  y_NnD = _swiglu_blocks(x_NnD, expert_N, padded_ends_E[-1] // n, w_gate_EDm, w_up_EDm, w_down_EmD,
                         keep=cpu and x_RD.dtype == jnp.float32)
  return y_NnD.reshape(blocks * n, D).at[dest_R].get(mode="fill", fill_value=0)


def _count_at_most(sorted_E: jax.Array, query_Q: jax.Array) -> jax.Array:
  """searchsorted(sorted, query, side="right") as one comparison [Q, E]: jnp.searchsorted's vmap fails inside a
  shard_map under an enclosing vmap with spmd_axis_name (train.grad_compression)."""
  return (query_Q[:, None] >= sorted_E[None, :]).sum(-1, dtype=jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _swiglu_blocks(x_NnD, expert_N, used, w_gate_EDm, w_up_EDm, w_down_EmD, keep=False):
  """y[i] = SwiGLU of block i with expert expert_N[i]'s weights for i < used, zeros after. `keep`: the forward's
  gate and up products are kept for the backward (else it computes them again)."""
  return _swiglu_blocks_fwd(x_NnD, expert_N, used, w_gate_EDm, w_up_EDm, w_down_EmD, keep)[0]


def varying_zero(*arrays) -> jax.Array:
  """A scalar 0 that varies over every manual mesh axis any of `arrays` varies over (inside shard_map, operands,
  the two branches of a cond and a scan's carry must agree on that). No gradient flows back through it: the
  empty sums would tie each operand's cotangent to the others' (an input's to the weights'), which would keep a
  zero-bubble pipeline's W from running apart from its b."""
  return jax.lax.stop_gradient(sum(a.reshape(-1)[:0].sum().astype(jnp.float32) for a in arrays))


def _swiglu_blocks_fwd(x_NnD, expert_N, used, w_gate_EDm, w_up_EDm, w_down_EmD, keep=False):
  def block(_, inputs):
    x_nD, e, i = inputs

    def run():
      gate_nm, up_nm = x_nD @ w_gate_EDm[e], x_nD @ w_up_EDm[e]
      y_nD = (swiglu(gate_nm, up_nm) @ w_down_EmD[e]).astype(x_nD.dtype)
      return (y_nD, gate_nm, up_nm) if keep else y_nD

    def skipped():
      zeros = jnp.zeros_like(x_nD)
      if not keep:
        return zeros
      hidden = jnp.zeros((x_nD.shape[0], w_gate_EDm.shape[-1]), jnp.result_type(x_nD, w_gate_EDm))
      hidden = hidden + varying_zero(x_nD, w_gate_EDm).astype(hidden.dtype)
      return zeros, hidden, hidden

    return None, jax.lax.cond(i < used, run, skipped)

  _, out = jax.lax.scan(block, None, (x_NnD, expert_N, jnp.arange(x_NnD.shape[0])))
  y_NnD, hidden = (out[0], out[1:]) if keep else (out, None)
  return y_NnD, (x_NnD, expert_N, used, w_gate_EDm, w_up_EDm, w_down_EmD, hidden)


def _swiglu_blocks_bwd(keep, residuals, dy_NnD):
  """Two loops over the blocks: the first recomputes each block's gate and up products (or reads the kept ones) and
  gives the input's cotangent, with the hidden cotangents and activations the weight gradients need; the second
  accumulates each expert's weight gradients in place from those, in float32 (cast to the weights' dtype at the
  end). Each matmul runs once; a zero-bubble pipeline's W (pipeline/wsplit.py) runs the second loop apart from the
  first. As the FP8 recipes' grouped backward (kernels/fp8_grouped.py): the GEMMs' outputs in the compute dtype,
  SwiGLU's derivative in float32, the hidden cotangents cast back, the input gradient summed over gate and up in
  float32."""
  x_NnD, expert_N, used, w_gate_EDm, w_up_EDm, w_down_EmD, hidden = residuals
  zero = varying_zero(dy_NnD, x_NnD)  # dy may vary over fewer axes than the operands
  blocks = jnp.arange(x_NnD.shape[0])
  dtype = jnp.result_type(x_NnD, w_gate_EDm)
  f32 = lambda a: a.astype(jnp.float32)

  def input_block(_, inputs):
    x_nD, dy_nD, e, i, kept = inputs

    def backward():
      gate_nm, up_nm = kept if kept else (x_nD @ w_gate_EDm[e], x_nD @ w_up_EDm[e])
      gate_nm, up_nm = f32(gate_nm), f32(up_nm)
      sig_nm = jax.nn.sigmoid(gate_nm)
      act_nm = gate_nm * sig_nm
      dh_nm = f32(dy_nD @ w_down_EmD[e].T)
      dup_nm = (dh_nm * act_nm).astype(dtype)
      dgate_nm = (dh_nm * up_nm * sig_nm * (1 + gate_nm * (1 - sig_nm))).astype(dtype)
      input_grad = lambda d_nm, w_Dm: jnp.matmul(d_nm, w_Dm.T, preferred_element_type=jnp.float32)
      dx_nD = (input_grad(dgate_nm, w_gate_EDm[e]) + input_grad(dup_nm, w_up_EDm[e])).astype(x_nD.dtype)
      return dx_nD, dgate_nm, dup_nm, (act_nm * up_nm).astype(dtype)

    def skipped():
      m = w_gate_EDm.shape[-1]
      hidden = jnp.zeros((x_nD.shape[0], m), dtype) + zero.astype(x_nD.dtype)
      return jnp.zeros_like(x_nD) + zero.astype(x_nD.dtype), hidden, hidden, hidden

    return None, jax.lax.cond(i < used, backward, skipped)

  _, (dx_NnD, dgate_Nnm, dup_Nnm, h_Nnm) = jax.lax.scan(input_block, None,
                                                               (x_NnD, dy_NnD, expert_N, blocks, hidden or ()))

  def weight_block(grads, inputs):
    x_nD, dy_nD, dgate_nm, dup_nm, h_nm, e, i = inputs
    product = lambda a, b: jnp.matmul(a.T, b, preferred_element_type=jnp.float32)

    def add(dw_gate, dw_up, dw_down):
      return (dw_gate.at[e].add(product(x_nD, dgate_nm)), dw_up.at[e].add(product(x_nD, dup_nm)),
              dw_down.at[e].add(product(h_nm, dy_nD)))

    return jax.lax.cond(i < used, add, lambda *g: g, *grads), None

  # accumulated over the blocks in float32 (in the compute dtype each block's addition would round the sum)
  weights = (w_gate_EDm, w_up_EDm, w_down_EmD)
  zeros = tuple(jnp.zeros(w.shape, jnp.float32) + zero for w in weights)
  grads, _ = jax.lax.scan(weight_block, zeros, (x_NnD, dy_NnD, dgate_Nnm, dup_Nnm, h_Nnm, expert_N, blocks))
  return (dx_NnD, None, None, *(g.astype(w.dtype) for g, w in zip(grads, weights)))


_swiglu_blocks.defvjp(_swiglu_blocks_fwd, _swiglu_blocks_bwd)


def ffn_tokamax(x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD, implementation="mosaic", pad_to=None):
  """SwiGLU per expert group with tokamax's grouped GEMM kernels (GPU): gate and up as one [D, 2m] product. The
  rows are padded to whole Mosaic tiles (the weight gradient's kernel takes R in multiples of 64); padded rows lie
  past the groups and give zeros."""
  R = x_RD.shape[0]
  pad = -R % (pad_to or (choice.MOSAIC_GEMM_TILE if implementation == "mosaic" else 1))
  x_RD = jnp.pad(x_RD, ((0, pad), (0, 0))) if pad else x_RD
  w_in_ED2m = jnp.concatenate([w_gate_EDm, w_up_EDm], axis=-1)
  gate_up_R2m = gpu.tokamax_ragged_dot(x_RD, w_in_ED2m, sizes_E, implementation)
  gate_Rm, up_Rm = jnp.split(gate_up_R2m, 2, axis=-1)
  return gpu.tokamax_ragged_dot(swiglu(gate_Rm, up_Rm), w_down_EmD, sizes_E, implementation)[:R]


def expert_ffn(x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD, matmul: str | tuple = "auto") -> jax.Array:
  """SwiGLU of rows sorted by expert (group e has sizes_E[e] rows; rows past the groups give zeros), by the
  grouped matmul `matmul` (model.moe_matmul) resolves to (`choice.matmul_kind`); (model.moe_matmul, a train.fp8
  recipe, the manual mesh axes m is split over): its GEMMs in FP8 (kernels/fp8_grouped.py: tokamax's Triton
  kernel on GPU)."""
  with jax.named_scope(EXPERT_SCOPE):  # names the experts' GEMMs in HLO and profiles (explore/compile.py counts them)
    if not isinstance(matmul, str):
      matmul, recipe, axes = matmul
      return fp8_grouped.ffn(x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD, recipe, choice.platform() == "gpu",
                             axes)
    kind = choice.matmul_kind(matmul, dtype=x_RD.dtype, dims=(x_RD.shape[-1], w_gate_EDm.shape[-1]))
    if kind in choice.GPU_MATMUL:
      return ffn_tokamax(x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD, choice.GPU_MATMUL[kind])
    ffn = ffn_blocked if kind == "blocked" else ffn_ragged
    return ffn(x_RD, sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD)


def experts_local(x_XD, idx_XK, weights_XK, w_gate_EDm, w_up_EDm, w_down_EmD, matmul: str = "auto",
                  padded: bool = False) -> jax.Array:
  """Dropless expert computation on one shard: sort token copies by expert, grouped matmuls, weighted unsort.

  With `padded`, an id ≥ E selects no expert (zero output). Returns the (partial, if m < M) output [X, D].
  """
  X, K = idx_XK.shape
  E = w_gate_EDm.shape[0]
  flat_e = idx_XK.reshape(-1)
  order = jnp.argsort(flat_e, stable=True)
  token_of = order // K
  sizes_E = jnp.bincount(flat_e, length=E).astype(jnp.int32)
  y_sorted = expert_ffn(x_XD[token_of], sizes_E, w_gate_EDm, w_up_EDm, w_down_EmD, matmul)
  y_sorted = y_sorted * weights_XK.reshape(-1)[order][:, None].astype(y_sorted.dtype)
  if padded:  # rows past the groups are undefined on some backends (a [R, D] mask, kept for the backward)
    y_sorted = jnp.where((flat_e[order] < E)[:, None], y_sorted, 0)
  return jnp.zeros_like(x_XD).at[token_of].add(y_sorted)
