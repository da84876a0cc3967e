"""Pipeline parallelism over the `pipeline` mesh axis: a layer stack split into S stages, GPipe schedule.

Stage s holds layers [s·L/S, (s+1)·L/S) of a stack (its "layers" axis is sharded on `pipeline`). The batch is
split into M microbatches (rows m, m + M, m + 2M, … form microbatch m, so each keeps rows on every data shard).
At tick t = 0 … M + S − 2 every stage runs its layers on the activation it holds, stage s working on
microbatch t − s; then each stage passes its output to the next with `ppermute` (a collective-permute), and
stage 0 takes microbatch t + 1. The last stage's outputs are the stack's output. Ticks where t − s falls outside
[0, M) are the bubble: their results are discarded, and their MoE loads and balance terms masked out.

  bubble fraction = (S − 1) / (M + S − 1)   of every stage's ticks (forward and backward alike)

The schedule is one `lax.scan` over ticks inside a `jax.shard_map` that is manual over `pipeline` only, so the
other axes (data, fsdp, expert, tensor) keep their automatic sharding and the MoE's own shard_map nests inside.
Autodiff turns each forward ppermute into the reverse one, so the backward pass runs the same schedule in
reverse (all forwards, then all backwards: GPipe).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxseek.config import Config
from jaxseek.errors import UserError

AXIS = "pipeline"


def stages() -> int:
  """Size of the pipeline axis of the active mesh (1 without a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty or AXIS not in mesh.axis_names else mesh.shape[AXIS]


def bubble_fraction(num_stages: int, microbatches: int) -> float:
  return (num_stages - 1) / (microbatches + num_stages - 1)


def check_stacks(cfg: Config, stages: int) -> None:
  """Refuses a pipeline size that divides neither layer stack (nothing would be pipelined)."""
  m = cfg.model
  if stages > 1 and not any(n and n % stages == 0 for n in (m.num_dense_layers, m.num_moe_layers)):
    raise UserError(f"config key mesh.pipeline: {stages} divides neither layer stack ({m.num_dense_layers} dense, "
                    f"{m.num_moe_layers} MoE layers); choose a pipeline size that divides one of them")


def summary(cfg: Config, stages: int) -> str:
  """One line: the schedule, its bubble, and which layer stacks are pipelined."""
  m, micro = cfg.model, cfg.train.microbatches
  stacks = []
  for name, n in (("dense", m.num_dense_layers), ("MoE", m.num_moe_layers)):
    if n:
      stacks.append(f"{name} stack {n // stages} layers per stage" if n % stages == 0 else
                    f"{name} stack ({n} layers) on every stage")
  return (f"pipeline: {stages} stages x {micro} microbatches (GPipe), bubble (S-1)/(M+S-1) = "
          f"{100 * bubble_fraction(stages, micro):.1f}% | {', '.join(stacks)}; embedding, head and "
          f"MTP on every stage")


def split_microbatches(x: jax.Array, m: int) -> jax.Array:
  """[B, ...] → [M, B/M, ...], microbatch j = rows j, j + M, j + 2M, …"""
  return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def merge_microbatches(x: jax.Array) -> jax.Array:
  """Inverse of split_microbatches."""
  return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def run(body: Callable, layer_state, x_BTD: jax.Array, side: tuple, microbatches: int,
        per_row: tuple[str, ...] = ("balance",)):
  """Runs `body(x_bTD, layer_state_l, side) → (x_bTD, aux_l: dict)` over all layers as a pipeline.

  `layer_state` leaves are [L, ...] (sharded on `pipeline`); `side` holds per-row inputs [B, ...] (or None)
  that every layer reads. Returns (x_BTD, aux) as a scan over the layers would: aux entries named in `per_row`
  (per-sequence terms [L, b] per microbatch) are reassembled into [L, B]; the others (expert loads, dropped
  counts) are summed over the microbatches.
  """
  S, M = stages(), microbatches
  x_MbTD = split_microbatches(x_BTD, M)
  side_M = jax.tree.map(lambda a: split_microbatches(a, M), side)

  def per_stage(state_local, x_MbTD, side_M):
    s = jax.lax.axis_index(AXIS)

    def stage(x_bTD, side_b):
      return jax.lax.scan(lambda h, layer: body(h, layer, side_b), x_bTD, state_local)

    (_, aux_shape) = jax.eval_shape(stage, x_MbTD[0], jax.tree.map(lambda a: a[0], side_M))
    rows = {k: k in per_row for k in aux_shape}

    def tick(carry, t):
      held_bTD, out_MbTD, aux_acc = carry
      m = t - s  # the microbatch this stage works on at tick t
      valid = (m >= 0) & (m < M)
      mc = jnp.clip(m, 0, M - 1)
      x_bTD = jnp.where(s == 0, x_MbTD[jnp.clip(t, 0, M - 1)], held_bTD)
      y_bTD, aux = stage(x_bTD, jax.tree.map(lambda a: a[mc], side_M))
      out_MbTD = jnp.where((s == S - 1) & valid, out_MbTD.at[mc].set(y_bTD), out_MbTD)
      aux_acc = jax.tree.map(
          lambda acc, a, r: jnp.where(valid, acc.at[:, mc].set(a) if r else acc + a, acc),
          aux_acc, aux, rows)
      held_bTD = jax.lax.ppermute(y_bTD, AXIS, [(i, (i + 1) % S) for i in range(S)])
      return (held_bTD, out_MbTD, aux_acc), None

    aux_zero = jax.tree.map(
        lambda a, r: jnp.zeros((a.shape[0], M, *a.shape[1:]) if r else a.shape, a.dtype), aux_shape, rows)
    init = (jnp.zeros_like(x_MbTD[0]), jnp.zeros_like(x_MbTD), aux_zero)
    (_, out_MbTD, aux_acc), _ = jax.lax.scan(tick, init, jnp.arange(M + S - 1))
    # Only the last stage holds the outputs: share them (replicated over `pipeline` from here on).
    out_MbTD = jax.lax.psum(jnp.where(s == S - 1, out_MbTD, 0), AXIS)
    aux_acc = {k: merge_rows(a) if rows[k] else a for k, a in aux_acc.items()}
    return out_MbTD, aux_acc

  out_MbTD, aux = jax.shard_map(per_stage, in_specs=(P(AXIS), P(), P()), out_specs=(P(), P(AXIS)),
                                axis_names={AXIS}, check_vma=False)(layer_state, x_MbTD, side_M)
  return merge_microbatches(out_MbTD), aux


def merge_rows(a_lMb: jax.Array) -> jax.Array:
  """[l, M, b, ...] per-microbatch rows → [l, B] in the original row order."""
  return jax.vmap(merge_microbatches)(a_lMb)
