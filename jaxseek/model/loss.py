"""The language-model loss from the final hidden states: head matmul, log-softmax and cross entropy, by chunks.

  CE = Σ_t mask_t · (logsumexp_v(h_t·W_v) − h_t·W_{y_t})

"chunked" (the default) never holds float32 logits for the whole batch: the tokens are visited in chunks, each
chunk's logits [tokens, V] computed in the compute dtype with float32 accumulation and dropped after use; the
backward recomputes them chunk by chunk (softmax − one-hot) and accumulates dW in float32. "full" materialises
logits [B, T, V] (the reference). Chunk c holds the tokens t ≡ c (mod n) of every sequence, so a length split
over devices (context parallelism) stays split inside each chunk.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxseek.kernels.gpu import platform
from jaxseek.sharding import rules

CHUNK_ELEMENTS = 2**26  # float32 logits per chunk and device: 256 MiB


def cross_entropy_sum(h_BTD: jax.Array, head_DV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array,
                      impl: str = "chunked") -> jax.Array:
  """Σ mask · cross entropy of logits h·W against the targets (float32), h and W in the compute dtype."""
  if impl == "full":
    logits_BTV = jnp.einsum("BTD,DV->BTV", h_BTD, head_DV, preferred_element_type=jnp.float32)
    logits_BTV = rules.shard(logits_BTV, ("batch", "length", "vocab"))
    return ((jax.nn.logsumexp(logits_BTV, axis=-1) - target_logit(logits_BTV, targets_BT)) * mask_BT).sum()
  with jax.named_scope("loss_head"):  # names it in HLO and profiles (benchmarks/profile_step.py)
    return _chunked_loss(h_BTD, head_DV, targets_BT, mask_BT)


def _chunked_loss(h_BTD, head_DV, targets_BT, mask_BT):
  to_chunks = _splitter(h_BTD, head_DV)
  h_nBcD, targets_nBc, mask_nBc = to_chunks(h_BTD), to_chunks(targets_BT), to_chunks(mask_BT.astype(jnp.float32))
  if h_nBcD.shape[0] == 1 and platform() == "cpu":
    return _one_chunk_ce(h_nBcD[0], head_DV, targets_nBc[0], mask_nBc[0])
  return _chunked_ce(h_nBcD, head_DV, targets_nBc, mask_nBc)


def greedy_tokens(h_BTD: jax.Array, head_DV: jax.Array) -> jax.Array:
  """The top-1 token of logits h·W at every position (int32 [B, T]), over chunks of tokens as the loss runs (no
  [B, T, V] logits in memory); ties go to the lowest token id, as argmax."""
  B, T, _ = h_BTD.shape
  to_chunks = _splitter(h_BTD, head_DV)
  top_nBc = jax.lax.map(lambda h_BcD: jnp.argmax(_chunk_logits(h_BcD, head_DV), axis=-1).astype(jnp.int32),
                        to_chunks(h_BTD))
  return jnp.moveaxis(top_nBc, 0, 2).reshape(B, T)  # chunk c holds the positions t ≡ c (mod n)


def _splitter(h_BTD: jax.Array, head_DV: jax.Array):
  """[B, T, ...] → [n, B, T/n, ...]: the `chunk_count` chunks of tokens the head's logits are computed in."""
  B, T, _ = h_BTD.shape
  n = chunk_count(B, T, head_DV.shape[1])
  return lambda a: jnp.moveaxis(a.reshape(B, T // n, n, *a.shape[2:]), 2, 0)


def chunk_count(B: int, T: int, V: int) -> int:
  """`chunks` for the active mesh's batch and length shards."""
  shape = jax.sharding.get_abstract_mesh().shape if rules.has_mesh() else {}
  shards = lambda name: math.prod(shape[a] for a in rules.mesh_axes(name)) if shape else 1
  return chunks(B * T // (shards("batch") * shards("length")), T, V, shards("length"))


def chunks(local_tokens: int, T: int, V: int, length_shards: int = 1) -> int:
  """The fewest chunks n (a divisor of T) that keep one device's chunk of logits (local_tokens / n × V) within
  CHUNK_ELEMENTS, with T/n still divisible by the length's shards."""
  fits = [n for n in range(1, T + 1) if T % n == 0 and (T // n) % length_shards == 0]
  return next((n for n in fits if max(local_tokens, 1) // n * V <= CHUNK_ELEMENTS), fits[-1])


def target_logit(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
  """logits[b, t, targets[b, t]] as a masked sum over the vocabulary: exact, and, unlike a gather along the
  vocabulary, partitioned by XLA when the vocabulary is split over tensor inside the pipeline's shard_map."""
  hit_BTV = jnp.arange(logits_BTV.shape[-1])[None, None, :] == targets_BT[..., None]
  return jnp.where(hit_BTV, logits_BTV, 0.0).sum(-1)


def _chunk_logits(h_BcD, head_DV):
  return rules.shard(jnp.einsum("BcD,DV->BcV", h_BcD, head_DV, preferred_element_type=jnp.float32),
                     ("batch", "length", "vocab"))


@jax.custom_vjp
def _chunked_ce(h_nBcD, head_DV, targets_nBc, mask_nBc):
  return _chunked_fwd(h_nBcD, head_DV, targets_nBc, mask_nBc)[0]


def _chunked_fwd(h_nBcD, head_DV, targets_nBc, mask_nBc):
  def chunk(total, inputs):
    h_BcD, targets_Bc, mask_Bc = inputs
    logits_BcV = _chunk_logits(h_BcD, head_DV)
    lse_Bc = jax.nn.logsumexp(logits_BcV, axis=-1)
    target_Bc = target_logit(logits_BcV, targets_Bc)
    return total + ((lse_Bc - target_Bc) * mask_Bc).sum(), lse_Bc

  total, lse_nBc = jax.lax.scan(chunk, jnp.zeros((), jnp.float32), (h_nBcD, targets_nBc, mask_nBc))
  return total, (h_nBcD, head_DV, targets_nBc, mask_nBc, lse_nBc)


def _chunked_bwd(residuals, g):
  h_nBcD, head_DV, targets_nBc, mask_nBc, lse_nBc = residuals
  V = head_DV.shape[1]

  def chunk(inputs):
    h_BcD, targets_Bc, mask_Bc, lse_Bc = inputs
    probs_BcV = jnp.exp(_chunk_logits(h_BcD, head_DV) - lse_Bc[..., None])
    onehot_BcV = jnp.arange(V)[None, None, :] == targets_Bc[..., None]
    dlogits_BcV = ((probs_BcV - onehot_BcV) * (mask_Bc * g)[..., None]).astype(h_BcD.dtype)
    dh_BcD = jnp.einsum("BcV,DV->BcD", dlogits_BcV, head_DV, preferred_element_type=jnp.float32)
    return jnp.einsum("BcD,BcV->DV", h_BcD, dlogits_BcV, preferred_element_type=jnp.float32), dh_BcD.astype(h_BcD.dtype)

  # the first chunk's dW starts the sum: a zero-filled start would be a second [D, V] float32 buffer beside the
  # loop's carry (XLA keeps both live; 3.45 GiB each for DeepSeek-V3's head)
  inputs = (h_nBcD, targets_nBc, mask_nBc, lse_nBc)
  dhead_DV, dh_0BcD = chunk(jax.tree.map(lambda a: a[0], inputs))

  def later(dhead_DV, inputs):
    d_DV, dh_BcD = chunk(inputs)
    return dhead_DV + d_DV, dh_BcD

  dhead_DV, dh_nBcD = jax.lax.scan(later, dhead_DV, jax.tree.map(lambda a: a[1:], inputs))
  return jnp.concatenate([dh_0BcD[None], dh_nBcD]), dhead_DV.astype(head_DV.dtype), None, None


_chunked_ce.defvjp(_chunked_fwd, _chunked_bwd)


@jax.custom_vjp
def _one_chunk_ce(h_BcD, head_DV, targets_Bc, mask_Bc):
  """`_chunked_ce` of a batch that is one chunk, on CPU: the forward keeps softmax − one-hot (float32, at most
  CHUNK_ELEMENTS) for the backward instead of the backward computing the logits again. The same operations in the
  same order as `_chunked_ce`: equal to it bit for bit."""
  return _one_chunk_fwd(h_BcD, head_DV, targets_Bc, mask_Bc)[0]


def _one_chunk_fwd(h_BcD, head_DV, targets_Bc, mask_Bc):
  logits_BcV = _chunk_logits(h_BcD, head_DV)
  lse_Bc = jax.nn.logsumexp(logits_BcV, axis=-1)
  total = jnp.zeros((), jnp.float32) + ((lse_Bc - target_logit(logits_BcV, targets_Bc)) * mask_Bc).sum()
  onehot_BcV = jnp.arange(head_DV.shape[1])[None, None, :] == targets_Bc[..., None]
  return total, (h_BcD, head_DV, mask_Bc, jnp.exp(logits_BcV - lse_Bc[..., None]) - onehot_BcV)


def _one_chunk_bwd(residuals, g):
  h_BcD, head_DV, mask_Bc, delta_BcV = residuals
  dlogits_BcV = (delta_BcV * (mask_Bc * g)[..., None]).astype(h_BcD.dtype)
  dh_BcD = jnp.einsum("BcV,DV->BcD", dlogits_BcV, head_DV, preferred_element_type=jnp.float32)
  dhead_DV = jnp.zeros(head_DV.shape, jnp.float32) + jnp.einsum("BcD,BcV->DV", h_BcD, dlogits_BcV,
                                                                preferred_element_type=jnp.float32)
  return dh_BcD.astype(h_BcD.dtype), dhead_DV.astype(head_DV.dtype), None, None


_one_chunk_ce.defvjp(_one_chunk_fwd, _one_chunk_bwd)

