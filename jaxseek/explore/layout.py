"""The explorer's layout: every array of the train state, where it lives on the mesh, and its bytes per device.

Everything here is analytic and needs no devices: shapes come from the train state built abstractly
(`train.make_trainer` on one device, `nnx.eval_shape` inside), placements from the rules tables in
`sharding/rules.py`, and the mesh is nothing but axis sizes, so 2048 "devices" are as cheap as 8.

A parameter's place on the mesh is written in the scaling-book notation: `w_gate[L, D_fsdp, F_tensor]` splits
D over the fsdp axis and F over tensor; only axes larger than 1 are shown.

The pipeline axis, as the train step places it (pipeline/stages.py): a layer stack the stage count S divides,
or with at least 2·S layers, is split into S stages (each holds L/S layers, after identity padding to a multiple
of S·R when S·R does not divide L). Everything else (another stack, the embedding, the final norm, the head,
the multi-token-prediction layers: the *outer* weights) is placed by `rules.param_spec` with the mesh: stored
1/S per stage on one more dimension split over `pipeline` where one divides, and gathered whole for the step
(`leaves_on`). Every stage therefore stores the same.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh

from jaxseek.config import MESH_AXES, Config
from jaxseek.sharding import rules as rules_lib
from jaxseek.sharding.rules import PARAM_RULES, Rules, spec, state_rules

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
STACKS = ("embed", "dense_layers", "moe_layers", "final_norm", "head_DV", "mtp_layers")
LAYER_STACKS = ("dense_layers", "moe_layers")
# One letter per logical axis (the shape-suffix key in jaxseek/model); "head_dim" and unnamed dimensions take
# the letter of the variable's own suffix (H, R or P; E for the router).
LETTERS = {"embed": "D", "vocab": "V", "heads": "N", "kv_heads": "G", "q_lora": "Q", "kv_lora": "C", "mlp": "F",
           "expert_mlp": "M", "experts": "E", "layers": "L", "batch": "B", "length": "T"}


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One array of the train state: its global shape and the mesh axes each dimension is split over."""

  kind: str  # "params", "biases", "opt_state" or "other" (step, counters, loss window)
  path: str  # "moe_layers.blocks.attn.w_q_DNH"; optimiser moments are prefixed by their slot ("mu.", "nu.")
  shape: tuple[int, ...]
  dtype: str
  itemsize: int
  names: tuple[str | None, ...]  # logical axes ((None, ...) for replicated leaves)
  axes: tuple[tuple[str, ...], ...]  # mesh axes per dimension, from the rules
  stack: str | None  # which of STACKS holds it (None: every stage holds it)
  letters: str  # one shape letter per dimension


@dataclasses.dataclass(frozen=True)
class Model:
  """What the analysis needs from a config, computed once: every state leaf, counts and FLOPs."""

  cfg: Config
  leaves: tuple[Leaf, ...]
  total_parameters: int
  mtp_parameters: int
  flops_per_token: float  # training (forward + backward) FLOPs per token, metrics.flops_per_token
  recipe_flops_per_token: float = 0.0  # the part train.fp8 runs in FP8: metrics.recipe_flops_per_token
  # {part: (flops, recipe flops)} per token by the part that runs them (metrics.flops_by_part): the stages' shares
  flops_by_part: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
  memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)  # per-mesh results (suggest)

  def with_train(self, **changes) -> "Model":
    """The same model under other train settings (microbatches, remat): the state does not change."""
    cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(self.cfg.train, **changes))
    return dataclasses.replace(self, cfg=cfg)

  def with_model(self, **changes) -> "Model":
    """The same model under other execution keys (config.EXECUTION_KEYS: no array changes)."""
    cfg = dataclasses.replace(self.cfg, model=dataclasses.replace(self.cfg.model, **changes))
    return dataclasses.replace(self, cfg=cfg)


def describe(cfg: Config) -> Model:
  """Builds the train state abstractly (nothing allocated) and records every leaf with its placement."""
  from jaxseek import metrics as metrics_lib
  from jaxseek import step as step_lib

  trainer = step_lib.make_trainer(cfg, one_device_mesh(), backend_checks=False)  # plans for any backend
  state = trainer.abstract_state
  leaves = []
  with rules_lib.layout(cfg):  # the parameter rules of the config's layout (model.moe_tensor)
    for kind in ("params", "biases", "opt_state"):
      for path, var in _flatten(getattr(state, kind)):
        leaves.append(_leaf(kind, path, var, state_rules(kind, cfg.train.zero)))
  for kind in ("step", "loss_window"):
    value = getattr(state, kind)
    leaves.append(_leaf("other", kind, value, PARAM_RULES))
  total = sum(math.prod(x.shape) for x in leaves if x.kind == "params")
  mtp = sum(math.prod(x.shape) for x in leaves if x.kind == "params" and x.stack == "mtp_layers")
  parts = metrics_lib.flops_by_part(cfg, state.params)
  return Model(cfg, tuple(leaves), total, mtp, sum(f for f, _ in parts.values()), sum(r for _, r in parts.values()),
               parts)


def one_device_mesh() -> Mesh:
  """A mesh of size 1 on every axis: the abstract state's shapes do not depend on the mesh."""
  device = np.array(jax.devices()[:1], dtype=object).reshape((1,) * len(MESH_AXES))
  return Mesh(device, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _flatten(tree) -> list[tuple[str, Any]]:
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  return [(_path(path), leaf) for path, leaf in flat]


def _path(path) -> str:
  parts = []
  for key in path:
    name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", None)))
    parts.append(str(name))
  return ".".join(parts)


def _leaf(kind: str, path: str, value, rules: Rules) -> Leaf:
  shape, dtype = tuple(value.shape), np.dtype(value.dtype)
  names = tuple(value.get_metadata()["logical_axes"]) if isinstance(value, nnx.Variable) else (None,) * len(shape)
  axes = tuple(_entry_axes(entry) for entry in spec(names, rules)) if any(names) else ((),) * len(shape)
  if kind == "opt_state":
    slot = next((p for p in path.split(".") if p in ("mu", "nu")), None)
    path = f"{slot}." + path.split(f".{slot}.", 1)[1] if slot else path
  stack = next((p for p in path.split(".") if p in STACKS), None) if kind != "other" else None
  return Leaf(kind, path, shape, dtype.name, dtype.itemsize, names, axes, stack, _letters(path, names))


def _entry_axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _letters(path: str, names: tuple[str | None, ...]) -> str:
  """Shape letters: the logical axis's letter, else the variable's own suffix letter at that position."""
  name = path.rsplit(".", 1)[-1]
  suffix = name.rsplit("_", 1)[-1] if "_" in name else ""
  body = [n for n in names if n != "layers"]
  own = suffix if suffix.isupper() and len(suffix) == len(body) else "?" * len(body)
  out, i = [], 0
  for n in names:
    if n == "layers":
      out.append("L")
      continue
    out.append(LETTERS.get(n) if n in LETTERS else own[i])
    i += 1
  return "".join(out)


# --------------------------------------------------------------------------------------------- placement


def stage_layers(cfg: Config, pipeline: int) -> list[dict[str, int]]:
  """Layer rows of each stack on each pipeline stage: its stored rows / S for a pipelined stack (padded to a
  multiple of S·R when S·R does not divide it), else all L (it runs on every stage). The same on every stage."""
  from jaxseek.pipeline import stages as pipeline_lib

  m, R = cfg.model, cfg.train.pipeline_repeats
  held = {"dense_layers": m.num_dense_layers, "moe_layers": m.num_moe_layers}
  per_stage = {s: pipeline_lib.stored_layers(n, pipeline, R) // pipeline if pipelined(cfg, s, pipeline) else n
               for s, n in held.items()}
  return [dict(per_stage) for _ in range(pipeline)]


def pipelined(cfg: Config, stack: str, pipeline: int) -> bool:
  """Whether a layer stack is split over the pipeline stages."""
  from jaxseek.pipeline import stages as pipeline_lib

  n = {"dense_layers": cfg.model.num_dense_layers, "moe_layers": cfg.model.num_moe_layers}.get(stack, 0)
  return pipeline_lib.stack_repeats(n, pipeline, 1) > 0


def outer(cfg: Config, leaf: Leaf, pipeline: int) -> bool:
  """Whether a state leaf lies outside the pipelined stacks (embedding, another stack, final norm, head, MTP)."""
  return pipeline > 1 and leaf.kind != "other" and not (leaf.stack in LAYER_STACKS and pipelined(cfg, leaf.stack,
                                                                                                   pipeline))


def table_schedule(cfg: Config, pipeline: int) -> bool:
  """Whether a table schedule (1F1B, interleaved 1F1B, ZB-H1, ZB-V, DualPipeV) runs the whole model inside the pipeline."""
  from jaxseek.pipeline import stages as pipeline_lib

  return pipeline > 1 and cfg.train.pipeline_schedule in pipeline_lib.ONE_F_ONE_B


def outer_role(cfg: Config, stack: str | None, pipeline: int) -> str:
  """Which stage runs an outer part under a table schedule: the embedding and the stacks before the pipelined
  one run with the first virtual stage ("first"), the rest with the last ("last"); the V (ZB-V, DualPipeV) puts
  both on stage 0."""
  from jaxseek.pipeline import stages as pipeline_lib

  if pipeline_lib.shape(cfg) == "v":
    return "first"
  piped = pipeline_lib.pipelined_stack(cfg.model, pipeline, cfg.train.pipeline_repeats)
  before = STACKS[:STACKS.index(piped)]
  return "first" if stack in before else "last"


def outer_parts(cfg: Config, stack: str | None, pipeline: int) -> tuple[str, ...]:
  """The parts of the model under a table schedule that read an outer leaf: its `outer_role`, and for the
  embedding also the last part where MTP embeds the tokens ahead (or the head is the tied table)."""
  role = outer_role(cfg, stack, pipeline)
  reads_later = cfg.model.num_nextn_predict_layers > 0 or cfg.model.tie_word_embeddings
  return ("first", "last") if stack == "embed" and role == "first" and reads_later else (role,)


def gathered_itemsize(cfg: Config, leaf: Leaf) -> int:
  """Bytes per element of an outer weight as a table schedule gathers it (objective.as_computed): the compute
  dtype for matrices but the router's, the leaf's own dtype for vectors (norm scales) and the router."""
  matrix = len([n for n in leaf.names if n != "layers"]) >= 2
  return ITEMSIZE[cfg.train.compute_dtype] if matrix and "router" not in leaf.path else leaf.itemsize


def over_stages(leaf: Leaf) -> bool:
  """Whether a leaf placed by `leaves_on` is split over `pipeline` on a dimension other than its layers."""
  return any("pipeline" in axes for axes, name in zip(leaf.axes, leaf.names) if name != "layers")


def leaves_on(model: Model, sizes: dict[str, int]) -> tuple[Leaf, ...]:
  """The state leaves placed on this mesh as the train step places them: `rules.param_spec` with the mesh and
  the stored shape (a pipelined stack padded to its stored layers), `pipeline` left off a layer dimension
  (`on_stage` gives a stage its layers)."""
  from jaxseek.pipeline import stages as pipeline_lib

  S = sizes["pipeline"]
  if S == 1:
    return model.leaves
  key = ("leaves", tuple(sizes[a] for a in MESH_AXES))
  if key not in model.memo:
    cfg = model.cfg
    mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
    stored = {stack: pipeline_lib.stored_layers(n, S, cfg.train.pipeline_repeats) if pipelined(cfg, stack, S) else n
              for stack, n in (("dense_layers", cfg.model.num_dense_layers), ("moe_layers", cfg.model.num_moe_layers))}
    out = []
    for leaf in model.leaves:
      shape = leaf.shape
      if leaf.stack in LAYER_STACKS and leaf.names and leaf.names[0] == "layers":
        shape = (stored[leaf.stack], *shape[1:])
      out.append(dataclasses.replace(leaf, axes=_rules_axes(leaf, shape, mesh, cfg.train.zero)))
    model.memo[key] = tuple(out)
  return model.memo[key]


def _rules_axes(leaf: Leaf, shape: tuple[int, ...], mesh: AbstractMesh, zero: int) -> tuple[tuple[str, ...], ...]:
  if leaf.kind == "other" or not any(leaf.names):
    return leaf.axes
  entries = tuple(rules_lib.param_spec(leaf.names, shape, mesh, state_rules(leaf.kind, zero)))
  axes = [_entry_axes(e) for e in entries + (None,) * (len(shape) - len(entries))]
  return tuple(tuple(a for a in dim if a != "pipeline") if name == "layers" else dim
               for dim, name in zip(axes, leaf.names))


def leaf_bytes(leaf: Leaf, sizes: dict[str, int], layers: int | None = None) -> int:
  """Bytes of one device's shard; `layers` replaces a stacked leaf's layer count (its stage's share)."""
  total = leaf.itemsize
  for dim, axes, name in zip(leaf.shape, leaf.axes, leaf.names):
    if name == "layers" and layers is not None:
      dim = layers
    total *= -(-dim // math.prod(sizes[a] for a in axes))
  return total


def on_stage(leaf: Leaf, stage: int, layers: list[dict[str, int]]) -> int | None:
  """The leaf's layer count on `stage` (None: held whole)."""
  if leaf.stack in LAYER_STACKS:
    return layers[stage][leaf.stack]
  return None


def stage_state_bytes(model: Model, sizes: dict[str, int], stage: int,
                      layers: list[dict[str, int]]) -> dict[str, int]:
  """Bytes per device of each kind of state leaf on one pipeline stage (remembered per mesh)."""
  key = ("state", tuple(sizes[a] for a in MESH_AXES), stage, len(layers))
  if key not in model.memo:
    out = {"params": 0, "biases": 0, "opt_state": 0, "other": 0}
    for leaf in leaves_on(model, sizes):
      count = on_stage(leaf, stage, layers)
      if count != 0:
        out[leaf.kind] += leaf_bytes(leaf, sizes, count)
    model.memo[key] = out
  return model.memo[key]


def notation(leaf_name: str, letters: str, axes: tuple[tuple[str, ...], ...], sizes: dict[str, int],
             pipeline_layers: bool = False) -> str:
  """Scaling-book placement, e.g. `w_gate[L, D_fsdp, F_tensor]`; axes of size 1 are left out."""
  parts = []
  for letter, dim_axes in zip(letters, axes):
    used = [a for a in dim_axes if sizes[a] > 1]
    if letter == "L" and pipeline_layers and sizes["pipeline"] > 1:
      used = ["pipeline"]
    parts.append(letter if not used else f"{letter}_{used[0]}" if len(used) == 1 else f"{letter}_({','.join(used)})")
  base = leaf_name.rsplit("_", 1)[0] if "_" in leaf_name and leaf_name.rsplit("_", 1)[1].isupper() else leaf_name
  return f"{base}[{', '.join(parts)}]"


def parameter_rows(model: Model, sizes: dict[str, int]) -> list[dict[str, Any]]:
  """One row per parameter (layer stacks folded: one row covers all layers of a stack); "stages" is the number
  of pipeline stages its layers are split over (1: every stage holds it whole)."""
  layers = stage_layers(model.cfg, sizes["pipeline"])
  rows = []
  for leaf in leaves_on(model, sizes):
    if leaf.kind not in ("params", "biases"):
      continue
    piped = pipelined(model.cfg, leaf.stack, sizes["pipeline"])
    per_stage = [leaf_bytes(leaf, sizes, on_stage(leaf, s, layers)) for s in range(len(layers))]
    rows.append({"name": leaf.path, "kind": "bias" if leaf.kind == "biases" else "param", "stack": leaf.stack,
                 "shape": list(leaf.shape), "dtype": leaf.dtype, "logical_axes": list(leaf.names),
                 "mesh_axes": [list(a) for a in leaf.axes],
                 "placement": notation(leaf.path.rsplit(".", 1)[-1], leaf.letters, leaf.axes, sizes,
                                       piped and "layers" in leaf.names),
                 "stages": sizes["pipeline"] if piped else 1, "bytes_per_device": max(per_stage)})
  return rows


def optimizer_rows(model: Model, sizes: dict[str, int]) -> list[dict[str, Any]]:
  """Optimiser state grouped by slot (AdamW mu, nu; step counters) and stack, bytes on one stage."""
  layers = stage_layers(model.cfg, sizes["pipeline"])
  groups: dict[tuple[str, str], dict[str, Any]] = {}
  for leaf in leaves_on(model, sizes):
    if leaf.kind != "opt_state":
      continue
    slot = leaf.path.split(".", 1)[0] if leaf.path.split(".", 1)[0] in ("mu", "nu") else "count"
    key = (slot, leaf.stack or "-")
    row = groups.setdefault(key, {"slot": slot, "stack": leaf.stack, "arrays": 0, "elements": 0,
                                  "dtype": leaf.dtype, "bytes_per_stage": [0] * len(layers)})
    row["arrays"] += 1
    row["elements"] += math.prod(leaf.shape)
    for s in range(len(layers)):
      count = on_stage(leaf, s, layers)
      if count != 0:
        row["bytes_per_stage"][s] += leaf_bytes(leaf, sizes, count)
  rows = []
  for row in groups.values():
    per_stage = row.pop("bytes_per_stage")
    placement = "as the parameters" if row["slot"] != "count" else "replicated"
    rows.append({**row, "placement": placement, "bytes_per_device": max(per_stage)})
  return rows
