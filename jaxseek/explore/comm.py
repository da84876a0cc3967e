"""Communication per step: the collectives each mesh axis implies, bytes per device, and time on the links.

Per device and step, with m microbatches, passes = 2 (forward, backward) or 3 (remat recomputes the forward),
n = the axis size, and ring algorithms (an all-gather or reduce-scatter moves (n−1)/n of the whole, an
all-reduce twice that):

  fsdp      all-gather of every fsdp-split weight, once per pass and microbatch (compute dtype);
            reduce-scatter of their gradients per microbatch (parameter dtype). With train.zero=1 no weight is
            split: their gradients are all-reduced, and the updated weights all-gathered once per step
  data, expert, context, fsdp
            all-reduce of the gradients of weights replicated on the axis (every batch axis splits the batch)
  tensor    all-reduce of x[B, T, D] partial sums: 2 per layer and pass (attention out, MLP / MoE out), plus the
            embedding lookup and the head's input gradient
  expert    all-to-all of the MoE dispatch buffers [P·C, D]: out and back, per MoE layer and pass
  context   all-gather of the keys and values per layer and pass (their gradients reduce-scattered)
  pipeline  collective-permute of a microbatch's x[B/M, T, D] to the next stage and of its gradient back, per
            tick of each pipelined stack (ticks = R·M + S − 1); entering the schedule x[B, T, D] is gathered over
            the stages and leaving it the last stage's output is shared (an all-reduce), and the reverse for
            the gradients

An axis's links are intra-node when the devices of one group (the axis and every axis inside it) fit in a node.
Step time = compute + Σ collectives, assuming no overlap (a pessimistic bound; XLA overlaps some of it), where
compute = FLOPs / peak, the pipelined stacks' share stretched by the bubble: ticks / (R·M).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxseek.config import MESH_AXES
from jaxseek.explore import layout as ex
from jaxseek.explore import memory as em
from jaxseek.sharding import compression

BATCH_AXES = ("data", "fsdp", "expert", "context")


@dataclasses.dataclass(frozen=True)
class Hardware:
  """The device and its links: memory in bytes, dense bf16 peak in TFLOP/s, bandwidths in GB/s per direction."""

  name: str
  memory_bytes: int
  peak_tflops: float
  intra_node_gbps: float = 3600.0  # gigabits/s: NVLink 4, 450 GB/s per direction
  inter_node_gbps: float = 400.0  # gigabits/s: one 400G InfiniBand NDR port per GPU
  devices_per_node: int = 8
  usable_fraction: float = 0.9  # of memory_bytes, leaving room for XLA's workspace and fragmentation

  def link(self, axis: str, sizes: dict[str, int]) -> str:
    inner = math.prod(sizes[a] for a in MESH_AXES[MESH_AXES.index(axis):])
    return "intra-node" if inner <= self.devices_per_node else "inter-node"

  def seconds(self, nbytes: float, link: str) -> float:
    gbps = self.intra_node_gbps if link == "intra-node" else self.inter_node_gbps
    return nbytes * 8 / (gbps * 1e9)


def communication(model: ex.Model, sizes: dict[str, int], hw: Hardware,
                  stage: int = 0) -> dict[str, list[dict[str, Any]]]:
  """{mesh axis: [{collective, what, count, bytes_per_device, link, time_s}]} for one step on `stage`."""
  cfg = model.cfg
  micro = cfg.train.microbatches
  passes = 3 if cfg.train.remat == "full" else 2
  stages = ex.stage_layers(cfg, sizes["pipeline"])
  items: list[tuple[str, str, str, int, float]] = []
  items += _weights(model, sizes, stage, stages, micro, passes)
  items += _activations(cfg, sizes, micro, passes)
  out: dict[str, list[dict[str, Any]]] = {}
  for axis, collective, what, count, nbytes in items:
    if sizes[axis] == 1 or nbytes == 0:
      continue
    link = hw.link(axis, sizes)
    out.setdefault(axis, []).append({"collective": collective, "what": what, "count": count,
                                     "bytes_per_device": int(nbytes), "link": link,
                                     "time_s": hw.seconds(nbytes, link)})
  return out


def _weights(model: ex.Model, sizes, stage, stages, micro, passes):
  """All-gathers of fsdp-split weights and the gradient reductions over the batch axes."""
  units = _weight_units(model, sizes, stage, stages)
  scale = {"all-gather": passes * micro, "reduce-scatter": micro, "all-reduce": micro}
  out = [(axis, kind, what, count * scale[kind], nbytes * scale[kind]) for axis, kind, what, count, nbytes in units]
  method, d = model.cfg.train.grad_compression, sizes["data"]
  if method != "none" and d > 1:  # the data-axis gradient sum goes compressed (sharding/compression.py)
    item = em.ITEMSIZE[model.cfg.train.param_dtype]
    factor = compression.wire_bytes(1, d, method) / compression.wire_bytes(1, d, "none", item)
    out = [(axis, "all-gather", f"gradients as {method} (train.grad_compression)", count, nbytes * factor)
           if axis == "data" and kind == "all-reduce" else (axis, kind, what, count, nbytes)
           for axis, kind, what, count, nbytes in out]
  n = sizes["fsdp"]
  if model.cfg.train.zero == 1 and n > 1:  # the optimiser updates its fsdp shard; the new weights are gathered
    whole = [(leaf, ex.on_stage(leaf, stage, stages)) for leaf in model.leaves if leaf.kind == "params"]
    nbytes = sum((n - 1) / n * ex.leaf_bytes(leaf, sizes, count) for leaf, count in whole if count != 0)
    out.append(("fsdp", "all-gather", "updated parameters (ZeRO-1), once per step", len(whole), nbytes))
  return out


def _weight_units(model: ex.Model, sizes, stage, stages):
  """_weights for one microbatch and one pass (remembered per mesh and stage)."""
  key = ("weights", tuple(sizes[a] for a in MESH_AXES), stage, len(stages), model.cfg.train.compute_dtype)
  if key in model.memo:
    return model.memo[key]
  c = em.ITEMSIZE[model.cfg.train.compute_dtype]
  gather = scatter = 0.0
  reduce = dict.fromkeys(BATCH_AXES, 0.0)
  split_count = dict.fromkeys(BATCH_AXES, 0)
  total = 0
  for leaf in model.leaves:
    count = ex.on_stage(leaf, stage, stages)
    if leaf.kind != "params" or count == 0:
      continue
    total += 1
    shard = ex.leaf_bytes(leaf, sizes, count)
    split = {a for axes in leaf.axes for a in axes}
    for axis in BATCH_AXES:
      n = sizes[axis]
      if axis == "fsdp" and axis in split:
        gather += (n - 1) * shard // leaf.itemsize * c
        scatter += (n - 1) * shard
      elif axis not in split:
        reduce[axis] += 2 * (n - 1) / n * shard
      split_count[axis] += axis in split
  units = [("fsdp", "all-gather", "weights before use", split_count["fsdp"], gather),
           ("fsdp", "reduce-scatter", "weight gradients", split_count["fsdp"], scatter)]
  units += [(axis, "all-reduce", "gradients of weights replicated on the axis", total - split_count[axis],
             reduce[axis]) for axis in BATCH_AXES]
  model.memo[key] = units
  return units


def _layer_runs(cfg, sizes, micro):
  """(layers, runs per step, rows per run, sizes) of every layer group: pipelined stacks run per microbatch on
  rows not split over `pipeline`; without a pipeline everything runs per microbatch; with one, the rest (other
  stacks, MTP) runs once on the whole batch."""
  from jaxseek.sharding import pipeline as pipeline_lib

  S, B, m = sizes["pipeline"], cfg.train.batch_size, cfg.model
  inner = {**sizes, "pipeline": 1}
  groups = []
  for stack, moe in (("dense_layers", False), ("moe_layers", True)):
    n = m.num_moe_layers if moe else m.num_dense_layers
    if n and ex.pipelined(cfg, stack, S):  # each stage runs its stored rows, identity padding included
      groups.append((pipeline_lib.stored_layers(n, S, cfg.train.pipeline_repeats) // S, micro, B // micro, inner,
                     moe))
    elif n:
      groups.append((n, 1 if S > 1 else micro, B if S > 1 else B // micro, sizes, moe))
  if m.num_nextn_predict_layers:
    groups.append((m.num_nextn_predict_layers, 1 if S > 1 else micro, B if S > 1 else B // micro, sizes, m.is_moe))
  return groups


def _activations(cfg, sizes, micro, passes):
  """Tensor-parallel partial sums, expert dispatch, context key/value gathers, pipeline sends."""
  from jaxseek.sharding import pipeline as pipeline_lib

  m = cfg.model
  t, p, ctx, S = sizes["tensor"], sizes["expert"], sizes["context"], sizes["pipeline"]
  tensor_count = tensor_bytes = a2a_count = a2a_bytes = kv_count = kv_bytes = 0.0
  ring = m.context_attention in ("ring", "zigzag")
  for layers, runs, batch, where, moe in _layer_runs(cfg, sizes, micro):
    x = em.stream(cfg, batch).bytes(where)
    tensor_count += runs * 2 * passes * layers
    tensor_bytes += runs * 2 * passes * layers * 2 * (t - 1) / t * x
    if moe:
      rows = next(tt for tt in em.dispatch_tensors(cfg, where, batch, "gpu") if tt.name == "dispatch rows")
      buffer = rows.bytes(where) + rows.dims[0] * 4  # the rows and their local expert ids
      a2a_count += runs * 2 * passes * layers
      a2a_bytes += runs * 2 * passes * layers * (p - 1) / p * buffer
    if ctx > 1:
      kv = em.context_gathered(cfg, batch)
      kv = kv.bytes(where) * kv.copies
      sends = ctx if ring else 1  # a ring passes one chunk per step, a gather collects ctx - 1 chunks at once
      kv_count += runs * passes * layers * sends
      kv_bytes += runs * passes * layers * (ctx if ring else ctx - 1) * kv
  ends = em.stream(cfg, cfg.train.batch_size if S > 1 else cfg.train.batch_size // micro).bytes(sizes)
  ends_runs = 1 if S > 1 else micro
  collective = "reduce-scatter + all-gather" if cfg.mesh.sequence_parallel else "all-reduce"
  items = [("tensor", collective, "x[B,T,D] partial sums (attention out, MLP out; embedding, head)",
            tensor_count + 2 * ends_runs, tensor_bytes + 2 * ends_runs * 2 * (t - 1) / t * ends)]
  if m.is_moe and a2a_count:
    items.append(("expert", "all-to-all", "MoE dispatch buffers [P·C, D], out and back", a2a_count, a2a_bytes))
  if ctx > 1:
    what = "MLA latent and rope key [B,T,C+R]" if m.is_mla else "keys and values"
    if ring:
      items.append(("context", "collective-permute", f"{what} chunks round the ring, per layer and step (their "
                    f"gradients back)", kv_count, kv_bytes))
    else:
      items.append(("context", "all-gather", f"{what} per layer (gradients reduce-scattered)", kv_count, kv_bytes))
  piped = [n for stack, n in (("dense_layers", m.num_dense_layers), ("moe_layers", m.num_moe_layers))
           if ex.pipelined(cfg, stack, S)]
  if piped:
    inner = {**sizes, "pipeline": 1}
    x_micro = em.stream(cfg, cfg.train.batch_size // micro).bytes(inner)
    x_whole = em.stream(cfg, cfg.train.batch_size).bytes(inner)
    ticks = sum(pipeline_lib.num_ticks(S, micro, pipeline_lib.stack_repeats(n, S, cfg.train.pipeline_repeats))
                for n in piped)
    items.append(("pipeline", "collective-permute", "x[B/M,T,D] to the next stage per tick, its gradient back",
                  2 * ticks, 2 * ticks * x_micro))
    items.append(("pipeline", "all-gather + all-reduce", "x[B,T,D] into each schedule, its output to every stage "
                  "(and their gradients)", 4 * len(piped), len(piped) * 6 * (S - 1) / S * x_whole))
  return items


def compute_seconds(model: ex.Model, sizes: dict[str, int], hw: Hardware) -> dict[str, float]:
  """FLOPs per device per step, the time at peak, and the pipeline bubble's share (the pipelined stacks'
  compute stretched by ticks / (R·M)); under 1F1B the pipelined stacks' forward runs twice (recomputed in the
  backward) unless train.remat=full already counts it."""
  from jaxseek.sharding import pipeline as pipeline_lib

  cfg = model.cfg
  flops = model.flops_per_token * cfg.train.batch_size * cfg.train.seq_len
  if cfg.train.remat == "full":
    flops *= 4 / 3  # the forward runs twice
  per_device = flops / math.prod(sizes.values())
  seconds = per_device / (hw.peak_tflops * 1e12)
  S, M, m = sizes["pipeline"], cfg.train.microbatches, cfg.model
  bubble = 0.0
  one_f_one_b = cfg.train.pipeline_schedule in pipeline_lib.ONE_F_ONE_B
  for stack, n in (("dense_layers", m.num_dense_layers), ("moe_layers", m.num_moe_layers)):
    if ex.pipelined(cfg, stack, S):
      R = pipeline_lib.stack_repeats(n, S, cfg.train.pipeline_repeats)
      share = n / max(m.num_hidden_layers, 1)  # of the step's layer compute (the head counted with the rest)
      padded = pipeline_lib.stored_layers(n, S, cfg.train.pipeline_repeats) / n  # identity padding runs too
      if one_f_one_b:
        from jaxseek.sharding import schedules

        stretch = 1 / (1 - schedules.for_config(cfg, S, R).bubble())
        if cfg.train.remat != "full":  # 1F1B recomputes each chunk's forward in its backward
          seconds += seconds * share * padded / 3
      else:
        stretch = pipeline_lib.num_ticks(S, M, R) / (R * M)
      bubble += seconds * share * (stretch * padded - 1)
  return {"flops_per_device": per_device, "time_s": seconds, "bubble_s": bubble}


def step_seconds(compute: dict[str, float], comm: dict[str, list[dict[str, Any]]]) -> float:
  return compute["time_s"] + compute["bubble_s"] + sum(c["time_s"] for items in comm.values() for c in items)
