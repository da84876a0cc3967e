"""Memory per device: state from the layout, activations and MoE dispatch buffers from the tensors a layer keeps.

A layer's backward needs the tensors its forward saved (the residuals). Without remat every layer keeps all of
them; with `train.remat=full` a layer keeps only its input x[B, T, D] and recomputes the rest while its backward
runs; the other policies (model/remat.py) keep what `kept_copies` lists. The tensors and how many copies of
each the backward keeps follow the model code (listed by `activation_rows`). The backward of a layer needs about
its saved tensors' size again for their gradients; the head's logits are freed before that starts, so the
larger of the two counts. Each layer run counts once:

  activations = Σ_runs saved + max(saved(one layer), logits)                         (remat none)
  activations = Σ_runs kept + saved(one layer) + max(saved(one layer), logits)       (any other policy)
  gradients   = parameters (× 2 with accumulation: the accumulator and one microbatch's gradients)

With S > 1 the weights outside the pipelined stack are stored 1/S per stage where `rules.param_spec` splits them
over `pipeline` (parameters, gradients, optimiser state) and held whole during the step: gathered in the
parameter dtype (`gathered_weights`); under a table schedule (1F1B, interleaved 1F1B, DualPipeV) their
gradients are accumulated in float32 through the schedule as `restgrads.RestGrads` lays them out (`gradients`).
The MoE dispatch buffers are those of `dispatch` (model.moe_dispatch: fixed P·C-row buffers on CPU, the ragged
exchange of the x·K token copies into R = ⌈f·x·K⌉ rows on GPU and TPU).

Without a pipeline, accumulation runs one microbatch (B/M rows) at a time: one run per layer. With S stages, a
pipelined stack's schedule saves every tick (pipeline/stages.py): ticks × L/(S·R) layer runs per stage on a
microbatch of B/M rows (not split over `pipeline`), ticks = R·M + S − 1; everything else (unpipelined stacks,
MTP, head) runs once on the whole batch split over pipeline × data × fsdp × expert.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxseek.config import MESH_AXES, Config
from jaxseek.kernels import choice as kernels
from jaxseek.model import loss as loss_lib
from jaxseek.sharding import exchange, experts
from jaxseek.explore import layout as ex
from jaxseek.sharding.rules import ACTIVATION_RULES, activation_rules, spec

KINDS = ("parameters", "gradients", "optimizer", "activations", "moe_dispatch", "gathered_weights", "other")


@dataclasses.dataclass(frozen=True)
class Tensor:
  """An activation one layer keeps for its backward: `copies` arrays of this shape and placement."""

  name: str
  symbol: str  # the array's name in the placement notation
  scope: str  # "attention", "mlp", "moe" (dispatch buffers, per device inside shard_map), "head"
  letters: str
  dims: tuple[int, ...]  # global (per microbatch); for scope "moe" already one device's shard
  names: tuple[str | None, ...]  # logical axes (activation rules); None everywhere for "moe"
  itemsize: int
  copies: int

  def bytes(self, sizes: dict[str, int]) -> int:
    """Bytes of one copy on one device."""
    total = self.itemsize
    for dim, entry in zip(self.dims, spec(self.names, activation_rules())):
      axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
      total *= -(-dim // math.prod(sizes[a] for a in axes))
    return total


def activation_itemsize(cfg: Config, platform: str) -> int:
  """Bytes per activation element: the compute dtype's, but XLA:CPU computes bfloat16 arithmetic in float32."""
  return 4 if platform == "cpu" else ex.ITEMSIZE[cfg.train.compute_dtype]


def batch_shards(sizes: dict[str, int]) -> int:
  return math.prod(sizes[a] for a in ACTIVATION_RULES["batch"])


def attention_tensors(cfg: Config, batch: int, platform: str = "gpu", context: int = 1) -> list[Tensor]:
  """What an attention block keeps: the residual stream and norms, projections, scores and probabilities. The
  queries are split over `context` with their tokens; keys and values cover the whole sequence (gathered: MLA
  gathers its latent and rope key and expands them on every device)."""
  m, c = cfg.model, activation_itemsize(cfg, platform)
  B, T, D, N = batch, cfg.train.seq_len, m.hidden_size, m.num_attention_heads
  # a ring (model.context_attention) holds one chunk of the keys and values at a time, a gather all of them
  ring = m.context_attention in ("ring", "zigzag") and context > 1
  S = T // context if ring else T
  btd, btn, whole = ("batch", "length", None), ("batch", "length", "heads", None), ("batch", None, "heads", None)
  # the residual stream and the norms on it (split over tensor too under sequence parallelism), and the norm
  # outputs as the projections read them (whole on tensor)
  out = [Tensor("x (residual, norms)", "x", "attention", "BTD", (B, T, D), ("batch", "residual_length", None), c, 4),
         Tensor("norm outputs (projection inputs)", "x", "attention", "BTD", (B, T, D), btd, c, 2)]
  if m.is_mla:
    K, P = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    if m.q_lora_rank:
      out.append(Tensor("q latent", "c_q", "attention", "BTQ", (B, T, m.q_lora_rank), btd, c, 3))
    out.append(Tensor("kv latent", "c_kv", "attention", "BTC", (B, T, m.kv_lora_rank), btd, c, 3))
    if context > 1 and not ring:
      out.append(dataclasses.replace(context_gathered(cfg, B, platform), name="kv latent, rope key (gathered)",
                                     names=("batch", None, None)))
    kv = "one ring chunk" if ring else "whole sequence"
    out += [Tensor("q (H = nope + rope)", "q", "attention", "BTNH", (B, T, N, K), btn, c, 1),
            Tensor(f"k ({kv})", "k", "attention", "BTNH", (B, S, N, K), whole, c, 1),
            Tensor(f"v ({kv})", "v", "attention", "BTNP", (B, S, N, P), whole, c, 1),
            Tensor("attention out", "o", "attention", "BTNP", (B, T, N, P), btn, c, 1)]
  else:
    H, G = m.dense_head_dim, m.kv_heads
    out.append(Tensor("q, attention out", "q", "attention", "BTNH", (B, T, N, H), btn, c, 2))
    if ring:  # the chunk held, and its heads repeated for the query heads that share them
      out += [Tensor("k, v (one ring chunk)", "k", "attention", "BTGH", (B, S, G, H), ("batch", None, "kv_heads", None),
                     c, 2),
              Tensor("k, v (one ring chunk, heads repeated)", "k", "attention", "BTNH", (B, S, N, H), whole, c, 2)]
    else:
      out.append(Tensor("k, v (whole sequence)", "k", "attention", "BTGH", (B, T, G, H),
                        ("batch", None, "kv_heads", None), c, 2))
  if ring or kernels.attention_kind(m.attention_impl, S, platform, cfg.train.compute_dtype, tokamax=True) == "dense":
    out.append(Tensor("scores, probabilities", "scores", "attention", "BNTS", (B, N, T, S),
                      ("batch", "heads", "length", None), 4, 2))
  else:  # blocked attention or a flash kernel keeps the log-sum-exp of each query row, not its scores
    out.append(Tensor("softmax log-sum-exp", "lse", "attention", "BNT", (B, N, T), ("batch", "heads", "length"), 4, 1))
  return out


def stream(cfg: Config, batch: int, platform: str = "gpu") -> Tensor:
  """x[B, T, D] as the collectives move it: split on the batch axes and context only."""
  return Tensor("x", "x", "attention", "BTD", (batch, cfg.train.seq_len, cfg.model.hidden_size),
                ("batch", "length", None), activation_itemsize(cfg, platform), 1)


def context_gathered(cfg: Config, batch: int, platform: str = "gpu") -> Tensor:
  """What one device sends in a layer's `context` all-gather: its tokens' MLA latent and rope key, or their
  keys and values (multi-head / grouped-query attention)."""
  m, c = cfg.model, activation_itemsize(cfg, platform)
  T = cfg.train.seq_len
  if m.is_mla:
    return Tensor("kv latent, rope key", "c_kv", "attention", "BTC", (batch, T, m.kv_lora_rank + m.qk_rope_head_dim),
                  ("batch", "length", None), c, 1)
  return Tensor("k, v", "k", "attention", "BTGH", (batch, T, m.kv_heads, m.dense_head_dim),
                ("batch", "length", "kv_heads", None), c, 2)


def mlp_tensors(cfg: Config, batch: int, hidden: int, name: str = "mlp hidden (gate, up, silu)",
                platform: str = "gpu") -> list[Tensor]:
  c = activation_itemsize(cfg, platform)
  return [Tensor(name, "h", "mlp", "BTF", (batch, cfg.train.seq_len, hidden), ("batch", "length", "mlp"), c, 5)]


@dataclasses.dataclass(frozen=True)
class Dispatch:
  """One device's expert-axis exchange for one MoE layer run on `tokens` tokens (sharding/experts.py).

  fixed   all_to_all of a buffer of C rows per (source, destination) pair and of their local expert ids: P·C
          rows out, P·C back, with C = capacity(...) (dropless: x·min(K, e))
  ragged  an all_gather of the copy counts per expert (E int32), then ragged_all_to_all of exactly the x·K
          token copies, received into R = ⌈f·x·K⌉ rows (f = model.moe_recv_factor, at most P·C); the results
          come back the same way
  Rows towards the experts go in the dispatch dtype (model.moe_dispatch_dtype: float8 e4m3 packs each row as D
  bytes and a float32 scale per 128 channels): the tokens in the forward, the gradients of the expert outputs in
  the backward; rows back from the experts (results, the tokens' gradients) in the compute dtype.
  """

  kind: str  # "fixed" or "ragged"
  shards: int  # P: the expert axis
  local_experts: int  # e = E / P
  tokens: int  # x: the device's tokens
  sent: int  # rows a device sends: P·C (fixed) or x·K (ragged)
  received: int  # rows of the receive buffer: P·C (fixed) or R (ragged)
  out_row_bytes: int  # one dispatched row (fixed: with its int32 expert id)
  back_row_bytes: int  # one returned row, compute dtype
  dtype: str  # the dispatch dtype
  # the two-stage exchange (ragged, the expert axis spanning nodes; 0 otherwise): the rows a device sends across
  # nodes (reach·x), receives from them a round (R₁) and sends within its node a window (W = min(R₁·K, R))
  node_sent: int = 0
  node_received: int = 0
  window: int = 0


FP8_TILE = 128  # channels per float32 scale of a float8 row


def packed_row_bytes(D: int) -> int:
  """A float8 e4m3 row as sent: D bytes and a float32 scale per 128 channels."""
  return D + -(-D // FP8_TILE) * 4


def moe_sizes(cfg: Config, sizes: dict[str, int]) -> dict[str, int]:
  """The mesh as the routed experts use it: with model.moe_tensor=experts the tensor ranks are expert shards
  (expert × tensor, each expert whole) and take their share of the tokens (as the batch axes would)."""
  if not cfg.model.is_moe or cfg.model.moe_tensor != "experts" or sizes.get("tensor", 1) == 1:
    return sizes
  return {**sizes, "expert": sizes["expert"] * sizes["tensor"], "tensor": 1}


def expert_node(sizes: dict[str, int], devices_per_node: int | None) -> int | None:
  """The expert-axis shards in one node where the axis spans nodes (the axes inside it, context and tensor, fill
  a node first), else None."""
  if not devices_per_node:
    return None
  g = shards_per_node(sizes, devices_per_node)
  return g if sizes["expert"] // g > 1 else None


def shards_per_node(sizes: dict[str, int], devices_per_node: int) -> int:
  """Expert-axis shards in one node: the axes inside `expert` (context, tensor) fill a node first."""
  return max(1, min(sizes["expert"], devices_per_node // (sizes["context"] * sizes["tensor"])))


def dispatch(cfg: Config, sizes: dict[str, int], batch: int, platform: str, node: int | None = None) -> Dispatch:
  """The exchange of one MoE layer run on `batch` rows (split over the batch axes and context); `node`: the
  expert shards a node holds where the axis spans nodes (`expert_node`)."""
  m, a, moe = cfg.model, activation_itemsize(cfg, platform), moe_sizes(cfg, sizes)
  P, D, K = moe["expert"], m.hidden_size, m.num_experts_per_tok
  e = -(-m.n_routed_experts // P)
  # the tokens' length split over context, and over tensor where its ranks are expert shards
  length = sizes["context"] * (P // sizes["expert"])
  x = -(-batch // batch_shards(sizes)) * -(-cfg.train.seq_len // length)
  cap = exchange.capacity(x, K, P, e, m.moe_capacity_factor)
  dtype = m.moe_dispatch_dtype or cfg.train.compute_dtype
  out_row = packed_row_bytes(D) if dtype.startswith("float8") else D * a
  if kernels.dispatch_kind(m.moe_dispatch, platform) == "fixed" or P == 1:
    return Dispatch("fixed", P, e, x, P * cap, P * cap, out_row + 4, D * a, dtype)
  R = exchange.receive_rows(x, K, P, cap, m.moe_recv_factor)
  settings = experts.Settings.from_config(m, node)
  if not settings.two_stage(P, platform):
    return Dispatch("ragged", P, e, x, x * K, R, out_row, D * a, dtype)
  # model.moe_overlap_chunks: each chunk of the tokens goes through an exchange of its own (experts.routed), one
  # chunk's buffers live at a time (compiled for DeepSeek-V3's layout: 2 chunks 8.7 GiB under 1, 4 chunks 14 GiB)
  x = -(-x // settings.chunk_count(x))
  R = exchange.receive_rows(x, K, P, exchange.capacity(x, K, P, e, m.moe_capacity_factor), m.moe_recv_factor)
  reach, N = settings.nodes_reached(P, K), P // node
  R1 = max(1, min(settings.node_rows(x, P, reach), N * x))  # sharding/experts.py experts_two_stage
  return Dispatch("ragged", P, e, x, x * K, R, out_row, D * a, dtype, min(N, reach) * x, R1, min(R1 * K, R))


def dispatch_tensors(cfg: Config, sizes: dict[str, int], batch: int, platform: str,
                     node: int | None = None) -> list[Tensor]:
  """One device's MoE buffers inside the shard_map: router scores, the exchanged rows (fixed: the P·C buffer
  sent and received, with its masks; ragged: the x·K copies sorted by expert, the R rows received, the expert
  outputs and the results returned; with a float8 dispatch dtype also the packed rows sent and received), the
  grouped matmul's hidden rows and the expert weights gathered for it. The two-stage exchange (`node`) adds
  its first stage's buffers (`node_tensors`) and runs the ragged exchange within the node on one window of W
  copies at a time."""
  m, a, c = cfg.model, activation_itemsize(cfg, platform), ex.ITEMSIZE[cfg.train.compute_dtype]
  d = dispatch(cfg, sizes, batch, platform, node)
  e, mm, D = d.local_experts, -(-m.moe_intermediate_size // moe_sizes(cfg, sizes)["tensor"]), m.hidden_size
  R, J, none = d.received, d.window or d.sent, (None, None)
  fp8 = d.dtype.startswith("float8")
  packed = packed_row_bytes(D)
  out = [Tensor("router scores", "s", "moe", "XE", (d.tokens, m.n_routed_experts), none, 4, 1)]
  if d.window:
    out += node_tensors(d, m.num_experts_per_tok, D, a)
  if d.kind == "fixed":
    out += [Tensor("dispatch rows", "rows", "moe", "RD", (R, D), none, a, 2),
            Tensor("dispatch masks", "mask", "moe", "RD", (R, D), none, 1, 2)]
    if fp8 and d.shards > 1:
      out.append(Tensor("dispatch rows packed as float8 + scales", "rows", "moe", "RD", (R, packed), none, 1, 2))
  else:
    out.append(Tensor("token copies sorted by expert", "rows", "moe", "JD", (J, D), none, a, 1))
    if fp8:
      out += [Tensor("copies packed as float8 + scales", "rows", "moe", "JD", (J, packed), none, 1, 1),
              Tensor("rows received (float8 + scales)", "rows", "moe", "RD", (R, packed), none, 1, 1)]
    out += [Tensor("rows received" + (", dequantised" if fp8 else ""), "rows", "moe", "RD", (R, D), none, a, 1),
            Tensor("expert outputs", "y", "moe", "RD", (R, D), none, a, 1),
            Tensor("results returned", "y", "moe", "JD", (J, D), none, a, 1)]
  out.append(Tensor("expert weights (gathered)", "w", "moe", "eDm", (e, D, mm), (None,) * 3, c, 3))
  if kernels.matmul_kind(m.moe_matmul, platform, cfg.train.compute_dtype, tokamax=True) == "blocked":
    # moe.ffn_blocked: rows padded per expert to blocks of n, visited one block at a time
    n = 2 ** int(math.log2(min(max(R // (4 * e), 8), 256)))
    blocks = -(-(R + e * (n - 1)) // n)
    out += [Tensor("blocked rows in and out", "rows", "moe", "RD", (blocks * n, D), none, a, 2),
            Tensor("expert hidden (one block)", "h", "moe", "Rm", (n, mm), none, a, 6)]
  else:
    out.append(Tensor("expert hidden", "h", "moe", "Rm", (R, mm), none, a, 6))
  return out


def node_tensors(d: Dispatch, K: int, D: int, a: int) -> list[Tensor]:
  """The first stage of the two-stage exchange (sharding/experts.py experts_two_stage): the reach·x rows a
  device sends across nodes with their expert ids and gate weights (2K float32), the R₁ rows it receives a
  round, the node's weighted sums sent back and those it gets back (compute dtype)."""
  S, R1, none = d.node_sent, d.node_received, (None, None)
  out = [Tensor("node rows sent", "rows", "moe", "SD", (S, D), none, a, 1),
         Tensor("node ids and weights", "meta", "moe", "SK", (S + R1, 2 * K), none, 4, 1)]
  if d.dtype.startswith("float8"):
    out += [Tensor("node rows packed as float8 + scales", "rows", "moe", "SD", (S, packed_row_bytes(D)), none, 1, 1),
            Tensor("node rows received (float8 + scales)", "rows", "moe", "RD", (R1, packed_row_bytes(D)), none, 1,
                   1)]
  return out + [Tensor("node rows received", "rows", "moe", "RD", (R1, D), none, a, 1),
                Tensor("node sums", "y", "moe", "RD", (R1, D), none, a, 1),
                Tensor("node sums returned", "y", "moe", "SD", (S, D), none, a, 1)]


def head_tensors(cfg: Config, batch: int, sizes: dict[str, int] | None = None) -> list[Tensor]:
  """The head's float32 logits: of the whole batch (train.loss_impl=full), or of one chunk of its tokens."""
  m, T = cfg.model, cfg.train.seq_len
  depth = 1 + m.num_nextn_predict_layers
  if cfg.train.loss_impl == "full":
    return [Tensor("logits, softmax, their gradient", "logits", "head", "BTV", (batch, T, m.vocab_size),
                   ("batch", "length", "vocab"), 4, 3 * depth)]
  shards = batch_shards(sizes) * sizes["context"] if sizes else 1
  n = loss_lib.chunks(batch * T // shards, T, m.vocab_size, sizes["context"] if sizes else 1)
  return [Tensor("logits of one token chunk, their gradient", "logits", "head", "BTV", (batch, T // n, m.vocab_size),
                 ("batch", "length", "vocab"), 4, 2)]


def stage_input(cfg: Config, batch: int, platform: str) -> Tensor:
  """A pipeline stage's input for one microbatch: the residual stream [b, T, D]."""
  return Tensor("stage input", "x", "attention", "BTD", (batch, cfg.train.seq_len, cfg.model.hidden_size),
                ("batch", "residual_length", "embed"), activation_itemsize(cfg, platform), 1)


def layer_tensors(cfg: Config, sizes: dict[str, int], moe: bool, platform: str,
                  batch: int | None = None, node: int | None = None) -> list[Tensor]:
  """Everything one decoder layer keeps for one run on `batch` rows (default: one microbatch); `node` as for
  `dispatch`."""
  m = cfg.model
  batch = cfg.train.batch_size // cfg.train.microbatches if batch is None else batch
  out = attention_tensors(cfg, batch, platform, sizes["context"])
  if not moe:
    return out + mlp_tensors(cfg, batch, m.intermediate_size, platform=platform)
  if m.n_shared_experts:
    out += mlp_tensors(cfg, batch, m.moe_intermediate_size * m.n_shared_experts, "shared expert hidden", platform)
  return out + dispatch_tensors(cfg, sizes, batch, platform, node)


def activation_rows(cfg: Config, sizes: dict[str, int], platform: str = "gpu",
                    node: int | None = None) -> list[dict[str, Any]]:
  """The main activations of one layer (and the head) per microbatch: shape, placement, bytes per device."""
  rows, seen = [], set()
  batch = cfg.train.batch_size // cfg.train.microbatches
  layers = [("dense layer", False)] * bool(cfg.model.num_dense_layers) + [("moe layer", True)] * cfg.model.is_moe
  for where, moe in layers:
    for t in layer_tensors(cfg, sizes, moe, platform, node=node):
      if (t.name, t.dims) in seen:
        continue
      seen.add((t.name, t.dims))
      rows.append(_row(t, sizes, where))
  return rows + [_row(t, sizes, "head") for t in head_tensors(cfg, batch, sizes)]


def _row(t: Tensor, sizes: dict[str, int], where: str) -> dict[str, Any]:
  if t.scope == "moe":
    placement = f"{t.symbol}[{', '.join(t.letters)}] per device"
  else:
    axes = tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e)
                 for e in spec(t.names, activation_rules()))
    placement = ex.notation(t.symbol, t.letters, axes, sizes)
  return {"name": t.name, "layer": where, "scope": t.scope, "shape": list(t.dims), "dtype_bytes": t.itemsize,
          "placement": placement, "copies": t.copies, "bytes_per_device": t.bytes(sizes) * t.copies}


def _split(tensors: list[Tensor], sizes: dict[str, int]) -> tuple[int, int]:
  """(activation bytes, MoE dispatch bytes) per device of a list of tensors."""
  dispatch = sum(t.bytes(sizes) * t.copies for t in tensors if t.scope == "moe")
  return sum(t.bytes(sizes) * t.copies for t in tensors) - dispatch, dispatch


def memory(model: ex.Model, sizes: dict[str, int], platform: str = "gpu",
           devices_per_node: int | None = None) -> dict[str, Any]:
  """Bytes per device by kind on a pipeline stage (all stages hold the same), with its layers; the MoE
  exchange as it runs with `devices_per_node` (two stages where the expert axis spans nodes)."""
  from jaxseek.pipeline import stages as pipeline_lib

  cfg, S = model.cfg, sizes["pipeline"]
  B, M = cfg.train.batch_size, cfg.train.microbatches
  stages = ex.stage_layers(cfg, S)
  state = ex.stage_state_bytes(model, sizes, 0, stages)
  out = {"parameters": state["params"] + state["biases"], "optimizer": state["opt_state"], "other": state["other"],
         "gradients": state["params"] * (2 if M > 1 and S == 1 else 1)}
  inner = {**sizes, "pipeline": 1}  # inside the schedule microbatch rows are not split over the stages
  outer = sizes if pipeline_lib.splits_batch(cfg, sizes) else inner  # nor outside, when the batch is not split
  one_f_one_b = S > 1 and cfg.train.pipeline_schedule in pipeline_lib.ONE_F_ONE_B
  runs, kept = [], 0  # (layer runs, moe, batch, sizes); bytes of 1F1B's kept stage inputs
  for stack, moe in (("dense_layers", False), ("moe_layers", True)):
    n = getattr(cfg.model, "num_moe_layers" if moe else "num_dense_layers")
    if not n:
      continue
    if ex.pipelined(cfg, stack, S):
      R = pipeline_lib.stack_repeats(n, S, cfg.train.pipeline_repeats)
      chunk = pipeline_lib.stored_layers(n, S, cfg.train.pipeline_repeats) // (S * R)  # padding included
      if one_f_one_b:  # the stage inputs and cotangents the table keeps, one chunk's backward (its forward recomputed)
        from jaxseek.pipeline import tables

        table = tables.for_config(cfg, S, R)
        received = sum(len(route.kinds) for route in table.routes())  # a tick's receipts, stored by the next
        kept = (table.slots + table.grad_slots + received) * stage_input(cfg, B // M, platform).bytes(inner)
        runs.append((chunk, moe, B // M, inner))
        if table.stash_slots:  # zero-bubble: what W reads (the layers' matmul inputs and output cotangents), kept
          runs.append((table.stash_slots * chunk, moe, B // M, inner))  # from b to W, as a backward keeps them
        if table.residual_slots:  # train.pipeline_recompute=false: each kept forward's residuals, from F to b
          runs.append((table.residual_slots * chunk, moe, B // M, inner))
      else:
        runs.append((pipeline_lib.num_ticks(S, M, R) * chunk, moe, B // M, inner))
    else:  # under 1F1B the other stack runs per microbatch inside the schedule, before or after
      runs.append((n, moe, B // M, inner) if one_f_one_b else (n, moe, B if S > 1 else B // M, outer))
  outer_batch = B if S > 1 else B // M
  tail = (B // M, inner) if one_f_one_b else (outer_batch, outer)
  runs.append((cfg.model.num_nextn_predict_layers, cfg.model.is_moe, *tail))
  head = _split(head_tensors(cfg, *tail), sizes)[0]
  out.update(_activations(cfg, [r for r in runs if r[0]], head, platform, expert_node(moe_sizes(cfg, sizes),
                                                                                          devices_per_node)))
  out["activations"] += kept
  if cfg.train.grad_compression != "none" and sizes["data"] > 1:  # the error-feedback residual, float32
    out["gradients"] += state["params"] * 4 // ex.ITEMSIZE[cfg.train.param_dtype]
  out["gathered_weights"] = gathered_weights(model, sizes)
  if S > 1:  # the weights outside the pipelined stack, whole during the step, and their whole gradients
    gathered, whole_gradients = outer_whole(model, sizes)
    out["gathered_weights"] += gathered
    out["gradients"] += whole_gradients
  out["total"] = sum(out[k] for k in KINDS)
  if cfg.train.optimizer_memory == "host":
    # the state lives in pinned host memory and visits the device for the update, after the backward pass has
    # freed the activations and gathered weights: the peak holds one or the other
    out["total"] -= min(out["optimizer"], out["activations"] + out["moe_dispatch"] + out["gathered_weights"])
  return {"bytes": out, "stage": 0, "stages": S, "layers_on_stage": stages[0]}


def _activations(cfg: Config, runs: list[tuple], head: int, platform: str, node: int | None) -> dict[str, int]:
  """Saved tensors of every layer run, plus the larger of the head's logits and one layer's backward (the
  logits are freed before the layers' backward starts)."""
  if not runs:
    return {"activations": head, "moe_dispatch": 0}
  policy = cfg.train.remat
  per_run = []  # (runs, activation bytes, dispatch bytes, bytes kept between forward and backward, dispatch
  for count, moe, batch, sizes in runs:  # bytes of the layer's backward, its recomputed forward included)
    tensors = layer_tensors(cfg, sizes, moe, platform, batch, node)
    act, dispatch = _split(tensors, sizes)
    per_run.append((count, act, dispatch, sum(t.bytes(sizes) * kept_copies(t, policy) for t in tensors),
                    backward_dispatch(cfg, sizes, batch, platform, node, tensors) if moe else 0))
  biggest = max(per_run, key=lambda r: r[1] + r[2])
  if policy == "none":  # every layer keeps its buffers; the backward adds what it holds beyond them
    return {"activations": sum(n * a for n, a, *_ in per_run) + max(biggest[1], head),
            "moe_dispatch": sum(n * d for n, _, d, *_ in per_run) + max(biggest[4] - biggest[2], 0)}
  # every layer keeps what the policy saves; one layer at a time recomputes the rest for its backward, whose
  # buffers join those of the recomputed forward it reads
  return {"activations": sum(n * k for n, _, _, k, _ in per_run) + biggest[1] + max(biggest[1], head),
          "moe_dispatch": biggest[4]}


# Two-stage dispatch: what one MoE layer's backward holds, in buffers of the second stage's window of W copies
# (D wide and expert-hidden wide) and of the first stage's R₁ rows, counted in XLA's buffer assignment at the peak
# of DeepSeek-V3's layout (docs/moe.md): the window's forward recomputed for its backward (copies gathered, rows
# received, expert outputs, results, the live-row select; gate, up and their product) beside the backward's
# cotangents of each and the scans' carries over rounds and windows
WINDOW_ROWS, NODE_ROWS, WINDOW_HIDDEN = 11, 7, 6


def backward_dispatch(cfg: Config, sizes: dict[str, int], batch: int, platform: str, node: int | None,
                      tensors: list[Tensor]) -> int:
  """One MoE layer's exchange buffers while its backward runs, the recomputed forward's included: twice the
  forward's, less those the backward does not read (`FORWARD_ONLY`); under the two-stage exchange the window's
  and the first stage's buffers as `WINDOW_ROWS`, `NODE_ROWS` and `WINDOW_HIDDEN` count them."""
  moe = [t for t in tensors if t.scope == "moe"]
  d = dispatch(cfg, sizes, batch, platform, node)
  if not d.window:
    return sum(t.bytes(sizes) * t.copies * (1 if t.name in FORWARD_ONLY else 2) for t in moe)
  a, D = activation_itemsize(cfg, platform), cfg.model.hidden_size
  mm = -(-cfg.model.moe_intermediate_size // moe_sizes(cfg, sizes)["tensor"])
  fixed = sum(t.bytes(sizes) * t.copies for t in moe if t.name in ("router scores", "expert weights (gathered)"))
  return fixed + a * (WINDOW_ROWS * d.window * D + NODE_ROWS * d.node_received * D + WINDOW_HIDDEN * d.window * mm)


# the ragged exchange's forward buffers that its backward does not read: consumed by the next step of the
# exchange (the copies sorted, packed and received as float8 before they are dequantised, the expert outputs
# before they are sent back) and freed before the backward's own exchange starts
FORWARD_ONLY = ("token copies sorted by expert", "copies packed as float8 + scales", "rows received (float8 + scales)",
                "expert outputs", "node rows sent", "node rows packed as float8 + scales",
                "node rows received (float8 + scales)", "node sums")


# the dispatch's exchanged rows, which no remat policy keeps (memory.dispatch_tensors)
RAGGED_BUFFERS = ("token copies sorted by expert", "copies packed as float8 + scales",
                  "rows received (float8 + scales)", "rows received", "rows received, dequantised", "expert outputs",
                  "results returned", "dispatch rows packed as float8 + scales", "node rows sent",
                  "node ids and weights", "node rows packed as float8 + scales", "node rows received (float8 + scales)",
                  "node rows received", "node sums", "node sums returned")


def kept_copies(t: Tensor, policy: str) -> int:
  """Copies of `t` a layer keeps under a remat policy other than none (model/remat.py): the input x always
  (the scan carries it); minimal also the attention output and MLA latents; save_dots every projection output
  (not the attention scores and softmax, nor the SwiGLU product, nor the MoE gathers); offload and full nothing
  more on the device."""
  if t.name.startswith("x "):
    return 1
  if policy == "minimal":
    return 1 if t.name in ("q latent", "kv latent", "attention out", "q, attention out") else 0
  if policy == "save_dots":
    if t.name in ("scores, probabilities", "dispatch rows", "dispatch masks", "expert weights (gathered)",
                  "blocked rows in and out", "norm outputs (projection inputs)") or t.name in RAGGED_BUFFERS:
      return 0
    return min(t.copies, 2)  # projections: gate and up (MLP), q/k/v, latents; not their elementwise products
  return 0


def outer_whole(model: ex.Model, sizes: dict[str, int]) -> tuple[int, int]:
  """The weights outside the pipelined stack held whole on a stage for the step: those split over `pipeline`
  (`rules.param_spec`) gathered (under a table schedule in the compute dtype, `layout.gathered_itemsize`); and
  their whole gradients. Under a table schedule they are accumulated in float32 through the schedule (summed
  over the stages after it) as `restgrads.RestGrads` lays them out: a whole accumulator for the leaves both
  parts read (the embedding with MTP) and for those an automatic axis splits (tensor, fsdp under ZeRO-3), one
  buffer as long as the larger part for the others (both parts' when they run on one stage, as in DualPipeV). Under GPipe those of the split ones before their reduce-scatter
  (parameter dtype). Returns (gathered bytes, gradient bytes); with fsdp > 1 the embedding and head are left to
  `gathered_weights`, which counts them."""
  cfg, S = model.cfg, sizes["pipeline"]
  table = ex.table_schedule(cfg, S)
  whole = {**sizes, "pipeline": 1}
  stages = ex.stage_layers(cfg, S)
  gathered = gradients = 0
  parts = {"first": 0, "last": 0}  # float32 accumulators of the leaves one part reads
  from jaxseek.sharding import gradsum

  by_hand = {"pipeline", *gradsum.axes(cfg, sizes)}  # the axes of the shard_maps around the schedule
  for leaf in ex.leaves_on(model, sizes):
    if leaf.kind not in ("params", "biases") or not ex.outer(cfg, leaf, S):
      continue
    if sizes["fsdp"] > 1 and leaf.stack in ("embed", "head_DV"):
      continue
    nbytes = ex.leaf_bytes(leaf, whole, ex.on_stage(leaf, 0, stages))
    split = ex.over_stages(leaf)
    cast = ex.gathered_itemsize(cfg, leaf) if table else leaf.itemsize
    gathered += nbytes // leaf.itemsize * cast if split else 0
    if leaf.kind == "params" and table:
      readers = ex.outer_parts(cfg, leaf.stack, S)
      auto_split = any(sizes[a] > 1 for axes in leaf.axes for a in axes if a not in by_hand)
      if len(readers) > 1 or auto_split:
        gradients += nbytes // leaf.itemsize * 4
      else:
        parts[readers[0]] += nbytes // leaf.itemsize * 4
    elif leaf.kind == "params" and split:
      gradients += nbytes
  return gathered, gradients + max(parts.values())


def gathered_weights(model: ex.Model, sizes: dict[str, int]) -> int:
  """FSDP's transients: one layer's weights all-gathered in the compute dtype with their gradient before the
  reduce-scatter (expert weights are counted with the MoE buffers), and the embedding table and head, which XLA
  gathers once and keeps for the backward: gathered, cast, and the full gradient."""
  key = ("gathered", tuple(sizes[a] for a in MESH_AXES), model.cfg.train.compute_dtype)
  if sizes["fsdp"] == 1:
    return 0
  if key in model.memo:
    return model.memo[key]
  c = ex.ITEMSIZE[model.cfg.train.compute_dtype]
  whole = {**sizes, "fsdp": 1}
  biggest = 0
  for stack in ex.LAYER_STACKS:
    total = 0
    for leaf in model.leaves:
      if leaf.kind == "params" and leaf.stack == stack and "experts" not in leaf.names:
        total += ex.leaf_bytes(leaf, whole, 1) // leaf.itemsize * (c + leaf.itemsize)
    biggest = max(biggest, total)
  ends = 0
  for leaf in model.leaves:
    if leaf.kind == "params" and leaf.stack in ("embed", "head_DV"):
      cast = c if c != leaf.itemsize else 0
      ends += ex.leaf_bytes(leaf, whole) // leaf.itemsize * (2 * leaf.itemsize + cast)
  model.memo[key] = biggest + ends
  return biggest + ends
