"""Gradient compression over the `data` axis (`train.grad_compression`), with error feedback.

Without it, XLA sums the gradients over `data` with a float32 all-reduce: 2(n − 1)/n · 4 bytes per element on n
shards. With it, the step computes one gradient per data shard (a `vmap` over the shards, `spmd_axis_name="data"`:
[data, ...] arrays, one row per device group), and the sum over shards is done here on a compressed copy of
v = g + e, where e, the error-feedback residual, is what compression dropped on that shard before; it is added
back next step, so nothing is lost over time, only delayed (Seide et al. 2014; Karimireddy et al. 2019). e lives
in the train state ([data, ...] beside the parameters, float32) and in checkpoints.

bf16, int8 — two phases, each device's own block of each gradient (its fsdp / tensor / expert placement kept),
in a shard_map manual over every axis so the wire carries exactly the compressed bits:

  1. reduce-scatter as an all-to-all: the block is cut into n chunks; chunk j goes to device j compressed
     (bfloat16 bits, or int8 with one float32 scale per BLOCK = 256 values: max |x| / 127), and device j sums
     the n copies of its chunk in float32 (its own copy exact: it never travels);
  2. all-gather of each device's summed chunk, compressed again.

  Bytes each device sends: 2 (n − 1)/n per element for int8 (+ 4/256 for the scales), 4 (n − 1)/n for bf16, at
  any n: 0.25× (0.5×) the float32 all-reduce. What phase 1 dropped stays in the sender's residual; what phase 2
  dropped stays in the residual of the chunk's owner, on its own chunk, which phase 1 carries exactly next step.
  Leaves smaller than 4 · n · BLOCK values per device (norm scales: < 0.1% of the bytes) are summed in
  float32.

powersgd — Vogels et al., NeurIPS 2019, rank r = `train.powersgd_rank`, on every weight matrix: the leading
stacked axes (layers, experts) are a batch (one matrix per layer and per expert), the other axes split into
rows × columns where the matrix is nearest to square. With M = g + e on each shard and Q the last step's basis:

  Q ← orthonormal(Q);  P = Σ_shards M·Q (all-reduce);  P ← orthonormal(P);  Q_s = Mᵀ·P;  Q = Σ_shards Q_s
  (all-reduce);  sum = P·Qᵀ;  e ← M − P·Q_sᵀ (each shard's own part);  Q is kept for the next step (warm start).

  Orthonormalising Q first (a QR of [n, r], no communication) keeps the power step exact at full rank even when a
  gradient of lower rank left Q degenerate. Bytes: 2(n − 1)/n · 4 · r(rows + columns) per matrix, of which each
  device sends its share: P and Q go over `data` split over the mesh axes that split the matrix. The embedding
  and the output head (indexed by the vocabulary: full-rank gradients) go int8 in the two phases above, with
  their own error feedback; so do matrices whose factors, r(rows + columns) values, would be more than half their
  own (MIN_RATE, as PyTorch's PowerSGD hook); leaves too small for the two phases are summed in float32.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "data"
METHODS = ("none", "bf16", "int8", "powersgd")
BLOCK = 256  # int8: values per float32 scale
BATCH_AXES = ("layers", "experts")  # powersgd: leading logical axes that index separate matrices
FULL_RANK_AXES = ("vocab",)  # powersgd: the embedding and the output head, whose gradients are of full rank, go int8
HIGHEST = jax.lax.Precision.HIGHEST  # float32 products (no TF32 on GPUs)


class State(NamedTuple):
  """What a compression method carries from one step to the next (TrainState.grad_residual, .grad_basis): the
  error-feedback residual of every parameter ([shards, ...] float32) and, for powersgd, the basis of each
  compressed matrix (`init_basis`; {} for bf16 and int8, which have none)."""

  residual: Any
  basis: dict


def reduce(grads_S: Any, state: State, method: str, specs: Any, *, views: dict | None = None,
           uncompressed: jax.Array | None = None) -> tuple[Any, State]:
  """(Σ over shards of the compressed `grads_S` + `state.residual`, the new State); leaves [shards, ...] float32
  split over `data` along the first axis, placed as `specs` (PartitionSpecs of the residual: data, then the
  parameter's own), which the sum keeps without the first axis. `views` (powersgd): `matrix_views`;
  `uncompressed` (powersgd, a traced bool): sum the matrices in float32 this step instead, bases kept
  (train.powersgd_start_step)."""
  pairs, treedef = jax.tree_util.tree_flatten_with_path(grads_S)
  keys, leaves = [_key(p) for p, _ in pairs], [g for _, g in pairs]
  specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))  # in the order of the leaves
  v = [g + e for g, e in zip(leaves, treedef.flatten_up_to(state.residual))]
  if method == "powersgd":
    out, basis = _powersgd_all(v, keys, specs, _flat(state.basis), views, uncompressed)
  elif method in ("bf16", "int8"):
    out, basis = [_two_phase(x, spec, method) for x, spec in zip(v, specs)], state.basis
  else:
    raise ValueError(f"unknown gradient compression {method!r}; known: {METHODS}")
  return treedef.unflatten([o[0] for o in out]), State(treedef.unflatten([o[1] for o in out]), basis)


# --- bf16, int8: two-phase exchange --------------------------------------------------------------------------

def _unit(method: str, shards: int) -> int:
  """Elements a device's block is padded to a multiple of: n chunks of whole scale blocks."""
  return shards * (BLOCK if method == "int8" else 1)


def two_phase_leaf(local_elements: int, shards: int, method: str) -> bool:
  """Whether a leaf of `local_elements` per device goes the two-phase way: at least 4 chunks of BLOCK values per
  device (else a float32 sum: a norm scale is not worth two collectives of its own)."""
  return shards > 1 and local_elements >= 4 * shards * BLOCK


def _pack(x: jax.Array, method: str) -> jax.Array:
  """x [..., C] float32 → what travels (bfloat16 bits as uint16; int8 blocks each followed by its scale's 4
  bytes, [..., C/BLOCK, BLOCK + 4])."""
  if method == "bf16":  # as uint16: XLA would otherwise widen a bfloat16 collective to float32 before sending
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
  blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
  scale = jnp.abs(blocks).max(-1, keepdims=True) / 127.0
  scale = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(jnp.round(blocks / scale), -127, 127).astype(jnp.int8)
  return jnp.concatenate([q, jax.lax.bitcast_convert_type(scale, jnp.int8).reshape(*q.shape[:-1], 4)], -1)


def _unpack(wire: jax.Array, method: str) -> jax.Array:
  """The float32 values `_pack` sent, [..., C]."""
  if method == "bf16":
    return jax.lax.bitcast_convert_type(wire, jnp.bfloat16).astype(jnp.float32)
  scale = jax.lax.bitcast_convert_type(wire[..., BLOCK:], jnp.float32)
  values = wire[..., :BLOCK].astype(jnp.float32) * scale[..., None]
  return values.reshape(*values.shape[:-2], -1)


def _two_phase(v_S: jax.Array, spec: P, method: str) -> tuple[jax.Array, jax.Array]:
  shards = v_S.shape[0]
  local = math.prod(NamedSharding(jax.sharding.get_abstract_mesh(), spec).shard_shape(v_S.shape)[1:])
  if not two_phase_leaf(local, shards, method):
    return _plain(v_S, spec)

  def on_device(a):
    v = a[0]
    flat = v.reshape(-1)
    padded = -(-flat.size // _unit(method, shards)) * _unit(method, shards)
    chunks = jnp.pad(flat, (0, padded - flat.size)).reshape(shards, padded // shards)  # chunk j → device j
    me = jax.lax.axis_index(AXIS)
    mine = jnp.arange(shards)[:, None] == me
    sent = _pack(chunks, method)
    # phase 1: row i of what arrives is device i's copy of my chunk; my own copy never leaves, so it stays exact
    arrived = _unpack(jax.lax.all_to_all(sent, AXIS, 0, 0, tiled=True), method)
    own = jax.lax.dynamic_index_in_dim(chunks, me, 0, keepdims=False)
    total = jnp.where(mine, own, arrived).sum(0)
    # phase 2: every device's summed chunk, compressed, to every device
    total_wire = _pack(total, method)
    summed = _unpack(jax.lax.all_gather(total_wire, AXIS), method).reshape(-1)[:flat.size]
    # residual: what phase 1 dropped of the chunks I sent; on my own chunk, what phase 2 dropped of its sum
    dropped = jnp.where(mine, (total - _unpack(total_wire, method))[None], chunks - _unpack(sent, method))
    return summed.reshape(v.shape), dropped.reshape(-1)[:flat.size].reshape(a.shape)

  return jax.shard_map(on_device, in_specs=spec, out_specs=(P(*spec[1:]), spec), check_vma=False)(v_S)


def _plain(v_S: jax.Array, spec: P) -> tuple[jax.Array, jax.Array]:
  """The float32 sum over shards (an all-reduce on `data`); nothing is dropped."""
  summed = jax.shard_map(lambda a: jax.lax.psum(a[0], AXIS), in_specs=spec, out_specs=P(*spec[1:]),
                         check_vma=False)(v_S)
  return summed, jnp.zeros_like(v_S)


# --- PowerSGD ------------------------------------------------------------------------------------------------

def matrix_view(shape: tuple[int, ...], logical_axes: tuple) -> tuple[int, int, int] | None:
  """(batch axes, rows, columns) PowerSGD sees a parameter of `shape` as: its leading stacked axes (layers,
  experts) index separate matrices; the other axes split where rows × columns is nearest to square. None for
  vectors."""
  b = 0
  while b < len(shape) and logical_axes[b] in BATCH_AXES:
    b += 1
  rest = shape[b:]
  if len(rest) < 2:
    return None
  cut = min(range(1, len(rest)), key=lambda k: abs(math.log(math.prod(rest[:k]) / math.prod(rest[k:]))))
  return b, math.prod(rest[:cut]), math.prod(rest[cut:])


MIN_RATE = 2  # powersgd: a matrix goes low-rank only when that sends at most half its values


def compressed_view(view: tuple[int, int, int] | None, rank: int) -> bool:
  """Whether a matrix goes low-rank: its rank-r factors, r(rows + columns) values, at most 1/MIN_RATE of its own
  (a router of 8 experts is not worth it at rank 4: whole, it trains as the uncompressed model does)."""
  return view is not None and MIN_RATE * rank * (view[1] + view[2]) <= view[1] * view[2]


def low_rank_leaf(shape: tuple[int, ...], logical_axes: tuple, rank: int) -> bool:
  """Whether PowerSGD sends a parameter as low-rank factors: a matrix that saves (`compressed_view`) and is not
  indexed by the vocabulary (a batch of tokens touches most rows of the embedding and every column of the head:
  full-rank gradients that rank r approximates badly; those go int8)."""
  return compressed_view(matrix_view(shape, logical_axes), rank) and not set(logical_axes) & set(FULL_RANK_AXES)


def matrix_views(abstract_params: Any, rank: int) -> dict[str, tuple[int, int, int]]:
  """{parameter path: its `matrix_view`} of the parameters PowerSGD compresses at `rank`."""
  from jaxseek.sharding import rules

  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(abstract_params, is_leaf=rules.is_variable):
    shape, axes = tuple(x.shape), tuple(x.get_metadata()["logical_axes"])
    if low_rank_leaf(shape, axes, rank):
      out[_key(path)] = matrix_view(shape, axes)
  return out


def init_basis(params: Any, rank: int, seed: int) -> dict:
  """The starting basis Q [*stack, columns, r] (standard normal) of each matrix PowerSGD compresses, as a nested
  dict named like the parameters."""
  from jaxseek.sharding import rules

  views = matrix_views(params, rank)
  out = {}
  for i, (path, x) in enumerate(jax.tree_util.tree_leaves_with_path(params, is_leaf=rules.is_variable)):
    if (key := _key(path)) in views:
      b, _, n = views[key]
      out[key] = jax.random.normal(jax.random.fold_in(jax.random.key(seed), i), (*x.shape[:b], n, rank))
  return _nest(out)


def basis_specs(abstract_params: Any, param_specs: Any, rank: int) -> dict:
  """PartitionSpecs of `init_basis`'s arrays: split on the stacked axes as the parameter is, whole otherwise."""
  from jaxseek.sharding import rules

  views = matrix_views(abstract_params, rank)
  specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P))
  paths = [_key(p) for p, _ in jax.tree_util.tree_leaves_with_path(abstract_params, is_leaf=rules.is_variable)]
  return _nest({key: P(*(tuple(spec) + (None,) * views[key][0])[:views[key][0]], None, None)
                for key, spec in zip(paths, specs) if key in views})


def orthonormal(x: jax.Array) -> jax.Array:
  """An orthonormal basis [..., m, r] of the columns of x (Householder QR: orthonormal even when x is not of
  full rank)."""
  return jnp.linalg.qr(x, mode="reduced")[0]


def powersgd_matrix(M_S: jax.Array, Q: jax.Array, factor_specs: tuple[P, P] | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One PowerSGD step on M_S [shards, *stack, m, n] with the basis Q [*stack, n, r]: (Σ_shards M ≈ P·Qᵀ,
  each shard's dropped part M − P·Q_sᵀ, the new basis). `factor_specs` (under a mesh): where the shards' P
  [shards, *stack, m, r] and Q [shards, *stack, n, r] are summed over them (`_factor_specs`)."""
  p_spec, q_spec = factor_specs or (None, None)
  Q = orthonormal(Q)
  # each shard's product, then the sum over shards (an all-reduce of P): einsum would sum M over the shards first
  P_ = orthonormal(_summed(jnp.einsum("s...mn,...nr->s...mr", M_S, Q, precision=HIGHEST), p_spec))
  Q_S = _placed(jnp.einsum("s...mn,...mr->s...nr", M_S, P_, precision=HIGHEST), q_spec)
  Q_new = _summed(Q_S, q_spec)  # an all-reduce
  summed = jnp.einsum("...mr,...nr->...mn", P_, Q_new, precision=HIGHEST)
  dropped = M_S - jnp.einsum("...mr,s...nr->s...mn", P_, Q_S, precision=HIGHEST)
  return summed, dropped, Q_new


def _powersgd_all(v: list, keys: list[str], specs: list, basis: dict, views: dict,
                  uncompressed: jax.Array | None) -> tuple[list, dict]:
  """[(sum, dropped)] of every leaf and the new bases (nested): the matrices of `views` low-rank, the rest as
  int8 in two phases (or float32 when small); or, while `uncompressed`, every leaf in float32, bases kept."""

  def low_rank(vs):
    out, new = [], {}
    for k, x, spec in zip(keys, vs, specs):
      if k in views:
        summed, dropped, new[k] = _powersgd(x, basis[k], views[k], spec)
        out.append((summed, dropped))
      else:
        out.append(_two_phase(x, spec, "int8"))
    return out, new

  def whole(vs):
    return [_plain(x, spec) for x, spec in zip(vs, specs)], {k: basis[k] for k in keys if k in views}

  out, new = low_rank(v) if uncompressed is None else jax.lax.cond(uncompressed, whole, low_rank, v)
  return out, _nest(new)


def _powersgd(v_S: jax.Array, Q: jax.Array, view: tuple[int, int, int], spec: P):
  b, m, n = view
  shape = v_S.shape
  summed, dropped, Q_new = powersgd_matrix(v_S.reshape(*shape[:1 + b], m, n), Q, _factor_specs(shape, view, spec))
  summed = jax.lax.with_sharding_constraint(summed.reshape(shape[1:]), P(*spec[1:]))
  dropped = jax.lax.with_sharding_constraint(dropped.reshape(shape), spec)
  return summed, dropped, Q_new


def _factor_specs(shape: tuple[int, ...], view: tuple[int, int, int], spec: P) -> tuple[P, P]:
  """Where the shards' factors P [shards, *stack, m, r] and Q [shards, *stack, n, r] of a residual of `shape`
  placed as `spec` are summed over `data`: the stacked axes split as the parameter's, the rows of P (of Q) over
  every mesh axis that splits the parameter's matrix, those of its rows (columns) first, so that each device
  sends r(m + n) / (m · n) of its own values (`step_bytes`). Left to XLA, P went split as the matrix's rows are
  and Q as its columns: 1.36× those bytes on data 2 × fsdp 2 × tensor 2. A factor whose length those axes do
  not divide is summed whole."""
  b, m, n = view
  full = (*spec, *(None,) * (len(shape) - len(spec)))
  mesh_axes = lambda entries: tuple(a for e in entries for a in ((e,) if isinstance(e, str) else e or ()))
  rest = full[1 + b:]
  cut = next(k for k in range(len(rest) + 1) if math.prod(shape[1 + b:1 + b + k]) == m)
  rows, cols = mesh_axes(rest[:cut]), mesh_axes(rest[cut:])
  size = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in rows + cols)
  split = lambda length, axes: P(full[0], *full[1:1 + b], axes or None if length % size == 0 else None, None)
  return split(m, rows + cols), split(n, cols + rows)


def _placed(x: jax.Array, spec: P | None) -> jax.Array:
  return x if spec is None else jax.lax.with_sharding_constraint(x, spec)


def _summed(x_S: jax.Array, spec: P | None) -> jax.Array:
  """Σ over the first axis of x_S [shards, *stack, length, r]: the terms and the sum placed by `spec` (None: by
  XLA), then the sum gathered whole on every device (each data shard's devices among themselves: left to XLA,
  they took parts from other data shards' devices, which hold the same sum)."""
  if spec is None:
    return x_S.sum(0)
  summed = _placed(_placed(x_S, spec).sum(0), P(*spec[1:]))
  return _placed(summed, P(*spec[1:-2], None, None))


# --- bytes ---------------------------------------------------------------------------------------------------

def wire_bytes(elements: float, shards: int, method: str, itemsize: int = 4) -> float:
  """Bytes one device sends for the data-axis sum of `elements` values of a leaf that `method` compresses
  elementwise (ring algorithms): none 2(n − 1)/n · itemsize, the two-phase bf16 and int8 2(n − 1)/n · 2 and
  · (1 + 4/BLOCK)."""
  if shards <= 1:
    return 0.0
  per = {"bf16": 2.0, "int8": 1.0 + 4.0 / BLOCK}.get(method, float(itemsize))
  return 2 * (shards - 1) / shards * elements * per


def step_bytes(leaves: list[tuple[tuple[int, ...], tuple, int]], shards: int, method: str, rank: int = 4,
               itemsize: int = 4) -> float:
  """Bytes one device sends per step for the data-axis gradient sum; `leaves`: (global shape, logical axes,
  elements on one device) of every parameter. The two phases send each device's block padded to whole chunks
  (`_unit`); PowerSGD's factors go split over the mesh axes that split their matrix (`_factor_specs`: exact
  where those axes divide the factors' lengths)."""
  total = 0.0
  for shape, axes, local in leaves:
    if method in ("bf16", "int8"):
      total += _two_phase_bytes(local, shards, method)
    elif method == "powersgd" and low_rank_leaf(shape, axes, rank):
      b, m, n = matrix_view(shape, axes)
      total += wire_bytes(local / (m * n) * rank * (m + n), shards, "none")  # P and Q, float32
    elif method == "powersgd":  # the rest as int8
      total += _two_phase_bytes(local, shards, "int8")
    else:
      total += wire_bytes(local, shards, "none", itemsize if method == "none" else 4)
  return total


def _two_phase_bytes(local: int, shards: int, method: str) -> float:
  """`wire_bytes` of a leaf of `local` elements per device summed by `method` in two phases (padded to whole
  chunks), or in float32 when too small for them."""
  if not two_phase_leaf(local, shards, method):
    return wire_bytes(local, shards, "none")
  return wire_bytes(-(-local // _unit(method, shards)) * _unit(method, shards), shards, method)


# --- basis trees: nested dicts named like the parameters -------------------------------------------------------

def _key(path) -> str:
  """A parameter's name from its tree path (dict keys; a Variable's own `.value` is not part of it)."""
  return "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in (tree or {}).items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _nest(flat: dict) -> dict:
  out: dict = {}
  for key, v in flat.items():
    *head, last = key.split("/")
    node = out
    for k in head:
      node = node.setdefault(k, {})
    node[last] = v
  return out
