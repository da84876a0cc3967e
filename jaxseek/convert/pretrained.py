"""`load_pretrained`: a Hugging Face model folder or a jaxseek checkpoint → the nnx model; and the jaxseek
checkpoint layout that conversion writes and training resumes from:

  <dir>/config.yaml                     the resolved Config (model section = the converted ModelConfig)
  <dir>/checkpoints/<step>/state        Orbax PyTree item {params: nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                                        biases: the same of RouterBias (only for models with MoE correction
                                        biases)}: the parameter part of a training checkpoint's `state`
  <dir>/checkpoints/<step>/config       Orbax JSON item: the same Config (training checkpoints record it too)
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax
import numpy as np
from flax import nnx, traverse_util

from jaxseek import checkpoint as checkpoint_lib
from jaxseek import config as config_lib
from jaxseek import model as model_lib
from jaxseek.config import ModelConfig
from jaxseek.convert import fp8, hf, mapping
from jaxseek.errors import UserError
from jaxseek.model.moe import RouterBias
from jaxseek.model.transformer import STACKS, Transformer
from jaxseek.pipeline import stages as pipeline
from jaxseek.sharding import rules

ITEMS = {"params": nnx.Param, "biases": RouterBias}


def load_pretrained(path: str | Path, *, param_dtype: str = "float32", dtype: str = "float32",
                    fp8: str | None = None, execution: dict | None = None) -> Transformer:
  """The model of a Hugging Face folder (config.json + safetensors), a jaxseek checkpoint folder (a run directory
or a converted checkpoint: its latest step) or one step of it (<dir>/checkpoints/<step>), weights loaded.

  `fp8`: the train.fp8 recipe the model runs its projections under (kernels/fp8_gemm.resolve gives it).
  `execution`: values of config.EXECUTION_KEYS (kernels, exchanges) to run with; a checkpoint's own choices that
  name one platform's kernels otherwise go back to auto (config.portable).
  `model(tokens_BT)` returns float32 logits [B, T, V]. Under `jax.set_mesh(mesh)` every weight is placed
  directly on its shards (the sharding rules of jaxseek.sharding.rules); otherwise on the default device.
  """
  path = Path(path)
  if (path / "config.json").is_file():
    return from_hf(hf.Folder(path), param_dtype=param_dtype, dtype=dtype, fp8=fp8, execution=execution)
  if (path / "config.yaml").is_file():
    return from_checkpoint(path, param_dtype=param_dtype, dtype=dtype, fp8=fp8, execution=execution)[0]
  if step_folder(path):
    return from_checkpoint(path.parent.parent, param_dtype=param_dtype, dtype=dtype, step=int(path.name),
                           fp8=fp8, execution=execution)[0]
  raise UserError(f"{path} has no config.json (Hugging Face model folder) or config.yaml (jaxseek checkpoint "
                  "folder) and is no checkpoint step (<dir>/checkpoints/<step>); pass the folder that holds one")


def step_folder(path: str | Path) -> bool:
  """Whether `path` is one step of a jaxseek checkpoint folder: <dir>/checkpoints/<step> beside <dir>/config.yaml."""
  path = Path(path)
  return path.name.isdigit() and path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").is_file()


def hf_model_config(folder: hf.Folder) -> ModelConfig:
  """The folder's ModelConfig; multi-token-prediction layers count only when their tensors are in the files
  (transformers records num_nextn_predict_layers but does not save those layers)."""
  layers = folder.config.get("num_hidden_layers")
  has_mtp = any(name.startswith(f"model.layers.{layers}.") for name in folder.names())
  return hf.model_config(folder.config, (folder.config.get("num_nextn_predict_layers") or 0) if has_mtp else 0)


def from_hf(folder: hf.Folder, *, param_dtype: str = "float32", dtype: str = "float32",
            fp8: str | None = None, execution: dict | None = None) -> Transformer:
  """Builds the model of an HF folder and streams its tensors into the Variables, one Variable at a time."""
  cfg = dataclasses.replace(hf_model_config(folder), **(execution or {}))
  mesh = _active_mesh()
  graphdef, state = nnx.split(nnx.eval_shape(lambda: model_lib.build(cfg, param_dtype=param_dtype, dtype=dtype,
                                                                     fp8=fp8)))
  variables = dict(nnx.to_flat_state(state))
  shardings = _shardings(state, mesh)
  es = [e for e in mapping.entries(cfg) if not e.export_only]
  hf.check_tensors(folder, cfg, es, {path: v.shape for path, v in variables.items()})
  by_path: dict[mapping.Path, list[mapping.Entry]] = {}
  for e in es:
    by_path.setdefault(e.path, []).append(e)
  for path, var in variables.items():
    var.set_value(hf.read_variable(folder, cfg, by_path[path], var.shape, var.dtype, shardings[path]))
  return nnx.merge(graphdef, state)


def _active_mesh() -> jax.sharding.Mesh | None:
  mesh = jax.sharding.get_mesh()
  return None if mesh.empty else mesh


def _shardings(state: nnx.State, mesh: jax.sharding.Mesh | None) -> dict:
  """Path → sharding of every Variable: the rules' NamedShardings on a mesh, else the default device."""
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return {path: device for path, _ in nnx.to_flat_state(state)}
  return dict(nnx.to_flat_state(rules.param_shardings(state, mesh)))


# ---------------------------------------------------------------------------------------- jaxseek checkpoints


def _new_folder(out: str | Path) -> Path:
  """`out` as an absolute path, checked to be new or empty (so nothing is overwritten)."""
  out = Path(out).absolute()
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise UserError(f"output folder {out} is not empty; choose a new folder so nothing there is overwritten")
  return out


def hf_to_checkpoint(hf_dir: str | Path, out: str | Path) -> ModelConfig:
  """Converts a Hugging Face folder into a new jaxseek checkpoint folder; returns its ModelConfig."""
  folder = hf.Folder(hf_dir)
  cfg = hf_model_config(folder)
  out = _new_folder(out)
  save_checkpoint(from_hf(folder), cfg, out)
  return cfg


def save_checkpoint(model: Transformer, cfg: ModelConfig, out: str | Path) -> Path:
  """Writes `out`/config.yaml and the Orbax checkpoint `out`/checkpoints/0 (items params, biases, config)."""
  import orbax.checkpoint as ocp

  out = _new_folder(out)
  out.mkdir(parents=True, exist_ok=True)
  train = config_lib.TrainConfig()  # a config that trains as it is: sequences no longer than the model's positions
  full = config_lib.Config(model=cfg, train=dataclasses.replace(train, seq_len=min(train.seq_len,
                                                                                    cfg.max_position_embeddings)))
  config_lib.dump(full, out / "config.yaml")
  parts = {name: nnx.to_pure_dict(nnx.state(model, kind)) for name, kind in ITEMS.items()}
  args = {"state": ocp.args.PyTreeSave({name: tree for name, tree in parts.items() if tree}),
          "config": ocp.args.JsonSave(config_lib.to_dict(full))}  # as training checkpoints record it
  # One zarr array per Variable rather than the OCDBT store, whose transaction holds every write in memory until
  # it commits (a copy of the model on top of the model); restore reads either layout.
  handlers = {"state": ocp.PyTreeCheckpointHandler(use_ocdbt=False), "config": ocp.JsonCheckpointHandler()}
  logging.getLogger("absl").addFilter(_not_ocdbt_merge)  # Orbax notes, harmlessly, that there is no OCDBT to merge
  with ocp.CheckpointManager(out / "checkpoints", item_handlers=handlers) as manager:
    manager.save(0, args=ocp.args.Composite(**args))
    manager.wait_until_finished()
  return out


def _not_ocdbt_merge(record: logging.LogRecord) -> bool:
  return "Skipping merge of OCDBT checkpoints" not in record.getMessage()


def from_checkpoint(path: str | Path, *, param_dtype: str = "float32", dtype: str = "float32",
                    step: int | None = None, fp8: str | None = None,
                    execution: dict | None = None) -> tuple[Transformer, config_lib.Config, int]:
  """The model of a jaxseek checkpoint folder at `step` (None: its latest), restored straight onto the active
  mesh, running with the `execution` choices (config.EXECUTION_KEYS; None: the checkpoint's, made portable)."""
  import orbax.checkpoint as ocp

  path = Path(path).absolute()
  cfg = config_lib.load(path / "config.yaml")
  model = dataclasses.replace(cfg.model, **execution) if execution else config_lib.portable(cfg.model)
  cfg = dataclasses.replace(cfg, model=model)
  if not (path / "checkpoints").is_dir():
    raise UserError(f"{path} has config.yaml but no checkpoints/ folder; pass a jaxseek checkpoint folder")
  mesh = _active_mesh()
  graphdef, state = nnx.split(nnx.eval_shape(
      lambda: model_lib.build(cfg.model, param_dtype=param_dtype, dtype=dtype, fp8=fp8)))
  shardings = _shardings(state, mesh)
  with ocp.CheckpointManager(path / "checkpoints") as manager:
    if step is None:
      step = manager.latest_step()
      if step is None:
        raise UserError(f"{path / 'checkpoints'} holds no finished checkpoint step")
    elif step not in manager.all_steps():
      raise UserError(f"{path / 'checkpoints' / str(step)} is not a finished checkpoint step; finished steps: "
                      f"{sorted(manager.all_steps()) or 'none'}")
    variables = dict(nnx.to_flat_state(state))
    abstract = {}
    for name, kind in ITEMS.items():
      tree = _nest({p: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[p])
                    for p, v in variables.items() if isinstance(v, kind)})
      if tree:
        abstract[name] = tree
    with checkpoint_lib.reading(f"checkpoint {path / 'checkpoints' / str(step)} cannot be read as the model of "
                                f"{path / 'config.yaml'}", "it is incomplete, corrupt or another model's"):
      restored = manager.restore(step, args=ocp.args.Composite(
          # the layers of a padded pipeline layout are its first rows (the model config is config.yaml's)
          state=checkpoint_lib.restore_args(abstract, partial=True, resized=STACKS),
          config=ocp.args.JsonRestore()))
  # layers saved in a circular pipeline's storage order go back to layer order
  arrays = pipeline.reorder(restored["state"], pipeline.stack_sizes(cfg.model),
                            pipeline.saved_layout(restored["config"] or {}), (1, 1))
  for name in abstract:
    for p, value in traverse_util.flatten_dict(arrays[name]).items():
      variables[p].set_value(value)
  return nnx.merge(graphdef, state), cfg, step


def _nest(flat: dict) -> dict:
  """{path tuple: leaf} → nested dicts (the pure-dict layout of an nnx State)."""
  out: dict = {}
  for path, leaf in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf
  return out


def export_hf(checkpoint: str | Path, out: str | Path, *, dtype: str = "float32",
              max_shard_bytes: int = 5 * 10**9) -> list[str]:
  """Writes the latest step of a jaxseek checkpoint as a Hugging Face folder; returns the files written."""
  out = _new_folder(out)
  model, cfg, _ = from_checkpoint(checkpoint)
  arrays = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))}
  return hf.write_folder(out, cfg.model, arrays, dtype, max_shard_bytes)


def describe(cfg: ModelConfig) -> str:
  """One line naming the variant: attention, experts and routing, layer stacks, MTP, RoPE."""
  if cfg.is_mla:
    q = f"q_lora {cfg.q_lora_rank}" if cfg.q_lora_rank else "no q compression"
    attn = f"MLA ({cfg.num_attention_heads} heads, {q}, kv_lora {cfg.kv_lora_rank})"
  else:
    kind = "MHA" if cfg.kv_heads == cfg.num_attention_heads else "GQA"
    attn = f"{kind} ({cfg.num_attention_heads} heads, {cfg.kv_heads} kv heads, head dim {cfg.dense_head_dim})"
  parts = [cfg.model_type, attn]
  if cfg.is_moe:
    groups = f", {cfg.n_group} groups keep {cfg.topk_group}" if cfg.n_group > 1 else ""
    parts.append(f"MoE {cfg.n_routed_experts} routed + {cfg.n_shared_experts} shared experts, top-"
                 f"{cfg.num_experts_per_tok} {cfg.scoring_func} {cfg.topk_method}{groups}")
  parts.append(f"{cfg.num_dense_layers} dense + {cfg.num_moe_layers} MoE layers")
  if cfg.num_nextn_predict_layers:
    parts.append(f"MTP depth {cfg.num_nextn_predict_layers}")
  if cfg.rope_scaling:
    parts.append(f"YaRN ×{cfg.rope_scaling['factor']:g}")
  return " · ".join(parts)


def inspect(path: str | Path) -> list[str]:
  """Lines describing a Hugging Face folder or a jaxseek checkpoint: the variant, then each tensor."""
  path = Path(path)
  if (path / "config.json").is_file():
    folder = hf.Folder(path)
    cfg = hf_model_config(folder)
    lines = [f"Hugging Face folder {path} ({len(folder.files)} safetensors files)", f"variant: {describe(cfg)}"]
    if any(folder.dtype(n) in fp8.FP8_DTYPES for n in folder.names()):
      lines.append(f"FP8 e4m3 weights with {folder.block[0]}×{folder.block[1]} block scales (dequantised on load)")
    return lines + [f"{n}  {list(folder.shape(n))}  {folder.dtype(n)}" for n in folder.names()]
  if not (path / "config.yaml").is_file():
    raise UserError(f"{path} has no config.json (Hugging Face model folder) or config.yaml (jaxseek checkpoint "
                    "folder); pass the folder that holds one")
  import orbax.checkpoint as ocp

  cfg = config_lib.load(path / "config.yaml")
  handlers = {"state": ocp.PyTreeCheckpointHandler(), "config": ocp.JsonCheckpointHandler()}
  with ocp.CheckpointManager((path / "checkpoints").absolute(), item_names=tuple(handlers),
                             item_handlers=handlers) as manager:
    step = manager.latest_step()
    if step is None:
      raise UserError(f"{path / 'checkpoints'} holds no finished checkpoint step")
    tree = manager.item_metadata(step)["state"]
    lines = [f"jaxseek checkpoint {path} (step {step})", f"variant: {describe(cfg.model)}"]
    tree = dict(tree.tree if hasattr(tree, "tree") else tree) if tree else {}
    for p, leaf in traverse_util.flatten_dict(tree).items():
      lines.append(f"{p[0]}/{'.'.join(map(str, p[1:]))}  {list(leaf.shape)}  {np.dtype(leaf.dtype)}")
  return lines
