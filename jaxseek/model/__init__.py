"""The DeepSeek model family as Flax NNX modules: single-device math with logical axis names.

Shape suffixes (global, logical shapes; inside shard_map a lowercase letter is the local shard):

  B batch             T query position      S key position       D model (hidden_size)
  F dense hidden      M expert hidden       N heads              G kv heads (grouped-query attention)
  H qk head dim       R rope dim            P v head dim         C kv_lora_rank
  Q q_lora_rank       V vocab               L layers             E routed experts
  K experts per token X tokens flattened (B·T)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxseek.config import ModelConfig
from jaxseek.kernels import fp8_gemm
from jaxseek.model.transformer import RunStack, Transformer
from jaxseek.sharding import experts

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def build(cfg: ModelConfig, *, seed: int = 0, param_dtype: str = "float32", dtype: str = "float32",
          remat: str = "none", fp8: str | None = None, run_stack: RunStack | None = None,
          exchange: experts.Settings | None = None) -> Transformer:
  """Builds the model with freshly initialised parameters (wrap in nnx.eval_shape to allocate nothing).
  `run_stack` runs each layer stack where it returns a result (a pipeline schedule: pipeline.stages.stack_runner,
  which expects the stacks in its storage order), else the stack's own lax.scan; `fp8`: the train.fp8 recipe
  of the projections' GEMMs (kernels/fp8_gemm.py; `resolve` turns a setting into one for a device); `exchange`: how the MoE layers exchange token
  copies on the mesh (default: from cfg, all expert shards in one node)."""
  if fp8 not in (None, *fp8_gemm.RECIPES):
    raise ValueError(f"fp8={fp8!r}: the model takes a recipe (kernels/fp8_gemm.resolve gives it for a device)")
  return Transformer(cfg, rngs=nnx.Rngs(seed), param_dtype=DTYPES[param_dtype], dtype=DTYPES[dtype], remat=remat,
                     fp8=fp8, run_stack=run_stack, exchange=exchange)


def count_params(cfg: ModelConfig) -> int:
  """Number of parameters, computed from shapes only (nothing is allocated)."""
  abstract = nnx.eval_shape(lambda: build(cfg))
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
