"""Cached decoding: one step runs the layer stacks over T new tokens (the whole prompt at prefill, one token per
decode step) and writes their keys into a per-layer cache of S slots.

Layout: prompts are left-padded to one length T0, so every row writes slot `start` at the same step; each row
has its own positions (0 at its first real token) and a key mask `valid` [B, S] (0 at padding). A query at slot
start + t sees key slot s when s ≤ start + t and valid[b, s].

Cache per stack (leading axis L = the stack's layers, scanned with the layer parameters):
  MLA:  ckv [L, B, S, C] (the normed latent) and kr [L, B, S, R] (the shared RoPE key), not full keys/values;
        decoding absorbs the up-projections (DeepSeek-V3 inference "absorb"):
          q_c = q_nope · W_uk  [B, T, N, C],  scores = (q_c · c_kv + q_rope · k_r) · scale,
          out = (softmax(scores) · c_kv) · W_uv  [B, T, N, P]
  GQA:  k, v [L, B, S, G, H].
Bytes per token and layer: MLA (C + R) · bytes, GQA 2 · G · H · bytes (`cache_bytes_per_token`).
The prefill (the prompts from slot 0) attends over its own keys through model.attention_impl, as training does
(blocked, a GPU kernel, or dense): no [T, S] scores for a long prompt. Decode steps (T = 1) score the cache.
Multi-token-prediction layers are not run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxseek.config import ModelConfig
from jaxseek.kernels.flash import NEG
from jaxseek.model.attention import MLA, attend, expand_latent
from jaxseek.model.transformer import STACKS, Block, Stack, Transformer



def cache_bytes_per_token(cfg: ModelConfig, dtype=jnp.float32) -> int:
  """Cache bytes per token and layer: MLA (kv_lora_rank + qk_rope_head_dim) · bytes, else 2 · G · H · bytes."""
  size = jnp.dtype(dtype).itemsize
  if cfg.is_mla:
    return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * size
  return 2 * cfg.kv_heads * cfg.dense_head_dim * size


def init_cache(model: Transformer, batch: int, length: int, dtype=jnp.float32) -> dict:
  """Zeros for every layer of both stacks (shapes read from the model's weights) and the key mask valid [B, S]."""
  B, S = batch, length
  cache: dict = {"valid": jnp.zeros((B, S), jnp.int32)}
  for name in STACKS:
    stack = getattr(model, name)
    if stack is None:
      continue
    attn, L = stack.blocks.attn, stack.num_layers
    if isinstance(attn, MLA):
      C, R = attn.w_dkv_DC.shape[-1], attn.w_kr_DR.shape[-1]
      cache[name] = {"ckv": jnp.zeros((L, B, S, C), dtype), "kr": jnp.zeros((L, B, S, R), dtype)}
    else:
      shape = (L, B, S) + tuple(attn.w_k_DGH.shape[-2:])
      cache[name] = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
  return cache


def cache_nbytes(cache: dict) -> int:
  """Bytes of the per-layer key caches (the mask not counted)."""
  return sum(a.nbytes for name in STACKS if name in cache for a in jax.tree.leaves(cache[name]))


def _write(cache_BS, new_BT, start):
  return jax.lax.dynamic_update_slice_in_dim(cache_BS, new_BT.astype(cache_BS.dtype), start, axis=1)


def prefill(start) -> bool:
  """Whether this step writes the prompts from slot 0 (a static 0): its queries see only its own keys."""
  return isinstance(start, int) and start == 0


def _prompt_attention(attn, q_BTNK, k_BTGK, v_BTGP, valid_BT):
  """The prefill's attention over its own keys through model.attention_impl (`attention.attend`: blocked, a GPU
  kernel, or dense), padding as segment 0 beside the prompt's segment 1: memory linear in the prompt length."""
  return attend(q_BTNK, k_BTGK, v_BTGP, (valid_BT > 0).astype(jnp.int32), attn.scale, impl=attn.impl)


def mla_step(attn: MLA, x_BTD, positions_BT, valid_BT, cache: dict, start, visible_BTS):
  """MLA over the latent cache with the up-projections absorbed into the query and the output; the prefill
  expands the prompt's latents to keys and values and runs the configured attention over them."""
  w = lambda p: p[...].astype(attn.dtype)
  q_BTNH, qr_BTNR, ckv_BTC, kr_BT1R = attn.project(x_BTD, positions_BT)
  ckv_BSC, kr_BSR = _write(cache["ckv"], ckv_BTC, start), _write(cache["kr"], kr_BT1R[:, :, 0], start)
  if prefill(start):
    k_BTNK, v_BTNP = expand_latent(ckv_BTC.astype(attn.dtype), kr_BT1R, w(attn.w_uk_CNH), w(attn.w_uv_CNP))
    out_BTNP = _prompt_attention(attn, jnp.concatenate([q_BTNH, qr_BTNR], -1), k_BTNK, v_BTNP, valid_BT)
    return jnp.einsum("BTNP,NPD->BTD", out_BTNP, w(attn.w_o_NPD)), {"ckv": ckv_BSC, "kr": kr_BSR}
  qc_BTNC = jnp.einsum("BTNH,CNH->BTNC", q_BTNH, w(attn.w_uk_CNH))
  scores_BNTS = (jnp.einsum("BTNC,BSC->BNTS", qc_BTNC, ckv_BSC.astype(attn.dtype), preferred_element_type=jnp.float32)
                 + jnp.einsum("BTNR,BSR->BNTS", qr_BTNR, kr_BSR.astype(attn.dtype),
                              preferred_element_type=jnp.float32)) * attn.scale
  scores_BNTS = jnp.where(visible_BTS[:, None], scores_BNTS, NEG)
  probs_BNTS = jax.nn.softmax(scores_BNTS, axis=-1).astype(attn.dtype)
  ctx_BTNC = jnp.einsum("BNTS,BSC->BTNC", probs_BNTS, ckv_BSC.astype(attn.dtype))
  out_BTNP = jnp.einsum("BTNC,CNP->BTNP", ctx_BTNC, w(attn.w_uv_CNP))
  return jnp.einsum("BTNP,NPD->BTD", out_BTNP, w(attn.w_o_NPD)), {"ckv": ckv_BSC, "kr": kr_BSR}


def gqa_step(attn, x_BTD, positions_BT, valid_BT, cache: dict, start, visible_BTS):
  """Multi-head / grouped-query attention over cached keys and values (N/G query heads share one, "n"); the
  prefill runs the configured attention over the prompt's own keys."""
  w = lambda p: p[...].astype(attn.dtype)
  q_BTNH, k_BTGH, v_BTGH = attn.project(x_BTD, positions_BT)
  k_BSGH, v_BSGH = _write(cache["k"], k_BTGH, start), _write(cache["v"], v_BTGH, start)
  if prefill(start):
    out_BTNH = _prompt_attention(attn, q_BTNH, k_BTGH, v_BTGH, valid_BT)
    return jnp.einsum("BTNH,NHD->BTD", out_BTNH, w(attn.w_o_NHD)), {"k": k_BSGH, "v": v_BSGH}
  B, T, N, H = q_BTNH.shape
  G = k_BSGH.shape[2]
  q_BTGnH = q_BTNH.reshape(B, T, G, N // G, H)
  scores_BGnTS = jnp.einsum("BTGnH,BSGH->BGnTS", q_BTGnH, k_BSGH.astype(attn.dtype),
                            preferred_element_type=jnp.float32) * attn.scale
  scores_BGnTS = jnp.where(visible_BTS[:, None, None], scores_BGnTS, NEG)
  probs_BGnTS = jax.nn.softmax(scores_BGnTS, axis=-1).astype(attn.dtype)
  out_BTNH = jnp.einsum("BGnTS,BSGH->BTGnH", probs_BGnTS, v_BSGH.astype(attn.dtype)).reshape(B, T, N, H)
  return jnp.einsum("BTNH,NHD->BTD", out_BTNH, w(attn.w_o_NHD)), {"k": k_BSGH, "v": v_BSGH}


def block_step(block: Block, x_BTD, positions_BT, valid_BT, start, visible_BTS, cache: dict):
  """Block.__call__ with the cached attention; the MoE routes each token as in training (padding not counted)."""
  attention = mla_step if isinstance(block.attn, MLA) else gqa_step
  a_BTD, cache = attention(block.attn, block.attn_norm(x_BTD), positions_BT, valid_BT, cache, start, visible_BTS)
  x_BTD = x_BTD + a_BTD
  h_BTD = block.mlp_norm(x_BTD)
  y_BTD = block.mlp(h_BTD, valid_BT)[0] if block.moe else block.mlp(h_BTD)
  return x_BTD + y_BTD, cache


def stack_step(stack: Stack, x_BTD, side: tuple, cache: dict):
  """The stack's layers by lax.scan, each layer's parameters and cache slice scanned together."""
  graphdef, state = nnx.split(stack.blocks)

  def body(x_BTD, inputs):
    layer_state, layer_cache = inputs
    return block_step(nnx.merge(graphdef, layer_state), x_BTD, *side, layer_cache)

  return jax.lax.scan(body, x_BTD, (state, cache))


def step(model: Transformer, tokens_BT, positions_BT, valid_BT, cache: dict, start) -> tuple[jax.Array, dict]:
  """Float32 logits [B, T, V] of T new tokens written at slots start..start+T-1, and the updated cache."""
  T, S = tokens_BT.shape[1], cache["valid"].shape[1]
  cache = dict(cache, valid=_write(cache["valid"], valid_BT.astype(jnp.int32), start))
  visible_BTS = ((jnp.arange(S)[None, None, :] <= start + jnp.arange(T)[None, :, None])
                 & (cache["valid"][:, None, :] > 0))
  side = (positions_BT, valid_BT.astype(jnp.float32), start, visible_BTS)
  x_BTD = model.embed(tokens_BT)
  for name in STACKS:
    stack = getattr(model, name)
    if stack is not None:
      x_BTD, cache[name] = stack_step(stack, x_BTD, side, cache[name])
  return model.head_logits(model.final_norm(x_BTD)), cache
