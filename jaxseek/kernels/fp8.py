"""FP8 numerics of the DeepSeek-V3 recipe (§3.3), `train.fp8=true`.

The inputs of the MLP and expert projections are rounded to float8 e4m3 with fine-grained scales: activations
per 1×128 tile (one token, 128 consecutive channels of the contraction dimension), weights per 128×128 block.
Each tile's scale maps its largest magnitude to e4m3's largest finite value, 448, so nothing overflows and the
rounding error of an element is at most 2⁻⁴ of it (3 mantissa bits), or 2⁻¹⁰ of the scale where the element
falls below e4m3's normal range. The matmul then runs on the rounded values with float32 accumulation.

This is an emulation on every backend: values are rounded to e4m3 and back (quantise → dequantise), so the
numbers are those of FP8 training, not its speed; an FP8 kernel with per-tile scales (DeepGEMM-style) is
outside what XLA fuses today. Gradients pass straight through the rounding (the backward matmuls run in the
compute dtype on the rounded operands). The embedding, the head, the router, norms and attention stay in their
own precision, as in the recipe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
TILE = 128


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  pad = -x.shape[axis] % multiple
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def _scale(amax: jax.Array) -> jax.Array:
  """amax · (1/448) (the product XLA also makes of amax / 448, spelled out so references can match it bit for bit)."""
  return jnp.where(amax > 0, amax * (1.0 / E4M3_MAX), 1.0)


def _round(x32: jax.Array, amax: jax.Array) -> jax.Array:
  scale = _scale(amax)
  return (x32 / scale).astype(E4M3).astype(jnp.float32) * scale


def quantize_tiles(x: jax.Array, tile: int = TILE) -> jax.Array:
  """x rounded to e4m3 with one scale per 1×`tile` tile of its last axis (returned in x's dtype)."""
  return from_e4m3_tiles(*to_e4m3_tiles(x, tile), x.dtype, tile)


def to_e4m3_tiles(x: jax.Array, tile: int = TILE) -> tuple[jax.Array, jax.Array]:
  """x [..., n] as e4m3 values [..., n] and float32 scales [..., ⌈n/tile⌉], one per 1×`tile` tile (amax / 448)."""
  n = x.shape[-1]
  x32 = _pad_to(x.astype(jnp.float32), -1, tile)
  tiles = x32.reshape(*x32.shape[:-1], -1, tile)
  amax = jnp.abs(tiles).max(-1)
  scale = _scale(amax)
  q = (tiles / scale[..., None]).astype(E4M3).reshape(x32.shape)[..., :n]
  return q, scale


def from_e4m3_tiles(q: jax.Array, scale: jax.Array, dtype, tile: int = TILE) -> jax.Array:
  """The values `to_e4m3_tiles` encoded, in `dtype`."""
  n = q.shape[-1]
  q32 = _pad_to(q.astype(jnp.float32), -1, tile)
  tiles = q32.reshape(*q32.shape[:-1], -1, tile) * scale[..., None]
  return tiles.reshape(q32.shape)[..., :n].astype(dtype)


def quantize_blocks(w: jax.Array, tile: int = TILE) -> jax.Array:
  """w rounded to e4m3 with one scale per `tile`×`tile` block of its last two axes (leading axes: experts)."""
  k, n = w.shape[-2:]
  w32 = _pad_to(_pad_to(w.astype(jnp.float32), -1, tile), -2, tile)
  K, N = w32.shape[-2:]
  blocks = w32.reshape(*w32.shape[:-2], K // tile, tile, N // tile, tile)
  amax = jnp.abs(blocks).max(axis=(-3, -1), keepdims=True)
  return _round(blocks, amax).reshape(w32.shape)[..., :k, :n].astype(w.dtype)


def straight_through(x: jax.Array, rounded: jax.Array) -> jax.Array:
  """`rounded` in the forward pass, identity for the gradient."""
  return x + jax.lax.stop_gradient(rounded - x)


def tiles(x: jax.Array) -> jax.Array:
  """An activation as an FP8 matmul sees it (1×128 tiles along its last, contracted axis)."""
  return straight_through(x, quantize_tiles(x))


def blocks(w: jax.Array) -> jax.Array:
  """A weight [..., K, N] as an FP8 matmul sees it (128×128 blocks)."""
  return straight_through(w, quantize_blocks(w))
