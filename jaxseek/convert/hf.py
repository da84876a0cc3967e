"""Hugging Face model folders: config.json ⇄ ModelConfig, and safetensors read and written one tensor at a time.

A folder holds config.json and model.safetensors, or shards listed in model.safetensors.index.json. Tensors are
read one at a time with plain file reads into a fresh array; FP8 tensors are dequantised as they are read.
(safetensors' own `safe_open` keeps the whole file memory-mapped, so every page it touched stays resident
until the file is closed, and its NumPy reader cannot return float8 arrays; the format is a JSON header
followed by raw little-endian arrays, read here directly.)
"""

from __future__ import annotations

import json
import struct
import sys
import types
import typing
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxseek import config as config_lib
from jaxseek.config import ModelConfig
from jaxseek.convert import fp8, mapping
from jaxseek.errors import UserError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "deepseek": "DeepseekForCausalLM",
                 "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


# ------------------------------------------------------------------------------------------ safetensors


class SafetensorsFile:
  """The header of one .safetensors file; `read` loads one tensor with a plain read."""

  def __init__(self, path: Path):
    self.path = path
    try:
      with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
      raise UserError(f"{path} is not a readable safetensors file ({e}); download it again") from None
    self.data_start = 8 + n
    header.pop("__metadata__", None)
    self.tensors: dict[str, dict] = header

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.tensors[name]["shape"])

  def dtype(self, name: str) -> np.dtype:
    code = self.tensors[name]["dtype"]
    if code not in DTYPES:
      raise UserError(f"tensor {name} in {self.path} has dtype {code}, which jaxseek cannot read")
    return np.dtype(DTYPES[code])

  def read(self, name: str) -> np.ndarray:
    begin, end = self.tensors[name]["data_offsets"]
    dtype, shape = self.dtype(name), self.shape(name)
    out = np.empty(shape, dtype)
    with open(self.path, "rb") as f:
      f.seek(self.data_start + begin)
      got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    if got != end - begin or end - begin != out.nbytes:
      raise UserError(f"tensor {name} in {self.path} is truncated; download the file again")
    return out


def write_safetensors(path: Path, specs: list[tuple[str, tuple[int, ...], np.dtype]], produce) -> None:
  """Writes tensors `specs` (name, shape, dtype) to `path`, calling `produce(name)` for each one in turn."""
  header, offset = {}, 0
  for name, shape, dtype in specs:
    size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": CODES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + size]}
    offset += size
  header["__metadata__"] = {"format": "pt"}
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for name, shape, dtype in specs:
      x = np.ascontiguousarray(produce(name), dtype=dtype)
      assert x.shape == tuple(shape), (name, x.shape, shape)
      f.write(memoryview(x.reshape(-1).view(np.uint8)))


# ------------------------------------------------------------------------------------------- the folder


class Folder:
  """A Hugging Face model folder: its config.json and where each tensor lives."""

  def __init__(self, path: str | Path):
    self.path = Path(path)
    config_path = self.path / "config.json"
    if not config_path.is_file():
      raise UserError(f"{self.path} has no config.json; pass a Hugging Face model folder (config.json + "
                      "*.safetensors) or a jaxseek checkpoint folder (config.yaml + checkpoints/)")
    self.config = read_json(config_path)
    self.files: dict[str, SafetensorsFile] = {}
    if (self.path / INDEX).is_file():
      weight_map = read_json(self.path / INDEX).get("weight_map", {})
      for file in sorted(set(weight_map.values())):
        if not (self.path / file).is_file():
          raise UserError(f"{self.path / INDEX} lists {file}, which is missing from {self.path}; download it")
        self.files[file] = SafetensorsFile(self.path / file)
      for name, file in weight_map.items():
        if name not in self.files[file].tensors:
          raise UserError(f"{self.path / INDEX} puts tensor {name} in {file}, which does not hold it")
    elif (self.path / SINGLE).is_file():
      self.files[SINGLE] = SafetensorsFile(self.path / SINGLE)
    else:
      raise UserError(f"{self.path} has neither {SINGLE} nor {INDEX}; jaxseek reads safetensors checkpoints")
    self.where = {name: file for file, st in self.files.items() for name in st.tensors}
    self.block = fp8.block_size(self.config.get("quantization_config"))

  def __contains__(self, name: str) -> bool:
    return name in self.where

  def names(self) -> list[str]:
    return list(self.where)

  def file(self, name: str) -> SafetensorsFile:
    return self.files[self.where[name]]

  def shape(self, name: str) -> tuple[int, ...]:
    return self.file(name).shape(name)

  def dtype(self, name: str) -> np.dtype:
    return self.file(name).dtype(name)

  def read(self, name: str) -> np.ndarray:
    """The tensor as stored, or dequantised to float32 when it is FP8."""
    x = self.file(name).read(name)
    if x.dtype not in fp8.FP8_DTYPES:
      return x
    scale = fp8.scale_name(name)
    if scale not in self:
      raise UserError(f"FP8 tensor {name} in {self.where[name]} has no {scale}; the checkpoint is incomplete")
    return fp8.dequantize(x, self.file(scale).read(scale), self.block, name)

  def interleaved_rope(self) -> bool:
    """Whether the MLA RoPE columns are stored as interleaved pairs (V2 always; V3 unless rope_interleave=false)."""
    kind = self.config.get("model_type")
    return kind == "deepseek_v2" or (kind == "deepseek_v3" and self.config.get("rope_interleave", True) is not False)


def read_json(path: Path) -> dict:
  try:
    data = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise UserError(f"{path} is not valid JSON ({e}); fix or download it again") from None
  if not isinstance(data, dict):
    raise UserError(f"{path} must hold a JSON object")
  return data


# ----------------------------------------------------------------------------------- config.json ⇄ ModelConfig

# Keys that change the math in ways jaxseek does not implement, with the only value it accepts.
_REQUIRED = {"hidden_act": "silu", "mlp_bias": False, "attention_bias": False, "moe_layer_freq": 1,
             "partial_rotary_factor": 1.0, "use_sliding_window": False, "sliding_window": None}
# What transformers assumes when config.json leaves a key out (DeepSeek-V3 always routes this way).
_DEFAULTS = {"deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}}
_YARN_KEYS = config_lib.YARN_KEYS
_FIELDS = typing.get_type_hints(ModelConfig)


def model_config(raw: dict[str, Any], mtp_depth: int) -> ModelConfig:
  """The ModelConfig of an HF config.json; `mtp_depth` multi-token-prediction layers are kept.

  Keys named like ModelConfig fields map to them; HF-only keys (architectures, dtype, token ids, use_cache, …)
  are ignored; keys that jaxseek cannot represent raise UserError.
  """
  kind = raw.get("model_type")
  if kind not in ARCHITECTURES:
    raise UserError(f"config.json model_type {kind!r} is not supported; jaxseek converts "
                    f"{', '.join(ARCHITECTURES)}")
  for key, allowed in _REQUIRED.items():
    if key in raw and raw[key] != allowed and not (raw[key] is None and allowed is not None):
      raise UserError(f"config.json {key}={raw[key]!r} is not supported by jaxseek (it needs {allowed!r})")
  values = dict(_DEFAULTS.get(kind, {}))
  for key, value in raw.items():
    if key in _FIELDS and key not in ("rope_theta", "rope_scaling", "num_nextn_predict_layers"):
      if value is not None or _optional(key):
        values[key] = value
  if kind in ("deepseek_v2", "deepseek_v3"):  # MLA: transformers stores derived head_dim / kv heads
    values.pop("head_dim", None)
    values.pop("num_key_value_heads", None)
  values["rope_theta"], values["rope_scaling"] = _rope(raw)
  values["num_nextn_predict_layers"] = mtp_depth
  cfg = config_lib.from_dict({"model": values})
  config_lib.validate(cfg, model_only=True)
  warn_v2_topk_norm(cfg.model)
  return cfg.model


def warn_v2_topk_norm(cfg: ModelConfig) -> None:
  """One line on stderr where transformers and jaxseek route a V2 model differently."""
  if cfg.model_type == "deepseek_v2" and cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
    print("warning: deepseek_v2 norm_topk_prob=true: jaxseek renormalises the top-k routing weights as DeepSeek's "
          "reference code does (and then does not apply routed_scaling_factor); transformers' DeepseekV2 ignores "
          "norm_topk_prob, so its logits will differ", file=sys.stderr, flush=True)


def _optional(key: str) -> bool:
  tp = _FIELDS[key]
  return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _rope(raw: dict[str, Any]) -> tuple[float, dict | None]:
  """(rope_theta, rope_scaling) from transformers v5's rope_parameters or the older rope_theta + rope_scaling."""
  params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
  if any(isinstance(v, dict) for v in params.values()):
    raise UserError("config.json rope_parameters per layer type are not supported; jaxseek uses one RoPE")
  theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
  kind = params.pop("rope_type", params.pop("type", "default"))
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise UserError("config.json partial_rotary_factor is not supported; jaxseek rotates the whole RoPE head")
  params.pop("partial_rotary_factor", None)
  if kind == "default":
    return theta, None
  if kind != "yarn":
    raise UserError(f"config.json RoPE type {kind!r} is not supported; jaxseek supports default and yarn")
  unknown = sorted(set(params) - _YARN_KEYS)
  if unknown:
    raise UserError(f"config.json yarn RoPE key {unknown[0]!r} is not supported; known: {sorted(_YARN_KEYS)}")
  if params.get("factor") is None:  # transformers: the context extension itself
    params["factor"] = raw["max_position_embeddings"] / params["original_max_position_embeddings"]
  return theta, {"type": "yarn", **params}


_MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_MOE_KEYS = ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
             "first_k_dense_replace", "scoring_func", "topk_method", "n_group", "topk_group", "norm_topk_prob",
             "routed_scaling_factor", "aux_loss_alpha")
_COMMON_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "initializer_range")


def hf_config(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
  """The config.json that transformers (or DeepSeek's own code, for model_type deepseek) loads for `cfg`."""
  warn_v2_topk_norm(cfg)
  out: dict[str, Any] = {"architectures": [ARCHITECTURES[cfg.model_type]], "model_type": cfg.model_type,
                         "torch_dtype": dtype, "hidden_act": "silu", "attention_bias": False}
  keys = _COMMON_KEYS + (_MLA_KEYS if cfg.is_mla else ()) + (_MOE_KEYS if cfg.is_moe else ())
  out.update({key: getattr(cfg, key) for key in keys})
  out["num_key_value_heads"] = cfg.num_attention_heads if cfg.is_mla else cfg.kv_heads
  if cfg.head_dim is not None and not cfg.is_mla:
    out["head_dim"] = cfg.head_dim
  out["rope_scaling"] = dict(cfg.rope_scaling) if cfg.rope_scaling else None
  if cfg.is_moe:
    out["moe_layer_freq"] = 1
  if cfg.model_type == "deepseek_v3":
    out["num_nextn_predict_layers"] = cfg.num_nextn_predict_layers
    out["rope_interleave"] = True  # the weights are written with interleaved RoPE columns, as DeepSeek's own
  return out


# ------------------------------------------------------------------------------------ tensors ⇄ Variables

OUT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def check_tensors(folder: Folder, cfg: ModelConfig, es: list[mapping.Entry], shapes: dict) -> None:
  """Every tensor the model needs is present with the shape the config implies, and nothing else is there."""
  d = mapping.dims(cfg)
  for e in es:
    if e.export_only:
      continue
    if e.hf not in folder:
      raise UserError(f"tensor {e.hf} is missing from {folder.path}; the checkpoint does not match its config.json")
    expected, found = e.transform.hf_shape(shapes[e.path][len(e.index):], d), folder.shape(e.hf)
    if found != expected:
      raise UserError(f"tensor {e.hf} in {folder.where[e.hf]} has shape {list(found)}, but config.json implies "
                      f"{list(expected)}; the checkpoint does not match its config.json")
  used = {e.hf for e in es}
  extra = [n for n in folder.names() if n not in used and not _ignorable(n, folder, cfg)]
  if extra:
    raise UserError(f"tensor {extra[0]} in {folder.where[extra[0]]} has no place in a {cfg.model_type} model with "
                    f"this config.json ({len(extra)} such tensors); check config.json")


def _ignorable(name: str, folder: Folder, cfg: ModelConfig) -> bool:
  """FP8 scales (read with their weight), RoPE caches, MTP layers not loaded, a tied head's copy."""
  if name.endswith("_scale_inv") and name[:-len("_scale_inv")] in folder:
    return True
  if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
    return True
  parts = name.split(".")
  return parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= cfg.num_hidden_layers


def read_variable(folder: Folder, cfg: ModelConfig, es: list[mapping.Entry], shape: tuple[int, ...], dtype,
                  sharding: jax.sharding.Sharding) -> jax.Array:
  """One jaxseek Variable, built shard by shard: each device's block reads only the tensors that fall in it."""
  d, interleaved, lead = mapping.dims(cfg), folder.interleaved_rope(), len(es[0].index)

  def block(index: tuple[slice, ...]) -> np.ndarray:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    ranges = [range(*s.indices(n)) for s, n in zip(index, shape)]
    out = np.empty([len(r) for r in ranges], dtype)
    filled = 0
    for e in es:
      if all(i in r for i, r in zip(e.index, ranges)):
        slot = e.transform.to_jaxseek(folder.read(e.hf), shape[lead:], d, interleaved)
        out[tuple(r.index(i) for i, r in zip(e.index, ranges))] = slot[index[lead:]]
        filled += 1
    assert filled == int(np.prod([len(r) for r in ranges[:lead]])), (es[0].path, filled)
    return out

  return jax.make_array_from_callback(shape, sharding, block)


def write_folder(out: Path, cfg: ModelConfig, arrays: dict, dtype: str, max_shard_bytes: int) -> list[str]:
  """Writes config.json and the safetensors shards (+ index when more than one) of the Variables `arrays`
  (path → array); each HF tensor is assembled and written on its own. Returns the file names."""
  d, groups = mapping.dims(cfg), {}
  for e in mapping.entries(cfg):
    groups.setdefault(e.hf, []).append(e)
  specs = []
  for name, es in groups.items():
    slot = arrays[es[0].path].shape[len(es[0].index):]
    specs.append((name, es[0].transform.hf_shape(slot, d), OUT_DTYPES["float32" if es[0].float32 else dtype]))

  shapes = {name: shape for name, shape, _ in specs}

  def produce(name: str) -> np.ndarray:
    full = np.empty(shapes[name], np.float32)
    for e in groups[name]:
      piece = e.transform.to_hf(np.asarray(arrays[e.path][e.index], np.float32))
      e.transform.place(full, piece, d, interleaved=True)
    return full

  shards: list[list] = [[]]
  size = 0
  for spec in specs:
    if shards[-1] and size + _nbytes([spec]) > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(spec)
    size += _nbytes([spec])
  files = [SINGLE] if len(shards) == 1 else [f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                                             for k in range(1, len(shards) + 1)]
  out.mkdir(parents=True, exist_ok=True)
  for file, shard in zip(files, shards):
    write_safetensors(out / file, shard, produce)
  if len(files) > 1:
    index = {"metadata": {"total_size": _nbytes(specs)},
             "weight_map": {name: file for file, shard in zip(files, shards) for name, _, _ in shard}}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
  (out / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
  return ["config.json"] + files + ([INDEX] if len(files) > 1 else [])


def _nbytes(specs: list) -> int:
  return sum(int(np.prod(shape, dtype=np.int64)) * dt.itemsize for _, shape, dt in specs)
