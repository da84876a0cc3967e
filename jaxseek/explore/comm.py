"""Communication per step: the collectives each mesh axis implies, bytes per device, and time on the links.

Per device and step, with m microbatches, passes = 2 (forward, backward) or 3 (remat recomputes the forward;
a table schedule recomputes the pipelined stack's forward too), n = the axis size, and ring algorithms (an
all-gather or reduce-scatter moves (n−1)/n of the whole, an all-reduce twice that):

  fsdp      all-gather of every fsdp-split weight, once per pass and microbatch (compute dtype);
            reduce-scatter of their gradients per microbatch (parameter dtype). With train.zero=1 no weight is
            split: their gradients are all-reduced, and the updated weights all-gathered once per step
  data, expert, context, fsdp
            all-reduce of the gradients of weights replicated on the axis (every batch axis splits the batch):
            once per step on the axes `gradsum.axes` names (the step sums them after the microbatches), else
            once per microbatch (XLA's reduction inside the loop)
  tensor    all-reduce of x[B, T, D] partial sums: 2 per layer and pass (attention out, MLP / MoE out), plus the
            embedding lookup and the head's input gradient
  expert    per MoE layer and pass (memory.dispatch): fixed, all_to_all of the [P·C, D] buffers out and back;
            ragged, an all_gather of the copy counts per expert, then ragged_all_to_all of the x·K token copies
            out (the dispatch dtype; the backward's in the compute dtype) and back (compute dtype). Of the copies 1/P
            stay on the device, (g − 1)/P go to the g − 1 other shards of its node (NVLink), (P − g)/P cross
            nodes, with g = the expert shards one node holds (balanced routing). Two-stage (node-limited:
            model.moe_dispatch=two_stage where the axis spans nodes): a token's row crosses to each
            other node its experts are on, once, with its expert ids and gate weights (2K float32); the node's
            weighted sum comes back once (`nodes_reached`: the expected count under uniform routing, bounded
            by the nodes group-limited routing lets a token reach); within the node each copy goes to its
            expert's shard ((g − 1)/g of the K copies leave the device), as in the one-stage exchange
  context   all-gather of the keys and values per layer and pass (their gradients reduce-scattered)
  pipeline  collective-permute of a microbatch's x[B/M, T, D] to the next stage and of its gradient back, per
            tick of each pipelined stack (ticks = R·M + S − 1). GPipe and circular: entering the schedule
            x[B, T, D] is gathered over the stages and leaving it the last stage's output is shared (an
            all-reduce), and the reverse for the gradients; the gradients of the weights every stage holds are
            all-reduced once per step. Table schedules (the whole model inside): the outer weights, stored 1/S,
            all-gathered once per step (parameter dtype) and their float32 gradients reduce-scattered once

An axis's links are intra-node when the devices of one group (the axis and every axis inside it) fit in a node.
Step time = compute + Σ collectives, assuming no overlap (a pessimistic bound; XLA overlaps some of it), where
compute = FLOPs / peak, the pipelined stacks' share stretched by the bubble: ticks / (R·M).

Under a table schedule the parts outside the pipelined stack run per microbatch on one stage (the embedding and
the layers before the stack on the first, the rest on the last; DualPipeV: both on stage 0): their traffic is
counted for the stage where it is larger.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxseek.config import MESH_AXES
from jaxseek.explore import layout as ex
from jaxseek.explore import memory as em
from jaxseek.sharding import compression, exchange, experts, gradsum

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
  capability: float = 9.0  # CUDA compute capability: which kernels `auto` picks (kernels/choice.py)
  fp8_tflops: float | None = None  # dense float8 peak (None: no FP8 GEMMs): train.fp8's GEMMs run at it

  def link(self, axis: str, sizes: dict[str, int]) -> str:
    inner = math.prod(sizes[a] for a in MESH_AXES[MESH_AXES.index(axis):])
    return "intra-node" if inner <= self.devices_per_node else "inter-node"

  def seconds(self, nbytes: float, link: str) -> float:
    gbps = self.intra_node_gbps if link == "intra-node" else self.inter_node_gbps
    return nbytes * 8 / (gbps * 1e9)


def communication(model: ex.Model, sizes: dict[str, int], hw: Hardware, stage: int = 0,
                  platform: str = "gpu") -> dict[str, list[dict[str, Any]]]:
  """{mesh axis: [{collective, what, count, bytes_per_device, link, time_s}]} for one step on `stage`."""
  cfg = model.cfg
  micro = cfg.train.microbatches
  passes = 3 if cfg.train.remat == "full" else 2
  stages = ex.stage_layers(cfg, sizes["pipeline"])
  items: list[tuple] = []
  items += _weights(model, sizes, stage, stages, micro, passes)
  items += _activations(cfg, sizes, hw, micro, passes, platform)
  out: dict[str, list[dict[str, Any]]] = {}
  for axis, collective, what, count, nbytes, *link in items:
    if sizes[axis] == 1 or nbytes == 0:
      continue
    link = link[0] if link else hw.link(axis, sizes)
    out.setdefault(axis, []).append({"collective": collective, "what": what, "count": count,
                                     "bytes_per_device": int(nbytes), "link": link,
                                     "time_s": hw.seconds(nbytes, link)})
  return out


def summed_axes(cfg, sizes: dict[str, int]) -> tuple[str, ...]:
  """The batch axes whose gradient sum the step runs once per step (sharding/gradsum.py)."""
  return tuple(gradsum.axes(cfg, sizes))


def _weights(model: ex.Model, sizes, stage, stages, micro, passes):
  """All-gathers of fsdp-split weights, the gradient reductions over the batch axes and over `pipeline`."""
  cfg = model.cfg
  key = ("weights", tuple(sizes[a] for a in MESH_AXES), stage, len(stages), cfg.train.compute_dtype, micro, passes,
         cfg.train.pipeline_schedule, cfg.train.zero, cfg.train.grad_compression, cfg.train.powersgd_rank)
  if key not in model.memo:
    model.memo[key] = _weight_items(model, sizes, stage, stages, micro, passes)
  return model.memo[key]


def _weight_items(model: ex.Model, sizes, stage, stages, micro, passes):
  """The weight collectives of one step on `stage`: fsdp gathers and scatters, the gradient sums over the batch
  axes (per microbatch, or once per step), ZeRO-1's gather and the outer weights' traffic over `pipeline`."""
  cfg = model.cfg
  compressed = cfg.train.grad_compression != "none" and sizes["data"] > 1
  once = set(summed_axes(cfg, sizes)) | ({"data"} if compressed else set())
  roles, step, pipe = _weight_tally(model, sizes, stage, stages, micro, passes, once)
  out = _batch_items(roles, step, once)
  if compressed:  # the data-axis gradient sum goes compressed (sharding/compression.py), once per step
    out = _compressed_items(model, sizes, stage, stages, out)
  out += _zero1_items(model, sizes, stage, stages)
  return out + _pipeline_items(cfg, sizes["pipeline"], passes, pipe)


def _axis_sums() -> dict[str, float]:
  """Zeroed bytes and counts of the gradient sums over each batch axis."""
  return {**{a: 0.0 for a in BATCH_AXES}, **{f"{a}_n": 0 for a in BATCH_AXES}}


def _weight_tally(model: ex.Model, sizes, stage, stages, micro, passes, once):
  """Bytes and counts summed over the parameters `stage` holds: per role (every stage, or the first / last stage
  of a table schedule) the fsdp traffic and per-microbatch sums; the once-per-step sums; the traffic over
  `pipeline` of the outer weights."""
  cfg, S = model.cfg, sizes["pipeline"]
  c = ex.ITEMSIZE[cfg.train.compute_dtype]
  roles = {r: {"gather": 0.0, "scatter": 0.0, "gather_n": 0, **_axis_sums()} for r in ("all", "first", "last")}
  step = _axis_sums()  # once-per-step sums
  pipe = {"gather": 0.0, "gather_n": 0, "scatter": 0.0, "reduce": 0.0, "reduce_n": 0}
  for leaf in ex.leaves_on(model, sizes):
    count = ex.on_stage(leaf, stage, stages)
    if leaf.kind != "params" or count == 0:
      continue
    shard = ex.leaf_bytes(leaf, sizes, count)
    role, runs, used = "all", micro, shard  # a microbatch-loop collective: how often, on what, on which stage
    if ex.outer(cfg, leaf, S):
      scheduled = _outer_traffic(cfg, sizes, leaf, count, passes, pipe)
      role, runs, used = (scheduled[0], micro, scheduled[1]) if scheduled else ("all", 1, shard)
    r = roles[role]
    on = {a for axes in leaf.axes for a in axes}
    for axis in BATCH_AXES:
      n = sizes[axis]
      if axis == "fsdp" and axis in on:
        r["gather"] += passes * runs * (n - 1) * used // leaf.itemsize * c
        r["scatter"] += runs * (n - 1) * used
        r["gather_n"] += runs
      elif axis not in on and axis in once:
        step[axis] += 2 * (n - 1) / n * shard
        step[f"{axis}_n"] += 1
      elif axis not in on:
        r[axis] += runs * 2 * (n - 1) / n * used
        r[f"{axis}_n"] += runs
  return roles, step, pipe


def _outer_traffic(cfg, sizes, leaf: ex.Leaf, count: int, passes: int, pipe: dict) -> tuple[str, int] | None:
  """Adds an outer weight's traffic over `pipeline` to `pipe`. Under a table schedule returns the role of the
  stage that runs it per microbatch and its whole bytes; None under GPipe, which runs it once outside."""
  S = sizes["pipeline"]
  f, full = (S - 1) / S, ex.leaf_bytes(leaf, {**sizes, "pipeline": 1}, count)
  split = ex.over_stages(leaf)
  pipe["gather_n"] += split
  pipe["reduce_n"] += not split
  if ex.table_schedule(cfg, S):  # inside the schedule per microbatch on the stage that runs it, whole on pipeline
    grad = full // leaf.itemsize * 4  # accumulated in float32 through the schedule
    pipe["gather"] += f * full // leaf.itemsize * ex.gathered_itemsize(cfg, leaf) if split else 0
    pipe["scatter"] += f * grad if split else 0
    pipe["reduce"] += 0 if split else 2 * f * grad
    return ex.outer_role(cfg, leaf.stack, S), full
  # GPipe: outside the schedule, once on the whole batch, data-parallel over the stages
  pipe["gather"] += passes * f * full if split else 0
  if pipeline_splits_batch(cfg, sizes):
    pipe["scatter"] += f * full if split else 0
    pipe["reduce"] += 0 if split else 2 * f * full
  return None


def _batch_items(roles: dict, step: dict, once: set) -> list[tuple]:
  """The fsdp gathers and scatters and the gradient sum over each batch axis, on the busier end of a table
  schedule (first or last stage)."""
  side = max(("first", "last"), key=lambda k: roles[k]["gather"] + roles[k]["scatter"] +
             sum(roles[k][a] for a in BATCH_AXES))
  pick = lambda k: roles["all"][k] + roles[side][k]
  out = [("fsdp", "all-gather", "weights before use", pick("gather_n"), pick("gather")),
         ("fsdp", "reduce-scatter", "weight gradients", pick("gather_n"), pick("scatter"))]
  for axis in BATCH_AXES:
    if axis in once:
      what = "gradients of weights replicated on the axis, once per step (summed after the microbatches)"
      out.append((axis, "all-reduce", what, step[f"{axis}_n"], step[axis]))
    else:
      what = "gradients of weights replicated on the axis, per microbatch"
      out.append((axis, "all-reduce", what, pick(f"{axis}_n"), pick(axis)))
  return out


def _compressed_items(model: ex.Model, sizes, stage, stages, out: list[tuple]) -> list[tuple]:
  """`out` with the data-axis gradient sum as train.grad_compression sends it."""
  cfg = model.cfg
  method = cfg.train.grad_compression
  kind = "all-reduce" if method == "powersgd" else "all-to-all+all-gather"
  what = (f"PowerSGD rank-{cfg.train.powersgd_rank} factors P and Q (float32; embedding, head int8, vectors "
          "whole), once per step"
          if method == "powersgd" else f"gradients as {method}, reduce-scattered (all-to-all) then all-gathered, "
          "once per step")
  nbytes = compression_bytes(model, sizes, stage, stages, method)
  return [(axis, kind, what, count, nbytes) if axis == "data" and k == "all-reduce" else (axis, k, w, count, b)
          for axis, k, w, count, b in out]


def _zero1_items(model: ex.Model, sizes, stage, stages) -> list[tuple]:
  """ZeRO-1: the optimiser updates its fsdp shard; the new weights are gathered."""
  n = sizes["fsdp"]
  if model.cfg.train.zero != 1 or n == 1:
    return []
  held = [(leaf, ex.on_stage(leaf, stage, stages)) for leaf in ex.leaves_on(model, sizes) if leaf.kind == "params"]
  nbytes = sum((n - 1) / n * ex.leaf_bytes(leaf, sizes, count) for leaf, count in held if count != 0)
  return [("fsdp", "all-gather", "updated parameters (ZeRO-1), once per step", len(held), nbytes)]


def _pipeline_items(cfg, S: int, passes: int, pipe: dict) -> list[tuple]:
  """The outer weights' gathers and gradient sums over `pipeline`."""
  if ex.table_schedule(cfg, S):
    return [("pipeline", "all-gather", "weights outside the pipelined stack (stored 1/S), gathered whole when the "
             "schedule starts, once per step", pipe["gather_n"], pipe["gather"]),
            ("pipeline", "reduce-scatter", "their float32 gradients, once per step", pipe["gather_n"], pipe["scatter"]),
            ("pipeline", "all-reduce", "float32 gradients of the other outer weights (held whole), once per step",
             pipe["reduce_n"], pipe["reduce"])]
  if S > 1:
    return [("pipeline", "all-gather", "weights outside the pipelined stack (stored 1/S), gathered per pass",
             passes * pipe["gather_n"], pipe["gather"]),
            ("pipeline", "reduce-scatter", "their gradients, once per step", pipe["gather_n"], pipe["scatter"]),
            ("pipeline", "all-reduce", "gradients of the weights every stage holds whole (they run data-parallel "
             "outside the schedule), once per step", pipe["reduce_n"], pipe["reduce"])]
  return []


def compression_bytes(model: ex.Model, sizes, stage, stages, method: str) -> float:
  """Bytes one device sends per step for the data-axis gradient sum under train.grad_compression=`method`
  (compression.step_bytes on the parameters the stage holds)."""
  leaves = []
  for leaf in ex.leaves_on(model, sizes):
    count = ex.on_stage(leaf, stage, stages)
    if leaf.kind == "params" and count != 0:
      shape = leaf.shape if count is None else (count, *leaf.shape[1:])
      leaves.append((shape, leaf.names, ex.leaf_bytes(leaf, sizes, count) // leaf.itemsize))
  return compression.step_bytes(leaves, sizes["data"], method, model.cfg.train.powersgd_rank,
                                ex.ITEMSIZE[model.cfg.train.param_dtype])


def compression_table(model: ex.Model, sizes, stage, stages) -> dict:
  """What each train.grad_compression method sends per device per step over `data`, beside none."""
  got = {m: compression_bytes(model, sizes, stage, stages, m) for m in compression.METHODS}
  return {"data": sizes["data"], "configured": model.cfg.train.grad_compression,
          "powersgd_rank": model.cfg.train.powersgd_rank, "bytes_per_device": got,
          "ratio_to_none": {m: b / got["none"] if got["none"] else 1.0 for m, b in got.items()}}


def pipeline_splits_batch(cfg, sizes) -> bool:
  from jaxseek.pipeline import stages as pipeline_lib

  return pipeline_lib.splits_batch(cfg, sizes)


def _layer_runs(cfg, sizes, micro, passes):
  """(layers, runs per step, rows per run, sizes, moe, passes, role) of every layer group: pipelined stacks run
  per microbatch on rows not split over `pipeline`, on every stage; without a pipeline everything runs per
  microbatch; with GPipe the rest (other stacks, MTP) runs once on the whole batch on every stage; with a table
  schedule per microbatch on the first or last stage (`layout.outer_role`)."""
  from jaxseek.pipeline import stages as pipeline_lib

  S, B, m = sizes["pipeline"], cfg.train.batch_size, cfg.model
  inner = {**sizes, "pipeline": 1}
  table = ex.table_schedule(cfg, S)
  groups = []
  outer = []
  for stack, moe in (("dense_layers", False), ("moe_layers", True)):
    n = m.num_moe_layers if moe else m.num_dense_layers
    if n and ex.pipelined(cfg, stack, S):  # each stage runs its stored rows, identity padding included
      # a table schedule recomputes each chunk's forward in its backward (unless train.pipeline_recompute=false)
      recompute = 3 if table and cfg.train.pipeline_recompute else passes
      groups.append((pipeline_lib.stored_layers(n, S, cfg.train.pipeline_repeats) // S, micro, B // micro, inner,
                     moe, max(passes, recompute), "all"))
    elif n:
      outer.append((n, moe, stack))
  if m.num_nextn_predict_layers:
    outer.append((m.num_nextn_predict_layers, m.is_moe, "mtp_layers"))
  for n, moe, stack in outer:
    if table:
      groups.append((n, micro, B // micro, inner, moe, passes, ex.outer_role(cfg, stack, S)))
    else:
      groups.append((n, 1 if S > 1 else micro, B if S > 1 else B // micro, sizes, moe, passes, "all"))
  return groups


def expert_exchange(cfg, sizes: dict[str, int], hw: Hardware, platform: str = "gpu") -> dict[str, Any] | None:
  """The MoE dispatch of one step on one device (the stage where it is larger): rows and bytes out and back,
  the shares of the token copies that stay on the device, go over NVLink or cross nodes (balanced routing),
  and the ideal: every token copy that leaves the device sent once per pass, out as float8 with its scales and
  back in bfloat16."""
  m = cfg.model
  if not m.is_moe:
    return None
  side, first = _exchange_sides(cfg, sizes, platform)
  sizes = em.moe_sizes(cfg, sizes)  # model.moe_tensor=experts: the tensor ranks are expert shards
  P, K = sizes["expert"], m.num_experts_per_tok
  if first is None:
    return None
  roles = [r for r in ("first", "last") if r in side]
  heavier = max(roles, key=lambda r: side[r]["out"] + side[r]["back"]) if roles else None
  pick = lambda k: side.get("all", {}).get(k, 0.0) + (side[heavier].get(k, 0.0) if heavier else 0.0)
  g = shards_per_node(sizes, hw)
  nodes = max(1, P // g)
  limit = m.moe_max_expert_shards
  reach = min(limit or P, P, K)
  node_reach = min(reach, nodes)
  groups = group_reach(cfg, P, g)
  if groups:
    reach, node_reach = min(reach, groups[0]), min(node_reach, groups[1])
  two = first.kind == "ragged" and experts.Settings.from_config(m, g if nodes > 1 else None).two_stage(P, platform)
  crossing = nodes_reached(cfg, P, g) if two else K * (P - g) / P
  if two:
    _two_stage_bytes(side, first, K, g, crossing)
  total = pick("out") + pick("back") + pick("counts")
  inter = pick("inter") if two else (pick("out") + pick("back")) * (P - g) / max(P - 1, 1)
  return {"kind": "two_stage" if two else first.kind, "dispatch_dtype": first.dtype, "shards": P,
          "local_experts": first.local_experts,
          "tokens_per_run": first.tokens, "rows_sent": first.sent, "rows_received": first.received,
          "layer_runs": pick("runs"), "collectives": pick("ops"), "count_exchanges": pick("count_ops"),
          "bytes_out": pick("out"), "bytes_back": pick("back"), "bytes_counts": pick("counts"),
          "bytes_total": total, "ideal_bytes": pick("ideal"),
          "vs_ideal": total / pick("ideal") if pick("ideal") else None,
          "shards_per_node": g, "nodes": nodes,
          "share_on_device": 1 / P, "share_intra_node": (g - 1) / P, "share_inter_node": (P - g) / P,
          "max_expert_shards": limit, "shards_per_token_max": reach, "nodes_per_token_max": node_reach,
          "group_limited": bool(groups), "inter_node_copies_per_token": K * (P - g) / P,
          "inter_node_rows_per_token": crossing, "bytes_inter_node": inter,
          "bytes_intra_node": pick("out") + pick("back") - inter,
          "collectives_inter_node": pick("inter_ops" if two else "ops"),
          # the two-stage dispatch (a token once per node it reaches, fanned out there: DeepSeek's) crosses nodes
          # at most this often per token; the figures above time the one-stage exchange (every copy)
          "inter_node_sends_per_token_one_per_node_max": min(node_reach, nodes - 1)}


def _exchange_sides(cfg, sizes: dict[str, int], platform: str) -> tuple[dict[str, dict[str, float]], Any]:
  """The one-stage exchange's rows, bytes and ops per role (the stage that runs the layers: all, first, last),
  and the first MoE layer run's dispatch (None without one)."""
  m = cfg.model
  P, K, D, micro = em.moe_sizes(cfg, sizes)["expert"], m.num_experts_per_tok, m.hidden_size, cfg.train.microbatches
  passes = 3 if cfg.train.remat == "full" else 2
  leave = (P - 1) / P
  side: dict[str, dict[str, float]] = {}
  first = None
  for layers, runs, batch, where, moe, group_passes, role in _layer_runs(cfg, sizes, micro, passes):
    if not moe:
      continue
    d = em.dispatch(cfg, where, batch, platform)
    first = first or d
    t = side.setdefault(role, dict.fromkeys(("out", "back", "counts", "count_ops", "ops", "ideal", "runs",
                                             "fwd_tokens", "bwd_tokens"), 0.0))
    n = runs * layers
    forward = group_passes - 1  # forward passes (and recomputations), then one backward
    t["runs"] += n
    t["fwd_tokens"] += n * forward * d.tokens  # token rows through forward passes
    t["bwd_tokens"] += n * d.tokens
    # towards the experts in the dispatch dtype: the rows in each forward, the results' gradients in the backward
    # (moe.dispatch's fp8_out and fp8_back); back from them in the compute dtype: results, the rows' gradients
    t["out"] += n * group_passes * d.sent * leave * d.out_row_bytes
    t["back"] += n * group_passes * d.sent * leave * d.back_row_bytes
    t["ideal"] += n * group_passes * d.tokens * K * leave * (em.packed_row_bytes(D) + 2 * D)
    if d.kind == "fixed":
      t["ops"] += n * group_passes * 2 + n * forward  # rows out and back, and the ids
    else:
      t["counts"] += n * forward * (P - 1) * P * d.local_experts * 4  # all_gather of every shard's E counts
      t["count_ops"] += n * forward
      t["ops"] += n * group_passes * 2
  return side, first


def _two_stage_bytes(side: dict[str, dict[str, float]], d, K: int, g: int, crossing: float) -> None:
  """Rewrites each role's one-stage bytes (every copy sent) as the two-stage exchange's. Across nodes, per token
  and other node reached (`crossing` a token): in each forward pass its row in the dispatch dtype with 2K float32
  of expert ids and gate weights out, the weighted sum back in the compute dtype; in the backward the sum's
  gradient out and the row's back (compute dtype) with the weights' gradients. Within the node: the K copies,
  (g − 1)/g of them to another device, as the one-stage exchange sends them."""
  meta = 2 * K * 4
  for t in side.values():
    if not t["runs"]:
      continue
    fwd, bwd = t["fwd_tokens"] * crossing, t["bwd_tokens"] * crossing
    t["inter"] = fwd * (d.out_row_bytes + meta + d.back_row_bytes) + bwd * (2 * d.back_row_bytes + meta)
    t["inter_ops"] = t["ops"] / 2 * 3  # per pass: the rows, their ids and weights, the sums back
    nodes, count_rounds = d.shards // g, t["count_ops"]  # the counts: per node across nodes, per expert within
    t["counts"] = count_rounds * ((nodes - 1) * nodes + (g - 1) * g * d.local_experts) * 4
    within = (t["fwd_tokens"] + t["bwd_tokens"]) * K * (g - 1) / g
    t["out"], t["back"] = within * d.out_row_bytes + t["inter"] / 2, within * d.back_row_bytes + t["inter"] / 2


def nodes_reached(cfg, P: int, g: int, samples: int = 8192) -> float:
  """The other nodes a token's experts lie on, on average under uniform routing (seeded sampling): K experts
  among the `topk_group` groups a token picks under group-limited routing (uniformly among all experts
  without it), experts laid out in order on P shards of g to a node, the token on a uniformly drawn node."""
  import numpy as np

  m = cfg.model
  E, K, nodes = m.n_routed_experts, m.num_experts_per_tok, max(1, P // g)
  rng = np.random.default_rng(0)
  if m.topk_method != "greedy" and m.n_group > 1:
    per_group = E // m.n_group
    picked = np.argsort(rng.random((samples, m.n_group)), axis=1)[:, :m.topk_group]
    pool = (picked[:, :, None] * per_group + np.arange(per_group)).reshape(samples, -1)
  else:
    pool = np.broadcast_to(np.arange(E), (samples, E))
  chosen = np.take_along_axis(pool, np.argsort(rng.random(pool.shape), axis=1)[:, :K], axis=1)
  node_SK = chosen // -(-E // P) // g
  reached = np.zeros((samples, nodes), bool)
  np.put_along_axis(reached, node_SK, True, axis=1)
  own = rng.integers(0, nodes, samples)
  return float((reached.sum(1) - reached[np.arange(samples), own]).mean())


def group_reach(cfg, P: int, g: int) -> tuple[int, int] | None:
  """(shards, nodes) a token's experts can reach under group-limited routing (model.topk_method
  group_limited_greedy or noaux_tc with n_group > 1), on P expert shards of g to a node
  (`exchange.group_reach`); None without it."""
  m = cfg.model
  if m.topk_method == "greedy" or m.n_group <= 1 or m.n_routed_experts % P:
    return None
  return exchange.group_reach(m.n_routed_experts, m.n_group, m.topk_group, P, g)


def shards_per_node(sizes: dict[str, int], hw: Hardware) -> int:
  """Expert-axis shards in one node of `hw` (memory.shards_per_node)."""
  return em.shards_per_node(sizes, hw.devices_per_node)


def _activations(cfg, sizes, hw, micro, passes, platform="gpu"):
  """Tensor-parallel partial sums, expert dispatch, context key/value gathers, pipeline sends."""
  from jaxseek.pipeline import stages as pipeline_lib

  m = cfg.model
  t, ctx, S = sizes["tensor"], sizes["context"], sizes["pipeline"]
  ring = m.context_attention in ("ring", "zigzag")
  side = {}
  for layers, runs, batch, where, moe, group_passes, role in _layer_runs(cfg, sizes, micro, passes):
    acc = side.setdefault(role, {"tensor_count": 0.0, "tensor_bytes": 0.0, "kv_count": 0.0, "kv_bytes": 0.0})
    x = em.stream(cfg, batch).bytes(where)
    acc["tensor_count"] += runs * 2 * group_passes * layers
    acc["tensor_bytes"] += runs * 2 * group_passes * layers * 2 * (t - 1) / t * x
    if ctx > 1:
      kv = em.context_gathered(cfg, batch)
      kv = kv.bytes(where) * kv.copies
      sends = ctx if ring else 1  # a ring passes one chunk per step, a gather collects ctx - 1 chunks at once
      acc["kv_count"] += runs * group_passes * layers * sends
      acc["kv_bytes"] += runs * group_passes * layers * (ctx if ring else ctx - 1) * kv
  roles = [r for r in ("first", "last") if r in side]
  heavier = max(roles, key=lambda r: side[r]["tensor_bytes"] + side[r]["kv_bytes"]) if roles else None
  pick = lambda k: side.get("all", {}).get(k, 0.0) + (side[heavier][k] if heavier else 0.0)
  table = ex.table_schedule(cfg, S)
  if table:  # the embedding lookup and the head's input gradient, per microbatch inside the schedule
    ends, ends_runs = em.stream(cfg, cfg.train.batch_size // micro).bytes({**sizes, "pipeline": 1}), micro
  else:
    ends = em.stream(cfg, cfg.train.batch_size if S > 1 else cfg.train.batch_size // micro).bytes(sizes)
    ends_runs = 1 if S > 1 else micro
  collective = "reduce-scatter + all-gather" if cfg.mesh.sequence_parallel else "all-reduce"
  items = [("tensor", collective, "x[B,T,D] partial sums (attention out, MLP out; embedding, head)",
            pick("tensor_count") + 2 * ends_runs, pick("tensor_bytes") + 2 * ends_runs * 2 * (t - 1) / t * ends)]
  exchange = expert_exchange(cfg, sizes, hw, platform)
  if exchange and sizes["expert"] > 1:
    items += _expert_items(exchange)
  if ctx > 1:
    what = "MLA latent and rope key [B,T,C+R]" if m.is_mla else "keys and values"
    if ring:
      items.append(("context", "collective-permute", f"{what} chunks round the ring, per layer and step (their "
                    f"gradients back)", pick("kv_count"), pick("kv_bytes")))
    else:
      items.append(("context", "all-gather", f"{what} per layer (gradients reduce-scattered)", pick("kv_count"),
                    pick("kv_bytes")))
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
    if not table:  # a table schedule runs the whole model inside: nothing enters or leaves it but the batch
      items.append(("pipeline", "all-gather + all-reduce", "x[B,T,D] into each schedule, its output to every "
                    "stage (and their gradients)", 4 * len(piped), len(piped) * 6 * (S - 1) / S * x_whole))
  return items


def _expert_items(x: dict[str, Any]) -> list[tuple]:
  """The expert axis's exchange as rows: its cross-node and its in-node part (each at its link's speed)."""
  P, g = x["shards"], x["shards_per_node"]
  inter, intra = x["bytes_inter_node"], x["bytes_intra_node"]
  if x["kind"] == "two_stage":
    items = [("expert", "ragged-all-to-all", f"MoE two-stage dispatch, across nodes: a token's row once per other "
              f"node its experts are on ({x['inter_node_rows_per_token']:.2f} a token), out ({x['dispatch_dtype']}, "
              f"with 2K float32 of ids and weights) and its sum back", x["collectives_inter_node"], inter,
              "inter-node"),
             ("expert", "ragged-all-to-all", f"MoE two-stage dispatch, within the node: the copies to their experts' "
              f"shards, out ({x['dispatch_dtype']}) and back; received into {x['rows_received']:,} rows",
              x["collectives"], intra, "intra-node")]
    return items + [("expert", "all-gather", "copies per expert before each dispatch [E] int32",
                     x["count_exchanges"], x["bytes_counts"], "inter-node")] * bool(x["bytes_counts"])
  if x["kind"] == "fixed":
    kind, what = "all-to-all", "MoE dispatch buffers [P·C, D], out and back"
  else:
    kind = "ragged-all-to-all"
    what = (f"MoE token copies [x·K, D], out ({x['dispatch_dtype']}) and back; received into "
            f"{x['rows_received']:,} rows")
  items = []
  if inter:
    items.append(("expert", kind, f"{what}: to shards on other nodes", x["collectives"], inter, "inter-node"))
  if intra:
    items.append(("expert", kind, f"{what}: to shards on the own node", x["collectives"], intra, "intra-node"))
  if x["bytes_counts"]:
    items.append(("expert", "all-gather", "copies per expert before each dispatch [E] int32",
                  x["count_exchanges"], x["bytes_counts"], "inter-node" if P > g else "intra-node"))
  return items


def compute_seconds(model: ex.Model, sizes: dict[str, int], hw: Hardware) -> dict[str, float]:
  """FLOPs per device per step, the time at peak, and the pipeline bubble's share. Under GPipe and the circular
  schedule the pipelined stacks' compute is stretched by ticks / (R·M) (the rest runs data-parallel over the
  stages); the table schedules are timed tick by tick (`table_span`)."""
  from jaxseek.pipeline import stages as pipeline_lib

  cfg = model.cfg
  tokens = cfg.train.batch_size * cfg.train.seq_len / math.prod(sizes.values())
  rerun = 4 / 3 if cfg.train.remat == "full" else 1.0  # the forward runs twice
  per_device = model.flops_per_token * tokens * rerun
  fp8 = model.recipe_flops_per_token * tokens * rerun if fp8_runs(cfg, hw) else 0.0
  seconds = (per_device - fp8) / (hw.peak_tflops * 1e12) + (fp8 / (hw.fp8_tflops * 1e12) if fp8 else 0.0)
  S, m = sizes["pipeline"], cfg.model
  bubble, stages = 0.0, None
  for stack, n in (("dense_layers", m.num_dense_layers), ("moe_layers", m.num_moe_layers)):
    if not ex.pipelined(cfg, stack, S):
      continue
    if cfg.train.pipeline_schedule in pipeline_lib.ONE_F_ONE_B:
      span, stages = table_span(model, sizes, hw, stack)
      seconds = sum(stages) / S  # with the recomputed forwards and the identity padding's layers that run
      bubble = span - seconds
      break
    R = pipeline_lib.stack_repeats(n, S, cfg.train.pipeline_repeats)
    share = n / max(m.num_hidden_layers, 1)  # of the step's layer compute (the head counted with the rest)
    padded = pipeline_lib.stored_layers(n, S, cfg.train.pipeline_repeats) / n  # identity padding runs too
    stretch = 1 / (1 - pipeline_lib.bubble(cfg.train.pipeline_schedule, S, cfg.train.microbatches, R))
    bubble += seconds * share * (stretch * padded - 1)
  return {"flops_per_device": per_device, "fp8_flops_per_device": fp8, "time_s": seconds,
          "bubble_s": bubble, **({"stage_work_s": stages} if stages else {}),
          "time_at_bf16_s": seconds * per_device / (per_device - fp8 + fp8 * hw.peak_tflops / hw.fp8_tflops)
          if fp8 else seconds}


def table_span(model: ex.Model, sizes: dict[str, int], hw: Hardware, stack: str) -> tuple[float, list[float]]:
  """(span, work per stage): the seconds at peak a table schedule's ticks take, each tick as long as the busiest
  stage's work in it, and each stage's work. What the executor (pipeline/executor.py) runs where: a
  chunk's forward F; its whole backward B = 2 F, plus F where b recomputes the chunk (train.pipeline_recompute,
  or train.remat=full); split, b = F (+ F recomputed) and W = F. Virtual stage 0 also runs what lies before the
  pipelined stack (the other layer stack) in its F, and in its backward again with that part's backward (and a
  third time in a paired tick, train.pipeline_overlap); the last virtual stage runs what lies after (MTP, the
  head, the loss), forward and backward, in the tick of its F. So the stages that hold the first and the last
  virtual stage set the pace of every tick they work in (DeepSeek-V3 on 16 stages: stage 0 runs 3 dense layers
  beside its 4 MoE layers). The identity layers that pad a stack run like the others, or not at all where the
  executor skips them (`stages.skips_padding`: 1F1B's last stage, which runs the head, holds them)."""
  from jaxseek.pipeline import stages as pipeline_lib
  from jaxseek.pipeline import tables

  cfg, m, t = model.cfg, model.cfg.model, model.cfg.train
  S, M = sizes["pipeline"], t.microbatches
  n = {"dense_layers": m.num_dense_layers, "moe_layers": m.num_moe_layers}[stack]
  R = pipeline_lib.stack_repeats(n, S, t.pipeline_repeats)
  table = tables.for_config(cfg, S, R)
  fp8 = fp8_runs(cfg, hw)

  def seconds(part: str) -> float:  # the part's training FLOPs per token at peak
    flops, recipe = model.flops_by_part.get(part, (0.0, 0.0))
    recipe = recipe if fp8 else 0.0
    return (flops - recipe) / (hw.peak_tflops * 1e12) + (recipe / (hw.fp8_tflops * 1e12) if recipe else 0.0)

  tokens = t.batch_size * t.seq_len / math.prod(sizes.values()) * S / M  # one microbatch on a stage's device
  order = ("dense_layers", "moe_layers", "mtp_layers", "head")
  before, after = order[:order.index(stack)], order[order.index(stack) + 1:]
  layer = seconds(stack) / n / 3 * tokens  # one layer's forward
  C = pipeline_lib.stored_layers(n, S, t.pipeline_repeats) // (S * R)
  # the layers a chunk runs: identity padding (the last storage rows) is skipped where the executor skips it
  real = pipeline_lib.chunk_layers(n, S, t.pipeline_repeats) if pipeline_lib.skips_padding(cfg) else np.full((S, R), C)
  chunk = lambda c: np.where(c >= 0, real[np.arange(S)[None], np.maximum(c, 0)], 0) * layer
  first = sum(seconds(p) for p in before) / 3 * tokens  # its forward
  last = sum(seconds(p) for p in after) * tokens  # forward and backward
  again = float(t.pipeline_recompute or t.remat == "full")
  virtual = lambda chunk: np.where(chunk >= 0, table.virtual[np.arange(S)[None], np.maximum(chunk, 0)], -1)
  fv, bv = virtual(table.f_chunk), virtual(table.b_chunk)
  f, b = chunk(table.f_chunk), chunk(table.b_chunk)
  cost = f + np.where(fv == 0, first, 0.0) + np.where(fv == S * R - 1, last, 0.0)
  cost = cost + (b if table.split else 2 * b) + b * again + np.where(bv == 0, 3 * first, 0.0)
  if table.split:
    cost = cost + chunk(table.steps["w_chunk"])
  elif tables.pairs(cfg):  # a paired backward on virtual stage 0 runs the first part's forward once more
    cost = cost + np.where((bv == 0) & table.paired(), first, 0.0)
  return float(cost.max(axis=1).sum()), [float(w) for w in cost.sum(axis=0)]


def fp8_runs(cfg, hw: Hardware) -> bool:
  """Whether train.fp8 runs float8 GEMMs on `hw` (blockwise is emulated in the compute dtype)."""
  from jaxseek.kernels import fp8_gemm

  recipe = fp8_gemm.resolve(cfg.train.fp8, "gpu", hw.capability)
  return recipe not in (None, "blockwise") and bool(hw.fp8_tflops)


def step_seconds(compute: dict[str, float], comm: dict[str, list[dict[str, Any]]]) -> float:
  return compute["time_s"] + compute["bubble_s"] + sum(c["time_s"] for items in comm.values() for c in items)
