"""Gradients summed over the batch axes once per step, after the microbatches, not once per microbatch.

Left to itself XLA all-reduces the gradient of every weight replicated over a batch axis inside the microbatch
loop (a `lax.scan` carry, or the pipeline schedule's ticks): M reductions per step where one is enough. Here
the whole gradient computation runs in a `shard_map` manual over the axes below: each device group computes
and accumulates the gradients of its own rows unreduced, and one `psum` after the loop sums them, as PyTorch
DDP's `no_sync`, Megatron's distributed optimizer and DeepSpeed do at the accumulation boundary.

  data   always (when > 1): no parameter is split there
  expert always (when > 1): the expert weights enter as their block (their gradients are summed over data
         only); the MoE dispatch's collectives name the enclosing manual axis (rules.split_axes)
  fsdp   with train.zero=1 only (parameters whole on fsdp; the optimiser state's fsdp split takes its slice of
         the sum). Under ZeRO-3 (train.zero=3) parameters are split on fsdp and gathered per layer, so their
         gradients are reduce-scattered per microbatch: that is inherent to ZeRO-3 and stays.

Other axes keep XLA's per-microbatch reduction: context (ring attention is a shard_map over it), tensor (splits
weights, not the batch). With train.grad_compression the
data-axis sum is already once per step (a vmap over the data shards, sharding/compression.py).

The objective's normalisers (token counts, the balance divisor) come from the whole batch, so the sum of the
groups' gradients is the full batch's gradient exactly (up to float reassociation).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from jaxseek import config as config_lib


def axes(cfg: config_lib.Config, sizes: dict[str, int]) -> tuple[str, ...]:
  """The batch axes whose gradient sum runs once per step, in mesh order."""
  if cfg.train.grad_compression != "none" and sizes.get("data", 1) > 1:
    return ()  # the compressed exchange sums over data once per step itself (expert then sums per microbatch)
  out = []
  if sizes.get("data", 1) > 1:
    out.append("data")
  if cfg.train.zero == 1 and sizes.get("fsdp", 1) > 1:
    out.append("fsdp")
  if sizes.get("expert", 1) > 1:
    out.append("expert")
  return tuple(out)


def summary(cfg: config_lib.Config, sizes: dict[str, int]) -> str:
  """One start-up line: where the gradient sums over the batch axes run."""
  summed = axes(cfg, sizes)
  parts = [f"{'×'.join(f'{a}={sizes[a]}' for a in summed)} summed once per step"] if summed else []
  if cfg.train.grad_compression != "none" and sizes.get("data", 1) > 1:
    parts.append(f"data={sizes['data']} summed once per step compressed ({cfg.train.grad_compression})")
  if sizes.get("fsdp", 1) > 1 and "fsdp" not in summed:
    parts.append(f"fsdp={sizes['fsdp']} reduce-scattered per microbatch (ZeRO-3)")
  per_micro = [f"{a}={sizes[a]}" for a in ("expert", "context") if sizes.get(a, 1) > 1 and a not in summed]
  if per_micro:
    parts.append(f"{', '.join(per_micro)} all-reduced per microbatch for the weights replicated there")
  return "gradients: " + ("; ".join(parts) if parts else "one device group, nothing to sum")


def groups(sizes: dict[str, int], summed: tuple[str, ...]) -> int:
  """Device groups whose gradients are summed: the product of the `summed` axes' sizes."""
  return math.prod(sizes[a] for a in summed)


def once_per_step(gradients: Callable, summed: tuple[str, ...], param_specs=None) -> Callable:
  """gradients(params, batch) → (grads, ce_sum, mtp_sums, balance, loads), run on each group's rows of `batch`
  (split on its first axis over `summed`) and summed over the groups once: grads, losses and loads added,
  the balance term (a mean over rows) averaged. `param_specs` (PartitionSpecs of the parameters; None: all
  replicated on `summed`): a parameter split over one of the `summed` axes (expert weights on `expert`) enters
  as its local block and its gradient is summed over the other axes only."""
  if not summed:
    return gradients
  local_specs = P() if param_specs is None else jax.tree.map(lambda s: restricted(s, summed), param_specs,
                                                               is_leaf=lambda x: isinstance(x, P))

  def local(params, batch):
    grads, ce_sum, mtp_sums, balance, loads = gradients(params, batch)
    if param_specs is None:
      grads = jax.lax.psum(grads, summed)
    else:
      grads = jax.tree.map(lambda s, g: _psum(g, tuple(a for a in summed if a not in _named(s))), local_specs,
                           grads, is_leaf=lambda x: isinstance(x, P))
    ce_sum, mtp_sums, balance, loads = jax.lax.psum((ce_sum, mtp_sums, balance, loads), summed)
    n = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in summed)
    return grads, ce_sum, mtp_sums, balance / n, loads

  def run(params, batch):
    return jax.shard_map(local, in_specs=(local_specs, P(summed)), out_specs=(local_specs, P(), P(), P(), P()),
                         axis_names=set(summed), check_vma=False)(params, batch)

  return run


def restricted(spec: P, kept: tuple[str, ...]) -> P:
  """`spec` naming only the mesh axes in `kept` (the manual axes of a partial shard_map)."""
  def entry(e):
    axes = tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if a in kept)
    return None if not axes else axes[0] if len(axes) == 1 else axes
  return P(*(entry(e) for e in spec))


def _named(spec: P) -> set[str]:
  return {a for e in spec if e for a in ((e,) if isinstance(e, str) else e)}


def _psum(x, axes: tuple[str, ...]):
  return jax.lax.psum(x, axes) if axes else x
