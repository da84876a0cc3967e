"""Building blocks: the parameter helper, RMSNorm, embedding, SwiGLU MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxseek.kernels import fp8_gemm
from jaxseek.sharding.rules import shard


def param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str | None, ...], dtype, std: float | None) -> nnx.Param:
  """A parameter with logical axis names (`names`, one per dimension); std=None means ones (norm scales)."""
  assert len(shape) == len(names), (shape, names)
  if std is None:
    value = jnp.ones(shape, dtype)
  else:
    value = std * jax.random.normal(rngs.params(), shape, dtype)
  return nnx.Param(value, logical_axes=tuple(names))


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x²) + eps) · w, computed in float32."""

  def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs, name: str = "embed"):
    self.scale_D = param(rngs, (dim,), (name,), param_dtype, None)
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale_D[...].astype(jnp.float32)).astype(x.dtype)


class Embed(nnx.Module):
  """Token embedding table E[V, D]."""

  def __init__(self, vocab: int, dim: int, std: float, *, param_dtype, dtype, rngs: nnx.Rngs):
    self.table_VD = param(rngs, (vocab, dim), ("vocab", "embed"), param_dtype, std)
    self.dtype = dtype

  def __call__(self, tokens_BT: jax.Array) -> jax.Array:
    # Gathering rows of a table sharded on D (fsdp) is not partitionable: keep only the vocab split (tensor),
    # which XLA turns into a masked local lookup plus an all-reduce.
    table_VD = shard(self.table_VD[...].astype(self.dtype), ("vocab", None))
    x_BTD = jnp.take(table_VD, tokens_BT, axis=0)
    return shard(x_BTD, ("batch", "residual_length", "embed"))


class MLP(nnx.Module):
  """SwiGLU: down(silu(x·W_gate) ⊙ x·W_up)."""

  def __init__(self, dim: int, hidden: int, std: float, *, param_dtype, dtype, rngs: nnx.Rngs,
               fp8: str | None = None):
    self.w_gate_DF = param(rngs, (dim, hidden), ("embed", "mlp"), param_dtype, std)
    self.w_up_DF = param(rngs, (dim, hidden), ("embed", "mlp"), param_dtype, std)
    self.w_down_FD = param(rngs, (hidden, dim), ("mlp", "embed"), param_dtype, std)
    self.dtype = dtype
    self.fp8 = fp8  # the GEMMs under this train.fp8 recipe (kernels/fp8_gemm.py)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    proj = lambda spec, x, p: fp8_gemm.einsum(spec, x, p[...].astype(self.dtype), self.fp8)
    gate_BTF = proj("BTD,DF->BTF", x_BTD, self.w_gate_DF)
    up_BTF = proj("BTD,DF->BTF", x_BTD, self.w_up_DF)
    h_BTF = shard(jax.nn.silu(gate_BTF) * up_BTF, ("batch", "length", "mlp"))
    return proj("BTF,FD->BTD", h_BTF, self.w_down_FD)
