"""Rotary position embedding (RoPE) with optional YaRN frequency scaling, in rotate-half layout.

Checkpoints that store rope columns interleaved (DeepSeek's own) are permuted on conversion, so the model
has one layout.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxseek.kernels.gpu import platform


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(dim: int, theta: float, scaling: dict | None) -> tuple[np.ndarray, float]:
  """Returns (inv_freq [dim/2], attention_factor applied to cos/sin).

  Without scaling: inv_freq_i = theta^(-2i/dim). With YaRN (`scaling["type"|"rope_type"] == "yarn"`), low
  frequencies are interpolated by `factor`, high ones kept, with a linear ramp between the dimensions that
  complete `beta_fast` and `beta_slow` rotations over `original_max_position_embeddings`.
  """
  pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  inv_extra = 1.0 / pos_freqs
  kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
  if not scaling or kind in (None, "default"):
    return inv_extra.astype(np.float32), 1.0
  if kind != "yarn":
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: yarn)")
  factor = float(scaling["factor"])
  original = scaling["original_max_position_embeddings"]
  mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
  attention_factor = scaling.get("attention_factor")
  if attention_factor is None:
    if mscale and mscale_all_dim:
      attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    else:
      attention_factor = _yarn_mscale(factor)
  beta_fast = scaling.get("beta_fast") or 32
  beta_slow = scaling.get("beta_slow") or 1

  def correction_dim(rotations: float) -> float:
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if scaling.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp
  inv_inter = 1.0 / (factor * pos_freqs)
  inv_freq = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
  return inv_freq.astype(np.float32), float(attention_factor)


def softmax_scale_factor(scaling: dict | None) -> float:
  """YaRN's extra softmax scale for DeepSeek MLA: mscale(factor, mscale_all_dim)², else 1."""
  if not scaling or not scaling.get("mscale_all_dim"):
    return 1.0
  return _yarn_mscale(float(scaling["factor"]), scaling["mscale_all_dim"]) ** 2


def rotary(positions_BT: jax.Array, inv_freq, attention_factor: float) -> tuple[jax.Array, jax.Array]:
  """cos and sin [B, T, 1, R] (float32, times attention_factor) of the angles positions × inv_freq, each
  frequency twice (rotate-half layout), for every head of a layer's queries and keys.

  On CPU, where positions lie in [0, T) (a training or evaluation batch: offsets inside its documents), they are
  rows of a [T, 2, R] table looked up by position, inside a conditional whose other branch computes them
  directly (any other positions, a decode step's). The conditional's result is a buffer the rotations read:
  otherwise XLA:CPU fuses cos and sin into each of their consumers and evaluates them again for every head in
  each (a layer's backward had 7 fusions that did, 8% of a zero-bubble pipeline step's CPU time). The values
  are the same either way."""
  if platform() != "cpu":
    return _cos_sin(positions_BT[..., None], inv_freq, attention_factor)
  T = positions_BT.shape[1]

  def looked_up(p_BT):
    table_T2R = jnp.stack(_cos_sin(jnp.arange(T, dtype=positions_BT.dtype), inv_freq, attention_factor), axis=1)
    rows_BT2R = jnp.take(table_T2R, p_BT, axis=0, mode="clip")
    return rows_BT2R[:, :, :1], rows_BT2R[:, :, 1:]

  inside = jnp.all((positions_BT >= 0) & (positions_BT < T))
  return jax.lax.cond(inside, looked_up, lambda p_BT: _cos_sin(p_BT[..., None], inv_freq, attention_factor),
                      positions_BT)


def _cos_sin(positions, inv_freq, attention_factor: float) -> tuple[jax.Array, jax.Array]:
  """cos and sin of positions[..., None] × inv_freq, each frequency twice, times attention_factor."""
  angles_r = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
  angles_R = jnp.concatenate([angles_r, angles_r], axis=-1)
  return jnp.cos(angles_R) * attention_factor, jnp.sin(angles_R) * attention_factor


def apply_rope(x_BTNR: jax.Array, rotary_BT1R: tuple[jax.Array, jax.Array]) -> jax.Array:
  """x * cos + rotate_half(x) * sin in float32, with `rotary`'s cos and sin."""
  cos, sin = rotary_BT1R
  x = x_BTNR.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * cos + rotated * sin).astype(x_BTNR.dtype)
