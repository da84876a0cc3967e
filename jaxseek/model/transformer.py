"""Decoder blocks, the two scanned layer stacks (dense, then MoE) and the language model."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxseek.config import ModelConfig
from jaxseek.kernels.gpu import platform
from jaxseek.model.attention import make_attention
from jaxseek.model.layers import MLP, Embed, RMSNorm, param
from jaxseek.model import remat as remat_lib
from jaxseek.model.moe import MoE
from jaxseek.sharding import experts
from jaxseek.sharding.rules import shard

# the residual stream (its length also split over tensor under mesh.sequence_parallel)
ACT_BTD = ("batch", "residual_length", "embed")
PER_ROW = ("balance",)  # a block's aux entries with one value per sequence [B] (the others are sums over rows)
STACKS = ("dense_layers", "moe_layers")  # the model's scanned layer stacks (leading axis "layers"), in order

# run_stack(body, layer_state, x_BTD, side, num_layers) → (x_BTD, aux), or None for the stack's own lax.scan:
# how something outside the model (a pipeline schedule, pipeline/stages.py) runs a layer stack
RunStack = Callable[..., "tuple[jax.Array, dict] | None"]


UNROLL_LAYERS = 4  # CPU: layer stacks of at most this many layers run unrolled


def unroll_layers(num_layers: int, where: str | None = None) -> bool:
  """Whether a stack of `num_layers` layers runs unrolled instead of as a `lax.scan`: on CPU, when it is short.
  XLA:CPU runs a scan's body as a loop that slices each layer's weights out of the stacked arrays and writes
  every residual into a zero-filled stacked buffer that the backward reads back; unrolled, none of these copies
  run (benchmarks/bench_vs_hf.py's step: 0.857 of the scanned step's time, docs/cpu.md). Accelerators keep the
  scan, whose compile time does not grow with depth. A pipeline's chunks keep theirs."""
  return (where or platform()) == "cpu" and num_layers <= UNROLL_LAYERS and not _SCANNED.get()


_SCANNED = contextvars.ContextVar("scanned", default=False)


@contextlib.contextmanager
def scanned():
  """Traces every layer stack as a `lax.scan`, as accelerators run it, on CPU too (the explorer's --compile,
  whose memory estimate models the scan's loop)."""
  token = _SCANNED.set(True)
  try:
    yield
  finally:
    _SCANNED.reset(token)


class Block(nnx.Module):
  """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x)) with a dense MLP or the MoE."""

  def __init__(self, cfg: ModelConfig, moe: bool, *, param_dtype, dtype, rngs: nnx.Rngs, fp8: str | None = None,
               exchange: experts.Settings | None = None):
    D, eps = cfg.hidden_size, cfg.rms_norm_eps
    self.attn_norm = RMSNorm(D, eps, param_dtype=param_dtype, rngs=rngs)
    self.attn = make_attention(cfg, param_dtype=param_dtype, dtype=dtype, rngs=rngs, fp8=fp8)
    self.mlp_norm = RMSNorm(D, eps, param_dtype=param_dtype, rngs=rngs)
    if moe:
      self.mlp = MoE(cfg, param_dtype=param_dtype, dtype=dtype, rngs=rngs, fp8=fp8, exchange=exchange)
    else:
      self.mlp = MLP(D, cfg.intermediate_size, cfg.initializer_range, param_dtype=param_dtype, dtype=dtype, rngs=rngs,
                     fp8=fp8)
    self.moe, self.streams = moe, cfg.overlap_streams

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, valid_BT):
    """The block on [B, T, D]; with model.overlap_streams = n, on n independent streams of rows i, i + n, …
    (each device keeps its own rows), put back in order. Per-sequence aux entries (`balance`) are put back the
    same way, the others (sums over the rows) added."""
    n = self.streams
    if n == 1 or x_BTD.shape[0] % n:  # (a batch whose rows do not split, such as evaluation's, runs as one)
      return self.layer(x_BTD, positions_BT, segment_ids_BT, valid_BT)
    pick = lambda a, i: None if a is None else a.reshape(a.shape[0] // n, n, *a.shape[1:])[:, i]
    merge = lambda *parts: jnp.stack(parts, 1).reshape(-1, *parts[0].shape[1:])
    outs = [self.layer(*(pick(a, i) for a in (x_BTD, positions_BT, segment_ids_BT, valid_BT))) for i in range(n)]
    aux = {k: (merge if k in PER_ROW else lambda *v: sum(v))(*(a[k] for _, a in outs)) for k in outs[0][1]}
    return shard(merge(*(y for y, _ in outs)), ACT_BTD), aux

  def layer(self, x_BTD, positions_BT, segment_ids_BT, valid_BT):
    with jax.named_scope("attention"):  # names the parts in HLO and profiles (benchmarks/profile_step.py)
      x_BTD = shard(x_BTD + self.attn(self.attn_norm(x_BTD), positions_BT, segment_ids_BT), ACT_BTD)
    h_BTD = checkpoint_name(self.mlp_norm(x_BTD), "mlp_input")  # the MLP / MoE input (remat policies)
    with jax.named_scope("moe" if self.moe else "mlp"):
      if self.moe:
        y_BTD, aux = self.mlp(h_BTD, valid_BT)
      else:
        y_BTD, aux = self.mlp(h_BTD), {}
    return shard(x_BTD + y_BTD, ACT_BTD), aux


class Stack(nnx.Module):
  """`num_layers` identical blocks whose parameters are stacked on a leading "layers" axis, run by lax.scan (or by
  `run_stack`, where it takes the stack: body(x_BTD, layer_state, side) → (x_BTD, aux) over the layers)."""

  def __init__(self, cfg: ModelConfig, num_layers: int, moe: bool, *, param_dtype, dtype, remat: str,
               rngs: nnx.Rngs, fp8: str | None = None, run_stack: RunStack | None = None,
               exchange: experts.Settings | None = None):

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> Block:
      return Block(cfg, moe, param_dtype=param_dtype, dtype=dtype, rngs=rngs, fp8=fp8, exchange=exchange)

    self.blocks = make(rngs)
    for _, node in nnx.iter_graph(self.blocks):
      if isinstance(node, nnx.Variable):
        node.set_metadata(logical_axes=("layers",) + tuple(node.get_metadata()["logical_axes"]))
    self.remat = remat
    self.num_layers = num_layers
    self.run_stack = run_stack

  def __call__(self, x_BTD, positions_BT, segment_ids_BT, valid_BT):
    graphdef, state = nnx.split(self.blocks)

    def body(x_BTD, layer_state, side):
      return nnx.merge(graphdef, layer_state)(x_BTD, *side)

    body = remat_lib.wrap(body, self.remat)
    side = (positions_BT, segment_ids_BT, valid_BT)
    ran = None if self.run_stack is None else self.run_stack(body, state, x_BTD, side, self.num_layers)
    if ran is not None:
      return ran
    return jax.lax.scan(lambda x_BTD, layer_state: body(x_BTD, layer_state, side), x_BTD, state,
                        unroll=unroll_layers(self.num_layers))


class MTPLayer(nnx.Module):
  """One multi-token-prediction depth k (DeepSeek-V3 §2.2).

  h'_i = W_e · enorm(Emb(t_{i+k})) + W_h · hnorm(h_i^{k-1})   (eh_proj on the concatenation, split in two)
  h_i^k = Block(h'_i),  logits_i^k = Head(norm(h_i^k)) predicts t_{i+k+1}; Emb and Head are the main model's.
  Depth 1 reads the main model's normed output; depth k+1 reads h^k before `norm` (the norm belongs to the
  shared head, as in DeepSeek-V3's checkpoint layout `shared_head.norm`).
  """

  def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs, fp8: str | None = None,
               exchange: experts.Settings | None = None):
    D, eps, std = cfg.hidden_size, cfg.rms_norm_eps, cfg.initializer_range
    self.enorm = RMSNorm(D, eps, param_dtype=param_dtype, rngs=rngs)
    self.hnorm = RMSNorm(D, eps, param_dtype=param_dtype, rngs=rngs)
    self.w_e_DD = param(rngs, (D, D), ("embed", None), param_dtype, std)
    self.w_h_DD = param(rngs, (D, D), ("embed", None), param_dtype, std)
    self.block = Block(cfg, cfg.is_moe, param_dtype=param_dtype, dtype=dtype, rngs=rngs, fp8=fp8, exchange=exchange)
    self.norm = RMSNorm(D, eps, param_dtype=param_dtype, rngs=rngs)
    self.dtype = dtype

  def __call__(self, emb_BTD, h_BTD, positions_BT, segment_ids_BT, valid_BT):
    w = lambda p: p[...].astype(self.dtype)
    x_BTD = (jnp.einsum("BTD,DE->BTE", self.enorm(emb_BTD), w(self.w_e_DD))
             + jnp.einsum("BTD,DE->BTE", self.hnorm(h_BTD), w(self.w_h_DD)))
    x_BTD, aux = self.block(shard(x_BTD, ACT_BTD), positions_BT, segment_ids_BT, valid_BT)
    return x_BTD, self.norm(x_BTD), aux


def shift_left(x_BT: jax.Array, k: int, fill=0) -> jax.Array:
  """x[:, i + k] at position i; the last k positions get `fill`."""
  return jnp.concatenate([x_BT[:, k:], jnp.full((x_BT.shape[0], k), fill, x_BT.dtype)], axis=1)


def target_exists(valid_BT: jax.Array, segment_ids_BT: jax.Array | None, k: int) -> jax.Array:
  """1.0 where multi-token-prediction depth k has a target in token order: i+k is a valid token of i's document."""
  valid_BT = shift_left(valid_BT, k)
  if segment_ids_BT is not None:
    valid_BT = valid_BT * (shift_left(segment_ids_BT, k, fill=-1) == segment_ids_BT)
  return valid_BT


class Transformer(nnx.Module):
  """The DeepSeek language model: embedding, dense stack, MoE stack, final norm, head."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32,
               remat: str = "none", fp8: str | None = None, run_stack: RunStack | None = None,
               exchange: experts.Settings | None = None):
    D, V, std = cfg.hidden_size, cfg.vocab_size, cfg.initializer_range
    kw = dict(param_dtype=param_dtype, dtype=dtype, remat=remat, rngs=rngs, fp8=fp8, run_stack=run_stack,
              exchange=exchange)
    self.embed = Embed(V, D, std, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
    self.dense_layers = Stack(cfg, cfg.num_dense_layers, False, **kw) if cfg.num_dense_layers else None
    self.moe_layers = Stack(cfg, cfg.num_moe_layers, True, **kw) if cfg.num_moe_layers else None
    self.final_norm = RMSNorm(D, cfg.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.head_DV = None if cfg.tie_word_embeddings else param(rngs, (D, V), ("embed", "vocab"), param_dtype, std)
    self.mtp_layers = nnx.List([MTPLayer(cfg, param_dtype=param_dtype, dtype=dtype, rngs=rngs, fp8=fp8,
                                         exchange=exchange)
                                for _ in range(cfg.num_nextn_predict_layers)])
    self.dtype = dtype

  def head(self) -> jax.Array:
    """The output head [D, V] in the compute dtype (the embedding table's transpose when tied)."""
    head_DV = self.embed.table_VD[...].T if self.head_DV is None else self.head_DV[...]
    return head_DV.astype(self.dtype)

  def head_logits(self, h_BTD: jax.Array) -> jax.Array:
    logits_BTV = jnp.einsum("BTD,DV->BTV", h_BTD, self.head(), preferred_element_type=jnp.float32)
    return shard(logits_BTV, ("batch", "length", "vocab"))

  def forward(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
              segment_ids_BT: jax.Array | None = None,
              mtp_tokens: list[jax.Array] | None = None, mtp_valid: list[jax.Array] | None = None,
              logits: bool = True) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Returns float32 logits [B, T, V] and aux: hidden [B, T, D], per-MoE-layer `load` [L, E], `balance` [L, B],
    and with multi-token prediction `mtp_logits` [depth, B, T, V] (depth k at position i predicts t_{i+k+1}),
    `mtp_hidden` [depth, B, T, D] (the normed states its head reads), `mtp_load` [depth, E], `mtp_balance`
    [depth, B]. With `logits=False` no logits are computed (the loss takes them chunk by chunk, `model.loss`):
    the first result is the final hidden state and aux has no `mtp_logits`.

    `segment_ids` > 0 label packed documents (attention stays inside one); 0 marks padding. `mtp_tokens[k-1]`:
    the token depth k reads at each position, t_{i+k} (default: the tokens shifted left by k, which holds
    when the sequence is stored in token order). `mtp_valid[k-1]`: where depth k has a target (1.0) — only
    those positions count in its MoE loads and balance loss (default: i+k is a real token of i's document).
    """
    x_BTD, positions_BT, valid_BT = self.begin(tokens_BT, positions_BT, segment_ids_BT)
    x_BTD, aux = self.run_stacks(x_BTD, positions_BT, segment_ids_BT, valid_BT, STACKS)
    return self.finish(x_BTD, aux, tokens_BT, positions_BT, segment_ids_BT, valid_BT, mtp_tokens, mtp_valid, logits)

  # The forward in three parts, so that a pipeline schedule can run the stack it pipelines between them.

  def begin(self, tokens_BT: jax.Array, positions_BT: jax.Array | None, segment_ids_BT: jax.Array | None):
    """(embeddings, positions, valid): the stacks' input and what every layer reads beside it."""
    B, T = tokens_BT.shape
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid_BT = jnp.ones((B, T), jnp.float32) if segment_ids_BT is None else (segment_ids_BT > 0).astype(jnp.float32)
    return self.embed(tokens_BT), positions_BT, valid_BT

  def run_stacks(self, x_BTD, positions_BT, segment_ids_BT, valid_BT, names) -> tuple[jax.Array, dict]:
    """The layer stacks `names` (those the model has), in order; their aux entries merged."""
    aux: dict[str, jax.Array] = {}
    for name in names:
      stack = getattr(self, name)
      if stack is not None:
        x_BTD, layer_aux = stack(x_BTD, positions_BT, segment_ids_BT, valid_BT)
        aux.update(layer_aux)
    return x_BTD, aux

  def finish(self, x_BTD, aux, tokens_BT, positions_BT, segment_ids_BT, valid_BT, mtp_tokens=None, mtp_valid=None,
             logits: bool = True) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The final norm, multi-token prediction and (with `logits`) the head, on the last stack's output."""
    aux = dict(aux)
    h_BTD = self.final_norm(x_BTD)
    aux["hidden"] = h_BTD
    mtp = [], [], [], []
    for k, layer in enumerate(self.mtp_layers, start=1):
      ahead_BT = shift_left(tokens_BT, k) if mtp_tokens is None else mtp_tokens[k - 1]
      valid_k_BT = mtp_valid[k - 1] if mtp_valid is not None else target_exists(valid_BT, segment_ids_BT, k)
      h_BTD, normed_BTD, layer_aux = layer(self.embed(ahead_BT), h_BTD, positions_BT, segment_ids_BT, valid_k_BT)
      mtp[0].append(normed_BTD)
      if layer_aux:
        mtp[1].append(layer_aux["load"])
        mtp[2].append(layer_aux["balance"])
        mtp[3].append(layer_aux["dropped"])
    for name, values in zip(("mtp_hidden", "mtp_load", "mtp_balance", "mtp_dropped"), mtp):
      if values:
        aux[name] = jnp.stack(values)
    if not logits:
      return aux["hidden"], aux
    if mtp[0]:
      aux["mtp_logits"] = jnp.stack([self.head_logits(h) for h in mtp[0]])
    return self.head_logits(aux["hidden"]), aux

  def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
               segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """Float32 logits [B, T, V]."""
    return self.forward(tokens_BT, positions_BT, segment_ids_BT)[0]
