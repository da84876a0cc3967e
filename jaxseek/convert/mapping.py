"""THE mapping between Hugging Face tensor names and jaxseek parameter paths, with a transform each.

One table, read in both directions: `entries(cfg)` expands the rows below for one model, and

  HF → jaxseek   slot = to_jaxseek(hf_tensor)          placed at `index` of the Variable at `path`
  jaxseek → HF   hf_tensor[piece] = to_hf(slot)        every entry naming the tensor writes its piece

Conventions. Hugging Face linear weights are (out, in); jaxseek weights are (in…, out…) with the head axis
split out (`w_q_DNH`), so a linear transform is "transpose, then reshape". Tensors that jaxseek splits in
two (`kv_b_proj` into `w_uk_CNH` and `w_uv_CNP`, `kv_a_proj_with_mqa` into `w_dkv_DC` and `w_kr_DR`, the
query into its no-position and RoPE parts, MTP's `eh_proj` into `w_e_DD` and `w_h_DD`) are described by a
`Split`: the axis is viewed as [groups, Σ parts] and one part is taken. Per-layer tensors land in the scanned
stacks (`dense_layers` for layers below `first_k_dense_replace`, `moe_layers` after) at their layer slot,
per-expert tensors at [slot, expert].

RoPE layout. jaxseek rotates halves (x[:R/2], x[R/2:]); DeepSeek-V2, and V3 with `rope_interleave`, store the
RoPE output columns as interleaved pairs (x0, x1), (x2, x3), …. Query and key are permuted alike, so
q·k is unchanged: jaxseek column c holds HF column `rope_order(R)[c]` = (0, 2, …, R-2, 1, 3, …, R-1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from jaxseek.config import ModelConfig

Path = tuple[str | int, ...]


def rope_order(r: int) -> np.ndarray:
  """HF column of each jaxseek RoPE column: evens (first of each pair) then odds."""
  return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])


def dims(cfg: ModelConfig) -> dict[str, int]:
  """Sizes by shape letter (jaxseek.model's key), as used by `Split`."""
  return {"N": cfg.num_attention_heads, "H": cfg.qk_nope_head_dim, "R": cfg.qk_rope_head_dim,
          "P": cfg.v_head_dim, "C": cfg.kv_lora_rank or 0, "D": cfg.hidden_size}


@dataclasses.dataclass(frozen=True)
class Split:
  """Part `take` of an HF axis laid out as [groups, parts…] (groups=None: one group)."""

  axis: int  # 0: output rows, 1: input columns
  groups: str | None
  parts: str  # shape letters, e.g. "HR": per head H no-position then R RoPE rows
  take: int
  rope: bool = False  # the part holds RoPE columns (permuted when the checkpoint interleaves them)

  def bounds(self, d: dict[str, int]) -> tuple[int, int, int, int]:
    """(groups, size of one group, start, stop) of the part taken."""
    sizes = [d[p] for p in self.parts]
    start = sum(sizes[:self.take])
    return (d[self.groups] if self.groups else 1), sum(sizes), start, start + sizes[self.take]

  def indices(self, d: dict[str, int], interleaved: bool) -> np.ndarray:
    """Positions on the HF axis of the part's elements, in jaxseek order (group-major)."""
    groups, size, start, stop = self.bounds(d)
    order = rope_order(stop - start) if self.rope and interleaved else np.arange(stop - start)
    return (np.arange(groups)[:, None] * size + start + order[None, :]).reshape(-1)


@dataclasses.dataclass(frozen=True)
class Transform:
  """HF tensor ⇄ one jaxseek slot. linear: transpose (out, in) and split the in / out sizes over the slot's
  first `in_dims` / remaining dimensions. Otherwise a plain reshape (norm scales, embedding, bias)."""

  linear: bool = True
  in_dims: int = 1
  split: Split | None = None

  def hf_shape(self, slot: tuple[int, ...], d: dict[str, int]) -> tuple[int, ...]:
    """The full HF tensor shape that holds a slot of shape `slot`."""
    if not self.linear:
      return slot
    shape = [math.prod(slot[self.in_dims:]), math.prod(slot[:self.in_dims])]
    if self.split:
      groups, size, _, _ = self.split.bounds(d)
      shape[self.split.axis] = groups * size
    return tuple(shape)

  def to_jaxseek(self, x: np.ndarray, slot: tuple[int, ...], d: dict[str, int], interleaved: bool) -> np.ndarray:
    if not self.linear:
      return x.reshape(slot)
    if self.split:
      x = np.take(x, self.split.indices(d, interleaved), axis=self.split.axis)
    return x.T.reshape(slot)

  def to_hf(self, y: np.ndarray) -> np.ndarray:
    """The piece of the HF tensor that slot `y` holds (the whole tensor without a split)."""
    if not self.linear:
      return y
    n_in = math.prod(y.shape[:self.in_dims])
    return y.reshape(n_in, -1).T

  def place(self, full: np.ndarray, piece: np.ndarray, d: dict[str, int], interleaved: bool) -> None:
    """Writes `piece` (from `to_hf`) into the HF tensor `full`."""
    if not self.split:
      full[...] = piece
      return
    index = [slice(None)] * full.ndim
    index[self.split.axis] = self.split.indices(d, interleaved)
    full[tuple(index)] = piece


COPY = Transform(linear=False)
LINEAR = Transform()
OUT_HEADS = Transform(in_dims=2)  # o_proj: (D, N·P) → [N, P, D]


def _split(axis: int, groups: str | None, parts: str, take: int, rope: bool = False) -> Transform:
  return Transform(split=Split(axis, groups, parts, take, rope))


# Which rows apply: (model config, whether this layer is a MoE layer) → bool.
When = Callable[[ModelConfig, bool], bool]


def _always(c: ModelConfig, moe: bool) -> bool:
  return True


def _mha(c: ModelConfig, moe: bool) -> bool:
  return not c.is_mla


def _mla(c: ModelConfig, moe: bool) -> bool:
  return c.is_mla


def _q_lora(c: ModelConfig, moe: bool) -> bool:
  return c.is_mla and bool(c.q_lora_rank)


def _q_full(c: ModelConfig, moe: bool) -> bool:
  return c.is_mla and not c.q_lora_rank


def _dense(c: ModelConfig, moe: bool) -> bool:
  return not moe


def _moe(c: ModelConfig, moe: bool) -> bool:
  return moe


def _shared(c: ModelConfig, moe: bool) -> bool:
  return moe and c.n_shared_experts > 0


def _biased(c: ModelConfig, moe: bool) -> bool:
  return moe and c.topk_method == "noaux_tc"


def _untied(c: ModelConfig, moe: bool) -> bool:
  return not c.tie_word_embeddings


def _tied(c: ModelConfig, moe: bool) -> bool:
  return c.tie_word_embeddings


@dataclasses.dataclass(frozen=True)
class Row:
  hf: str  # may hold {e} (expert)
  jx: str  # dotted path below the row's prefix
  transform: Transform
  when: When = _always
  float32: bool = False  # Hugging Face keeps it in float32 whatever the checkpoint dtype (the router)


TOP_ROWS = (
    Row("model.embed_tokens.weight", "embed.table_VD", COPY),
    Row("model.norm.weight", "final_norm.scale_D", COPY),
    Row("lm_head.weight", "head_DV", LINEAR, _untied),
)

# Under model.layers.{i}. ↔ under the layer's block (a slot of a stack, or an MTP module's block).
LAYER_ROWS = (
    Row("input_layernorm.weight", "attn_norm.scale_D", COPY),
    Row("post_attention_layernorm.weight", "mlp_norm.scale_D", COPY),
    # Multi-head / grouped-query attention (Llama, DeepSeek LLM and DeepSeek-MoE).
    Row("self_attn.q_proj.weight", "attn.w_q_DNH", LINEAR, _mha),
    Row("self_attn.k_proj.weight", "attn.w_k_DGH", LINEAR, _mha),
    Row("self_attn.v_proj.weight", "attn.w_v_DGH", LINEAR, _mha),
    Row("self_attn.o_proj.weight", "attn.w_o_NHD", OUT_HEADS, _mha),
    # Multi-head latent attention (V2, V3).
    Row("self_attn.q_a_proj.weight", "attn.w_dq_DQ", LINEAR, _q_lora),
    Row("self_attn.q_a_layernorm.weight", "attn.q_norm.scale_D", COPY, _q_lora),
    Row("self_attn.q_b_proj.weight", "attn.w_uq_QNH", _split(0, "N", "HR", 0), _q_lora),
    Row("self_attn.q_b_proj.weight", "attn.w_uqr_QNR", _split(0, "N", "HR", 1, rope=True), _q_lora),
    Row("self_attn.q_proj.weight", "attn.w_q_DNH", _split(0, "N", "HR", 0), _q_full),
    Row("self_attn.q_proj.weight", "attn.w_qr_DNR", _split(0, "N", "HR", 1, rope=True), _q_full),
    Row("self_attn.kv_a_proj_with_mqa.weight", "attn.w_dkv_DC", _split(0, None, "CR", 0), _mla),
    Row("self_attn.kv_a_proj_with_mqa.weight", "attn.w_kr_DR", _split(0, None, "CR", 1, rope=True), _mla),
    Row("self_attn.kv_a_layernorm.weight", "attn.kv_norm.scale_D", COPY, _mla),
    Row("self_attn.kv_b_proj.weight", "attn.w_uk_CNH", _split(0, "N", "HP", 0), _mla),
    Row("self_attn.kv_b_proj.weight", "attn.w_uv_CNP", _split(0, "N", "HP", 1), _mla),
    Row("self_attn.o_proj.weight", "attn.w_o_NPD", OUT_HEADS, _mla),
    # Dense SwiGLU MLP.
    Row("mlp.gate_proj.weight", "mlp.w_gate_DF", LINEAR, _dense),
    Row("mlp.up_proj.weight", "mlp.w_up_DF", LINEAR, _dense),
    Row("mlp.down_proj.weight", "mlp.w_down_FD", LINEAR, _dense),
    # Mixture of experts: router, correction bias, routed experts (slot [layer, e]), shared experts.
    Row("mlp.gate.weight", "mlp.w_router_DE", LINEAR, _moe, float32=True),
    Row("mlp.gate.e_score_correction_bias", "mlp.bias_E", COPY, _biased, float32=True),
    Row("mlp.experts.{e}.gate_proj.weight", "mlp.w_gate_EDM", LINEAR, _moe),
    Row("mlp.experts.{e}.up_proj.weight", "mlp.w_up_EDM", LINEAR, _moe),
    Row("mlp.experts.{e}.down_proj.weight", "mlp.w_down_EMD", LINEAR, _moe),
    Row("mlp.shared_experts.gate_proj.weight", "mlp.shared.w_gate_DF", LINEAR, _shared),
    Row("mlp.shared_experts.up_proj.weight", "mlp.shared.w_up_DF", LINEAR, _shared),
    Row("mlp.shared_experts.down_proj.weight", "mlp.shared.w_down_FD", LINEAR, _shared),
)

# Multi-token prediction depth k: model.layers.{num_hidden_layers + k}. ↔ mtp_layers.{k}.; its decoder layer
# is LAYER_ROWS under "block". eh_proj is (D, 2D): input columns [0, D) take enorm(embedding), [D, 2D) hnorm(h).
MTP_ROWS = (
    Row("enorm.weight", "enorm.scale_D", COPY),
    Row("hnorm.weight", "hnorm.scale_D", COPY),
    Row("eh_proj.weight", "w_e_DD", _split(1, None, "DD", 0)),
    Row("eh_proj.weight", "w_h_DD", _split(1, None, "DD", 1)),
    Row("shared_head.norm.weight", "norm.scale_D", COPY),
)

# Copies of the main model's tensors that DeepSeek-V3 checkpoints repeat in each MTP layer: written on
# export, ignored on import (jaxseek shares the main model's embedding and head).
MTP_COPIES = (
    Row("shared_head.head.weight", "head_DV", LINEAR, _untied),
    Row("shared_head.head.weight", "embed.table_VD", COPY, _tied),
    Row("embed_tokens.weight", "embed.table_VD", COPY),
)


@dataclasses.dataclass(frozen=True)
class Entry:
  """One concrete row: HF tensor `hf` ⇄ slot `index` (leading stacked axes) of the Variable at `path`."""

  hf: str
  path: Path
  index: tuple[int, ...]
  transform: Transform
  float32: bool = False
  export_only: bool = False


def _path(prefix: Path, dotted: str) -> Path:
  return prefix + tuple(dotted.split("."))


def _layer(cfg: ModelConfig, i: int, prefix: Path, slot: tuple[int, ...], moe: bool) -> list[Entry]:
  out = []
  for row in LAYER_ROWS:
    if not row.when(cfg, moe):
      continue
    experts = range(cfg.n_routed_experts) if "{e}" in row.hf else [None]
    for e in experts:
      index = slot if e is None else slot + (e,)
      out.append(Entry(f"model.layers.{i}." + row.hf.format(e=e), _path(prefix, row.jx), index, row.transform,
                       row.float32))
  return out


def entries(cfg: ModelConfig) -> list[Entry]:
  """Every HF tensor ⇄ jaxseek slot pair of model `cfg`, in checkpoint order."""
  out = [Entry(r.hf, _path((), r.jx), (), r.transform, r.float32) for r in TOP_ROWS[:1]]
  for i in range(cfg.num_hidden_layers):
    moe = i >= cfg.num_dense_layers
    stack = "moe_layers" if moe else "dense_layers"
    out += _layer(cfg, i, (stack, "blocks"), (i - cfg.num_dense_layers if moe else i,), moe)
  for k in range(cfg.num_nextn_predict_layers):
    i, prefix = cfg.num_hidden_layers + k, ("mtp_layers", k)
    out += [Entry(f"model.layers.{i}.{r.hf}", _path(prefix, r.jx), (), r.transform) for r in MTP_ROWS]
    out += _layer(cfg, i, prefix + ("block",), (), cfg.is_moe)
    out += [Entry(f"model.layers.{i}.{r.hf}", _path((), r.jx), (), r.transform, export_only=True)
            for r in MTP_COPIES if r.when(cfg, False)]
  out += [Entry(r.hf, _path((), r.jx), (), r.transform, r.float32) for r in TOP_ROWS[1:] if r.when(cfg, False)]
  return out
