"""Decoder blocks, the two scanned layer stacks (dense, then MoE) and the language model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxseek.config import ModelConfig
from jaxseek.model.attention import make_attention
from jaxseek.model.layers import MLP, Embed, RMSNorm, param
from jaxseek.model.moe import MoE
from jaxseek.sharding.rules import shard

ACT_BTD = ("batch", "length", "embed")


class Block(nnx.Module):
  """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x)) with a dense MLP or the MoE."""

  def __init__(self, cfg: ModelConfig, moe: bool, *, param_dtype, dtype, rngs: nnx.Rngs):
    D, eps = cfg.hidden_size, cfg.rms_norm_eps
    self.attn_norm = RMSNorm(D, eps, param_dtype=param_dtype, rngs=rngs)
    self.attn = make_attention(cfg, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
    self.mlp_norm = RMSNorm(D, eps, param_dtype=param_dtype, rngs=rngs)
    if moe:
      self.mlp = MoE(cfg, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
    else:
      self.mlp = MLP(D, cfg.intermediate_size, cfg.initializer_range, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
    self.moe = moe

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, valid_BT):
    x_BTD = shard(x_BTD + self.attn(self.attn_norm(x_BTD), positions_BT, segment_ids_BT), ACT_BTD)
    h_BTD = self.mlp_norm(x_BTD)
    if self.moe:
      y_BTD, aux = self.mlp(h_BTD, valid_BT)
    else:
      y_BTD, aux = self.mlp(h_BTD), {}
    return shard(x_BTD + y_BTD, ACT_BTD), aux


class Stack(nnx.Module):
  """`num_layers` identical blocks whose parameters are stacked on a leading "layers" axis, run by lax.scan."""

  def __init__(self, cfg: ModelConfig, num_layers: int, moe: bool, *, param_dtype, dtype, remat: str,
               rngs: nnx.Rngs):

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> Block:
      return Block(cfg, moe, param_dtype=param_dtype, dtype=dtype, rngs=rngs)

    self.blocks = make(rngs)
    for _, node in nnx.iter_graph(self.blocks):
      if isinstance(node, nnx.Variable):
        node.set_metadata(logical_axes=("layers",) + tuple(node.get_metadata()["logical_axes"]))
    self.remat = remat

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, valid_BT):
    graphdef, state = nnx.split(self.blocks)

    def body(x_BTD, layer_state):
      return nnx.merge(graphdef, layer_state)(x_BTD, positions_BT, segment_ids_BT, valid_BT)

    if self.remat == "full":
      body = jax.checkpoint(body)
    return jax.lax.scan(body, x_BTD, state)


class Transformer(nnx.Module):
  """The DeepSeek language model: embedding, dense stack, MoE stack, final norm, head."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32,
               remat: str = "none"):
    D, V, std = cfg.hidden_size, cfg.vocab_size, cfg.initializer_range
    kw = dict(param_dtype=param_dtype, dtype=dtype, remat=remat, rngs=rngs)
    self.embed = Embed(V, D, std, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
    self.dense_layers = Stack(cfg, cfg.num_dense_layers, False, **kw) if cfg.num_dense_layers else None
    self.moe_layers = Stack(cfg, cfg.num_moe_layers, True, **kw) if cfg.num_moe_layers else None
    self.final_norm = RMSNorm(D, cfg.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.head_DV = None if cfg.tie_word_embeddings else param(rngs, (D, V), ("embed", "vocab"), param_dtype, std)
    self.dtype = dtype

  def forward(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
              segment_ids_BT: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Returns float32 logits [B, T, V] and aux: hidden [B, T, D], per-MoE-layer `load` [L, E], `balance` [L, B].

    `segment_ids` > 0 label packed documents (attention stays inside one); 0 marks padding.
    """
    B, T = tokens_BT.shape
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid_BT = jnp.ones((B, T), jnp.float32) if segment_ids_BT is None else (segment_ids_BT > 0).astype(jnp.float32)
    x_BTD = self.embed(tokens_BT)
    aux: dict[str, jax.Array] = {}
    for stack in (self.dense_layers, self.moe_layers):
      if stack is not None:
        x_BTD, layer_aux = stack(x_BTD, positions_BT, segment_ids_BT, valid_BT)
        aux.update(layer_aux)
    h_BTD = self.final_norm(x_BTD)
    aux["hidden"] = h_BTD
    head_DV = self.embed.table_VD[...].T if self.head_DV is None else self.head_DV[...]
    logits_BTV = jnp.einsum("BTD,DV->BTV", h_BTD, head_DV.astype(self.dtype), preferred_element_type=jnp.float32)
    return shard(logits_BTV, ("batch", "length", "vocab")), aux

  def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
               segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """Float32 logits [B, T, V]."""
    return self.forward(tokens_BT, positions_BT, segment_ids_BT)[0]
