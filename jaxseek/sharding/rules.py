"""THE logical → mesh rules table, one for parameters and one for activations.

Model code names logical axes only (`("embed", "mlp")`); these tables decide which mesh axes shard them.
In the scaling-book notation the defaults are:

  parameters   W_q[D_fsdp, N_tensor, H], W_gate[D_fsdp, F_tensor], W_down[F_tensor, D_fsdp], E[V_tensor, D_fsdp]
  activations  x[B_(pipeline,data,fsdp,expert), T_context, D]
  with mesh.sequence_parallel: the residual stream x[B, T_(context,tensor), D] between the tensor-parallel
  regions (Megatron-style sequence parallelism: norms on 1/tensor of the tokens, all-reduces become
  reduce-scatter + all-gather)

FSDP (ZeRO-3) is "embed → fsdp" for parameters: XLA all-gathers each weight before use and reduce-scatters its
gradient (ZeRO-3). With train.zero=1 parameters stay whole on fsdp and only the optimiser state is split there
(ZeRO-1: XLA all-reduces the gradients and all-gathers the updated parameters). Every non-model axis splits the
batch. The pipeline axis splits it too wherever no pipeline schedule
runs (embedding, head and loss, layer stacks that are not pipelined): there the stages work as data-parallel
replicas instead of repeating the same work. Inside the schedule's shard_map `pipeline` is a manual axis, and
the activation rules leave manual axes out.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

Rules = dict[str, tuple[str, ...]]
PIPELINE_AXIS = "pipeline"  # the mesh axis pipeline parallelism runs over (jaxseek/pipeline/)

PARAM_RULES: Rules = {
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "expert_mlp": ("tensor",),
    "experts": ("expert",),
    "stages": ("pipeline",),
}

# ZeRO-1 (train.zero=1): parameters and gradients replicated over fsdp, only the optimiser state sharded on it
ZERO1_PARAM_RULES: Rules = {**PARAM_RULES, "embed": ()}


def state_rules(kind: str, zero: int) -> Rules:
  """The parameter rules for one part of the train state: "params" / "biases" or "opt_state" (with the routed
  experts over expert × tensor inside `layout` of model.moe_tensor=experts)."""
  base = ZERO1_PARAM_RULES if zero == 1 and kind != "opt_state" else PARAM_RULES
  if not _EXPERTS_ON_TENSOR.get():
    return base
  return {**base, **{k: EXPERTS_ON_TENSOR[k] for k in ("experts", "expert_mlp")}}


ACTIVATION_RULES: Rules = {
    "batch": ("pipeline", "data", "fsdp", "expert"),
    "length": ("context",),
    "residual_length": ("context",),  # the residual stream's tokens (sequence parallelism: and tensor)
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "expert_mlp": ("tensor",),
    "experts": ("expert",),
    "expert_length": ("context",),  # the tokens' length where the routed experts take them (sharding/experts.py)
    "data_shards": ("data",),  # the leading axis of per-data-shard values (compressed gradient sums)
}

# model.moe_tensor=experts: the tensor ranks hold other experts, whole, and take their share of the tokens' length
EXPERTS_ON_TENSOR: Rules = {"experts": ("expert", "tensor"), "expert_mlp": (), "expert_length": ("context", "tensor")}

# Every logical name the model may use; those absent from a table are replicated.
LOGICAL_AXES = frozenset(
    {"batch", "length", "residual_length", "expert_length", "embed", "vocab", "heads", "kv_heads", "head_dim",
     "q_lora", "kv_lora", "mlp", "expert_mlp", "experts", "layers", "stages", "data_shards"})


def spec(names: tuple[str | None, ...], rules: Rules) -> PartitionSpec:
  """PartitionSpec for logical `names`; a mesh axis already used by an earlier dimension is not reused."""
  used: set[str] = set()
  out = []
  for name in names:
    if name is not None and name not in LOGICAL_AXES:
      raise ValueError(f"unknown logical axis {name!r}; known: {sorted(LOGICAL_AXES)}")
    axes = tuple(a for a in rules.get(name, ()) if a not in used) if name else ()
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*out)


_SEQUENCE_PARALLEL: contextvars.ContextVar[bool] = contextvars.ContextVar("sequence_parallel", default=False)
_EXPERTS_ON_TENSOR: contextvars.ContextVar[bool] = contextvars.ContextVar("experts_on_tensor", default=False)


@contextlib.contextmanager
def layout(cfg):
  """While tracing inside (and building the state's shardings), the rules of `cfg`'s layout: the residual stream
  split on its length over tensor too (mesh.sequence_parallel), the routed experts over expert × tensor
  (model.moe_tensor=experts)."""
  token = _EXPERTS_ON_TENSOR.set(cfg.model.is_moe and cfg.model.moe_tensor == "experts")
  try:
    with sequence_parallel(cfg.mesh.sequence_parallel):
      yield
  finally:
    _EXPERTS_ON_TENSOR.reset(token)


@contextlib.contextmanager
def sequence_parallel(on: bool):
  """While tracing inside, the residual stream is split on its length over `tensor` too (mesh.sequence_parallel)."""
  token = _SEQUENCE_PARALLEL.set(on)
  try:
    yield
  finally:
    _SEQUENCE_PARALLEL.reset(token)


def activation_rules() -> Rules:
  """The activation table in force: ACTIVATION_RULES, with "residual_length" also on tensor under sequence
  parallelism, and EXPERTS_ON_TENSOR's entries under model.moe_tensor=experts (`layout`)."""
  out = ACTIVATION_RULES
  if _SEQUENCE_PARALLEL.get():
    out = {**out, "residual_length": ("context", "tensor")}
  if _EXPERTS_ON_TENSOR.get():
    out = {**out, **EXPERTS_ON_TENSOR}
  return out


_RESERVED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("reserved_axes", default=frozenset())


@contextlib.contextmanager
def reserved(*axes: str):
  """While tracing inside, activation rules leave `axes` out (an enclosing vmap with spmd_axis_name holds them)."""
  token = _RESERVED.set(_RESERVED.get() | frozenset(axes))
  try:
    yield
  finally:
    _RESERVED.reset(token)


def reserved_axes() -> frozenset[str]:
  """The axes `reserved` holds while tracing (none outside)."""
  return _RESERVED.get()


def _manual_axes() -> frozenset[str]:
  """Mesh axes the enclosing shard_map handles by hand or an enclosing vmap holds (none outside)."""
  mesh = jax.sharding.get_abstract_mesh()
  return _RESERVED.get() | (frozenset() if mesh.empty else frozenset(mesh.manual_axes))


def _automatic(rules: Rules) -> Rules:
  manual = _manual_axes()
  return {k: tuple(a for a in v if a not in manual) for k, v in rules.items()} if manual else rules


def activation_spec(names: tuple[str | None, ...]) -> PartitionSpec:
  return spec(names, _automatic(activation_rules()))


def param_spec(names: tuple[str | None, ...], shape: tuple[int, ...] | None = None,
               mesh: jax.sharding.Mesh | None = None, rules: Rules | None = None) -> PartitionSpec:
  """A parameter's PartitionSpec. With a pipeline axis > 1 in `mesh`, a layer stack whose layer count it
  divides is split into stages along it (jaxseek.pipeline runs those stacks as a pipeline); every
  other parameter (embedding, head, final norm, a stack that is not pipelined, MTP) is split over the stages
  on its model dimension ("embed", after fsdp) where that divides: stored, with its gradient and optimiser
  state, 1/S on each stage instead of whole on every one, and gathered over `pipeline` once per step where the
  schedule starts (ZeRO-3 over the stages; its gradient is reduce-scattered there once per step). `rules`: the
  parameter rules in force (`state_rules("params", 3)`) by default."""
  out = spec(names, state_rules("params", 3) if rules is None else rules)
  stages = mesh.shape.get("pipeline", 1) if mesh is not None else 1
  if stages > 1 and names and names[0] == "layers" and shape is not None and shape[0] % stages == 0:
    out = PartitionSpec("pipeline", *out[1:])
  elif stages > 1 and shape is not None:
    out = _over_stages(out, names, shape, mesh)
  return out


def _over_stages(out: PartitionSpec, names: tuple[str | None, ...], shape: tuple[int, ...],
                 mesh: jax.sharding.Mesh) -> PartitionSpec:
  """`out` with one dimension also split over `pipeline`: the model dimension ("embed", after fsdp) where its
  size allows, else the first other unsplit one that divides (the MLA up-projections' latent rank)."""
  entries = list(out) + [None] * (len(shape) - len(out))
  axes = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)
  split = lambda i: mesh.shape["pipeline"] * math.prod(mesh.shape[a] for a in axes(entries[i]))
  order = [names.index("embed")] if "embed" in names else []
  order += [i for i, n in enumerate(names) if n not in ("layers", "embed") and entries[i] is None]
  for i in order:
    if shape[i] % split(i) == 0:
      entries[i] = (*axes(entries[i]), "pipeline")
      return PartitionSpec(*entries)
  return out


def mesh_axes(name: str, rules: Rules | None = None) -> tuple[str, ...]:
  """The mesh axes a logical activation axis is split over (for collectives inside shard_map), by the table in
  force (`activation_rules`) unless `rules` is given."""
  return _automatic(activation_rules() if rules is None else rules).get(name, ())


def split_axes(name: str) -> tuple[str, ...]:
  """The mesh axes a logical activation axis is split over, those an enclosing shard_map already handles by hand
  included (a collective inside may name them; `mesh_axes` leaves them out, for specs): the enclosing vmap's
  axes stay out."""
  return tuple(a for a in activation_rules().get(name, ()) if a not in _RESERVED.get())


def has_mesh() -> bool:
  return not jax.sharding.get_abstract_mesh().empty


def shard(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
  """Constrains an activation's sharding by logical names; a no-op when no mesh is set."""
  if not has_mesh():
    return x
  return jax.lax.with_sharding_constraint(x, activation_spec(names))


def is_variable(x) -> bool:
  """An nnx Variable: the leaf of state trees (`is_leaf` for jax.tree.map)."""
  return isinstance(x, nnx.Variable)


def logical_axes(state) -> object:
  """The tree of logical-axis tuples of an nnx State (leaves: tuples)."""
  return jax.tree.map(lambda v: v.get_metadata()["logical_axes"], state, is_leaf=is_variable)


def param_shardings(state, mesh: jax.sharding.Mesh, rules: Rules | None = None):
  """NamedShardings for every Variable of an (abstract) nnx State, from its logical axes (by default the
  parameter rules in force, split over the pipeline stages as `param_spec` does)."""
  if rules is None:
    make = lambda v: param_spec(v.get_metadata()["logical_axes"], v.shape, mesh)
  else:
    make = lambda v: spec(v.get_metadata()["logical_axes"], rules)
  return jax.tree.map(lambda v: NamedSharding(mesh, make(v)), state, is_leaf=is_variable)
