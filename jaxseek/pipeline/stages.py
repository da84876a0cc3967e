"""Pipeline parallelism over the `pipeline` mesh axis: a layer stack split into S stages, GPipe or circular.

GPipe (`train.pipeline_repeats=1`): stage s holds layers [s·L/S, (s+1)·L/S) of a stack. The batch is split into M
microbatches (rows m, m + M, m + 2M, … form microbatch m, so each keeps rows on every data shard). At tick t
every stage runs its layers on the activation it holds, stage s working on microbatch t − s; then each stage
passes its output to the next with `ppermute` (a collective-permute), and stage 0 takes a new microbatch.

Circular (`train.pipeline_repeats=R > 1`): the stack is cut into S·R chunks of C = L/(S·R) layers, and stage s
holds chunks s, S + s, 2S + s, … (virtual stages). A microbatch goes round the ring R times; each tick a stage
runs one chunk (1/R of its layers), so the fill and drain ticks are R times shorter. Work items (microbatch m,
round r) reach stage s at tick s + k with k = g·R·S + r·S + i, m = g·S + i: microbatches go in groups of S, and
the ring's wrap-around (stage S − 1 → stage 0) delivers round r − 1's output exactly when round r needs it.

  bubble fraction = (S − 1) / (R·M + S − 1)   of every stage's ticks (M a multiple of S; R = 1 is GPipe)

Ticks whose work item falls outside the batch are the bubble: their results are discarded, and their MoE loads
and balance terms masked out. The schedule is one `lax.scan` over ticks inside a `jax.shard_map` that is manual
over `pipeline` only, so the other axes (data, fsdp, expert, tensor) keep their automatic sharding and the MoE's
own shard_map nests inside. Autodiff turns each forward ppermute into the reverse one, so the backward pass
runs the same schedule in reverse (all forwards, then all backwards).

Storage order: with R > 1 each device must hold non-contiguous layers. A stack's "layers" axis stays sharded in
contiguous blocks on `pipeline`, so its storage position p = (s, r, c) (row-major [S, R, C]) holds logical layer
(r, s, c) (row-major [R, S, C]); `storage_order` gives that map. New parameters are put in storage order at
initialisation; checkpoints record the layout they were written with and are re-ordered on restore and export
(`reorder`), so a checkpoint moves between any pipeline settings and to Hugging Face in logical order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxseek.config import Config
from jaxseek.errors import UserError
from jaxseek.pipeline import tables, wsplit
from jaxseek.sharding import rules
from jaxseek.sharding.rules import PIPELINE_AXIS as AXIS
from jaxseek.sharding.rules import shard

ONE_F_ONE_B = ("1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev")  # the pipeline_schedule values tables.py runs


def stages() -> int:
  """Size of the pipeline axis of the active mesh (1 without a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty or AXIS not in mesh.axis_names else mesh.shape[AXIS]


def splits_batch(cfg: Config, sizes: dict[str, int]) -> bool:
  """Whether the parts outside the schedule split the batch over the stages too (pipeline × data × fsdp ×
  expert divides it); otherwise they run data-parallel over data × fsdp × expert alone, every stage on the same
  rows (what a batch like DeepSeek-V3's 15,360 sequences on 16 stages × 128 needs)."""
  S = sizes.get(AXIS, 1)
  return S <= 1 or cfg.train.batch_size % (S * sizes["data"] * sizes["fsdp"] * sizes["expert"]) == 0


def batch_rules(cfg: Config, sizes: dict[str, int]):
  """The context to trace a step in (and make its batch shardings in): the pipeline axis left out of the batch
  when it does not split it (splits_batch)."""
  return contextlib.nullcontext() if splits_batch(cfg, sizes) else rules.reserved(AXIS)


def stack_repeats(num_layers: int, num_stages: int, repeats: int) -> int:
  """Rounds a stack of `num_layers` makes: 0 when it is not pipelined (S does not divide it and it has fewer than
  2·S layers: its own schedule would add a bubble for one or two layers a stage, so it runs on every stage);
  `repeats` when S·R divides it, or when S does not and it has at least S·R layers (padded); else 1 (GPipe)."""
  if num_stages <= 1 or not num_layers or (num_layers % num_stages and num_layers < 2 * num_stages):
    return 0
  if num_layers % (num_stages * repeats) == 0:
    return repeats
  if num_layers % num_stages == 0:
    return 1
  return repeats if num_layers >= num_stages * repeats else 1


def stored_layers(num_layers: int, num_stages: int, repeats: int) -> int:
  """Rows a stack stores: its layers, padded with identity layers (all-zero parameters) to a multiple of S·R when
  it is pipelined and S·R does not divide it."""
  unit = num_stages * stack_repeats(num_layers, num_stages, repeats)
  return -(-num_layers // unit) * unit if unit else num_layers


def chunk_layers(num_layers: int, num_stages: int, repeats: int) -> np.ndarray:
  """[S, R]: how many layers chunk r of stage s holds, the rest of its rows identity padding (padding takes the
  last storage positions, `storage_order`, so a chunk's padding follows its layers)."""
  R, P = max(stack_repeats(num_layers, num_stages, repeats), 1), stored_layers(num_layers, num_stages, repeats)
  return (np.arange(P) < num_layers).reshape(num_stages, R, -1).sum(-1)


def skips_padding(cfg: Config) -> bool:
  """Whether a chunk skips its identity padding layers (their rows all zero: they would add nothing) instead of
  running them: under the table schedules whose backward recomputes the chunk whole (1F1B and interleaved 1F1B
  with train.pipeline_recompute) in unpaired ticks. Padding is the last storage rows, so under 1F1B it lands on
  the last stage, which also runs the head and the loss. Where the backward is split into b and W (the
  zero-bubble schedules, 1F1B keeping the forward's residuals) or paired ticks interleave two chunks' layers,
  the padding runs as layers."""
  from jaxseek.pipeline import tables

  t = cfg.train
  return t.pipeline_schedule in tables.WHOLE_BACKWARD and t.pipeline_recompute and not tables.pairs(cfg)


def num_ticks(num_stages: int, microbatches: int, repeats: int) -> int:
  """Ticks of the schedule: the last work item k_max starts on stage 0 and ends S − 1 ticks later."""
  S, M, R = num_stages, microbatches, max(repeats, 1)
  if R == 1:
    return M + S - 1
  groups = -(-M // S)
  return (groups - 1) * R * S + (R - 1) * S + (M - (groups - 1) * S - 1) + S


WORK = {"zb_h1": 3, "zbv": 6, "dualpipev": 6}  # a microbatch's work on a stage at F = b = W = 1, in chunk forwards
FORMULA = {"zb_h1": "(S-1)/(3M+S-1)", "zbv": "(S-1)/(6M+S-1)", "dualpipev": "(S-1)/(6M+S-1)"}


def bubble(schedule: str, S: int, M: int, R: int = 1) -> float:
  """The share of every stage's time spent idle, in closed form: the fill and drain (S − 1 ticks) against a
  stage's work of w·M ticks,

      bubble = (S − 1) / (w·M + S − 1),   w = R for GPipe, circular, 1F1B and interleaved 1F1B (R chunks),
                                          3 for ZB-H1, 6 for ZB-V and DualPipeV (F = b = W = 1 per chunk)

  GPipe and circular (any schedule without a table) count 1 − R·M / ticks, the same when S divides M (else the
  last group of microbatches is partial). ZB-H1's and ZB-V's are Qi et al.'s; DualPipeV's W fill its warm-up and
  drain as ZB-V's do, its F&B pairs run one op a tick. They hold from M = S on (DualPipeV: M = 2S), interleaved
  1F1B's when S divides M; elsewhere the table's count (tables.Table.bubble) is the bubble."""
  if schedule not in ONE_F_ONE_B:
    return 1 - max(R, 1) * M / num_ticks(S, M, R)
  return (S - 1) / (WORK.get(schedule, max(R, 1)) * M + S - 1)


def storage_order(num_layers: int, num_stages: int, repeats: int, shape: str = "ring") -> np.ndarray:
  """The logical layer held at each storage position of a stack; values ≥ num_layers are padding, always the last
  positions (so the real layers of any layout are rows [0, num_layers)). The schedule visits position (s, r, c)
  in the order of its virtual stage — r·S + s on the ring, s for r = 0 and 2S − 1 − s for r = 1 on the V
  (DualPipeV) — then c; the real layers are assigned in that visiting order."""
  R, P = stack_repeats(num_layers, num_stages, repeats), stored_layers(num_layers, num_stages, repeats)
  if R <= 1:
    return np.arange(P)
  s, r = np.arange(num_stages)[:, None], np.arange(R)[None, :]
  virtual = np.where(r == 0, s, 2 * num_stages - 1 - s) if shape == "v" else r * num_stages + s  # [S, R]
  visit = np.arange(P).reshape(num_stages * R, -1)[np.argsort(virtual, axis=None)].reshape(-1)  # schedule order
  order = np.arange(P)
  order[visit[visit < num_layers]] = np.arange(num_layers)
  return order


Layout = tuple[int, int, str]  # (pipeline stages, repeats, "ring" | "v") a state was stored with


def shape(cfg: Config) -> str:
  """How the chunks sit on the stages: on a V for DualPipeV (stage s holds virtual stages s and 2S − 1 − s), else
  on a ring (r·S + s)."""
  return "v" if cfg.train.pipeline_schedule in ("zbv", "dualpipev") else "ring"


def layout(cfg: Config, num_stages: int) -> Layout:
  return (num_stages, cfg.train.pipeline_repeats, shape(cfg))


def saved_layout(saved_config: dict) -> Layout:
  """The layout recorded with a checkpoint (checkpoints without one are in logical order)."""
  stored = saved_config.get("storage", {})
  return (stored.get("pipeline_stages", 1), stored.get("pipeline_repeats", 1), stored.get("pipeline_shape", "ring"))


def reorder_index(path: tuple, num_layers: dict[str, int], source: Layout, target: Layout) -> np.ndarray | None:
  """For a leaf at `path` under a stack (params, biases, optimiser moments: any stack of model/transformer.py STACKS): the gather along
  its leading "layers" axis from the storage order of `source` to that of `target`, -1 where the target holds
  padding (zeros); None when nothing moves. The source may be cut or zero-extended to the target's length first:
  its real layers are its first rows."""
  names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  stack = next((n for n in names if n in num_layers), None)
  if stack is None:
    return None
  n = num_layers[stack]
  src, dst = storage_order(n, *source), storage_order(n, *target)
  if np.array_equal(src, dst):
    return None
  found = np.argsort(src)[:n]  # the source position of each logical layer (all < n)
  return np.where(dst < n, found[np.minimum(dst, n - 1)], -1)


def relayout_index(num_layers: int, source: Layout, target: Layout) -> np.ndarray | None:
  """The gather along a stack's "layers" axis from `source`'s storage order to `target`'s (same stored length),
  None when nothing moves."""
  src, dst = storage_order(num_layers, *source), storage_order(num_layers, *target)
  return None if np.array_equal(src, dst) else np.argsort(src)[dst]


def resized_stacks(model_cfg, source: Layout, target: Layout) -> tuple[str, ...]:
  """The stacks stored with a different number of rows (padding) under the two layouts."""
  return tuple(name for name, n in stack_sizes(model_cfg).items()
               if stored_layers(n, *source[:2]) != stored_layers(n, *target[:2]))


def take_rows(leaf: jax.Array, index: np.ndarray) -> jax.Array:
  """Rows `index` of `leaf` (leading axis); -1 gives a row of zeros (identity padding)."""
  out = jnp.take(leaf, np.maximum(index, 0), axis=0)
  if (index < 0).any():
    keep = (index >= 0).reshape(-1, *([1] * (leaf.ndim - 1)))
    out = jnp.where(keep, out, 0)  # a weakly typed 0 keeps the leaf's dtype
  return out


def reorder(tree: Any, num_layers: dict[str, int], source: Layout, target: Layout) -> Any:
  """`tree` with every stack leaf moved from the storage order of `source` to that of `target` (padding added or
  dropped as the target needs)."""

  def one(path, leaf):
    index = reorder_index(path, num_layers, source, target)
    return leaf if index is None else take_rows(leaf, index)

  return jax.tree_util.tree_map_with_path(one, tree)


def stack_sizes(model_cfg) -> dict[str, int]:
  return {"dense_layers": model_cfg.num_dense_layers, "moe_layers": model_cfg.num_moe_layers}


def pipelined_stack(model_cfg, num_stages: int, repeats: int) -> str:
  """The one stack a 1F1B schedule pipelines (the other runs on every stage, before or after it)."""
  sizes = {k: n for k, n in stack_sizes(model_cfg).items() if stack_repeats(n, num_stages, repeats)}
  return max(sizes, key=sizes.get)


def check_stacks(cfg: Config, stages: int) -> None:
  """Refuses a pipeline longer than every layer stack (nothing would be pipelined), and repeats no stack can make
  (each stage would need R chunks of at least one layer), and a split backward the installed JAX cannot run."""
  m, R = cfg.model, cfg.train.pipeline_repeats
  if stages > 1 and cfg.train.pipeline_schedule in tables.SPLIT:
    wsplit.check("train.pipeline_schedule", cfg.train.pipeline_schedule)
  counts = f"({m.num_dense_layers} dense, {m.num_moe_layers} MoE layers)"
  if stages > 1 and not any(stack_repeats(n, stages, 1) for n in (m.num_dense_layers, m.num_moe_layers)):
    raise UserError(f"config key mesh.pipeline: {stages} stages split neither layer stack {counts}; a stack is "
                    f"split when the stage count divides it or it has at least twice as many layers")
  piped = [n for n in (m.num_dense_layers, m.num_moe_layers) if stages > 1 and stack_repeats(n, stages, R)]
  if cfg.train.pipeline_schedule in ONE_F_ONE_B and len(piped) > 1:
    raise UserError(f"config key train.pipeline_schedule: {cfg.train.pipeline_schedule} pipelines one layer stack, "
                    f"and {stages} stages split both {counts}; choose a stage count that splits only the larger "
                    f"stack, or the gpipe schedule")
  if cfg.train.pipeline_schedule in ("zbv", "dualpipev") and stages > 1 and piped and stack_repeats(
      max(m.num_dense_layers, m.num_moe_layers), stages, R) != 2:
    n = max(m.num_dense_layers, m.num_moe_layers)
    raise UserError(f"config key train.pipeline_schedule: {cfg.train.pipeline_schedule} cuts the pipelined stack into 2 x {stages} "
                    f"chunks, and its {n} layers on {stages} stages make one chunk a stage; choose mesh.pipeline so "
                    f"that 2 x stages divides {n}, or the 1f1b schedule")
  if stages > 1 and R > 1 and not any(stack_repeats(n, stages, R) == R for n in (m.num_dense_layers, m.num_moe_layers)):
    raise UserError(f"config key train.pipeline_repeats: {R} repeats x {stages} stages exceed both layer stacks "
                    f"{counts}; choose R with mesh.pipeline x R at most the larger stack's layer count, or 1")


def unit_bubble(name: str, S: int, M: int, stashes: int = 0) -> tuple[float, str]:
  """The bubble at F = b = W = 1 counted on the unit order's table, and the closed form (FORMULA, `bubble`) where
  the table meets it, else ""."""
  unit = tables.zero_bubble_order(name, S, M, packed=False, stashes=stashes).bubble()
  return unit, FORMULA[name] if math.isclose(unit, bubble(name, S, M), abs_tol=1e-9) else ""


TABLE_SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2), ("dualpipev", 2))


def compare(cfg: Config, stages: int, layer_flops: float | None = None) -> list[dict]:
  """The table schedules this model's pipelined stack can run on `stages` stages with cfg's microbatches, side
  by side, from the tables the step would run: the bubble under the executor's costs (F = 1, a whole backward 2,
  b 2 and W 1: every table recomputes a chunk's forward in its backward) and at F = b = W = 1 (unit orders, for
  a backward that would not recompute), each split table both ways (`recompute`: train.pipeline_recompute), the
  slots a stage keeps (stage inputs, cotangents, stashes for W, forward residuals for b) with
  the layers in a chunk, and (with `layer_flops`, a layer's forward FLOPs for one microbatch) the FLOPs a stage
  runs per step, counted per executed op: f one forward, b a forward and the input's gradient, W the weights'
  gradient, a whole backward all three (each matmul's backward costs twice its forward: b and W one each)."""
  m, M = cfg.model, cfg.train.microbatches
  name = pipelined_stack(m, stages, 1)
  n = stack_sizes(m)[name] if name else 0
  rows = []
  for schedule, R in TABLE_SCHEDULES:
    if not n or stack_repeats(n, stages, R) != R:
      continue
    for recompute in (True, False):
      table = tables.table(schedule, stages, M, R, recompute=recompute)
      unit = unit_bubble(schedule, stages, M)[0] if schedule in tables.SPLIT else table.bubble()
      chunk = stored_layers(n, stages, R) // (stages * R)
      ops = {k: int((table.steps[f"{k}_micro"][:, 0] >= 0).sum()) for k in ("f", "b", "w")
             if f"{k}_micro" in table.steps}
      # in forwards of a chunk: b recomputes the forward unless F kept its residuals
      per_op = {"f": 1, "b": 2 if recompute else 1, "w": 1} if table.split else {"f": 1, "b": 3}
      row = {"schedule": schedule, "recompute": recompute, "chunks_per_stage": R, "layers_per_chunk": chunk,
             "bubble": table.bubble(), "unit_bubble": unit, "ticks": table.ticks,
             **{f"kept_{k}": v for k, v in {"residuals": 0, **table.kept()}.items()}}
      if layer_flops is not None:
        row["flops_per_stage"] = sum(per_op[k] * c for k, c in ops.items()) * chunk * layer_flops
      rows.append(row)
  return rows


def summary(cfg: Config, stages: int, sizes: dict[str, int] | None = None) -> str:
  """One line: the schedule, its bubble, what it keeps alive, which layer stacks are pipelined, and (with the
  mesh `sizes`) whether the parts outside the schedule split the batch over the stages."""
  m, M, R = cfg.model, cfg.train.microbatches, cfg.train.pipeline_repeats
  stacks, rounds = [], set()
  for name, n in (("dense", m.num_dense_layers), ("MoE", m.num_moe_layers)):
    if n:
      r = stack_repeats(n, stages, R)
      rounds.add(r)
      padding = stored_layers(n, stages, R) - n
      where = "with the first virtual stage, on stage 0" if cfg.train.pipeline_schedule in ONE_F_ONE_B else \
          "on every stage"
      stacks.append(f"{name} stack ({n} layers) {where}" if not r else
                    f"{name} stack {stored_layers(n, stages, R) // stages} layers per stage" +
                    (f" in {r} chunks" if r > 1 else "") + (f" ({padding} identity padding{', skipped' if skips_padding(cfg) else ', run'})"
                     if padding else ""))
  r = max(rounds)
  formula = "(S-1)/(M+S-1)" if r <= 1 else "(S-1)/(R*M+S-1)" if M % stages == 0 else "1-R*M/ticks"
  if cfg.train.pipeline_schedule in ONE_F_ONE_B:
    table = tables.for_config(cfg, stages, r)
    name, v = cfg.train.pipeline_schedule, shape(cfg) == "v"
    schedule = {"dualpipev": "DualPipeV, DeepSeek's order on a V, backward split into b and W",
                "zbv": "ZB-V, 2 chunks on a V, backward split into b and W",
                "zb_h1": "ZB-H1, backward split into b and W"}.get(
        name, "1F1B" if r <= 1 else f"interleaved 1F1B, {r} chunks")
    whole = name in tables.WHOLE_BACKWARD  # 1F1B: a kept forward's backward runs b and W in one tick
    stash = f" + {table.stash_slots} stashes for W" if table.split and not whole else ""
    keeps = (f"{table.slots} microbatch stage inputs + {table.grad_slots} cotangents{stash} kept per stage, layers "
             f"recomputed in the backward; head and loss on the {'first' if v else 'last'} stage")
    if table.residual_slots:
      keeps = (f"{table.residual_slots} chunks' forward residuals + {table.slots} stage inputs + "
               f"{table.grad_slots} cotangents{stash} kept per stage (no recomputation); head and loss on the "
               f"{'first' if v else 'last'} stage")
      if not whole:
        closed = unit_bubble(name, stages, M, cfg.train.pipeline_stashes)[1]
        formula = f"of the table run (F=b=W=1{'; ' + closed if closed else ''})"
    elif table.split:
      unit, closed = unit_bubble(name, stages, M, cfg.train.pipeline_stashes)
      formula = (f"of the table run (F=1, b=2 as it recomputes the forward, W=1; at F=b=W=1 "
                 f"{closed + ' = ' if closed else ''}{100 * unit:.1f}%)")
    idle = bubble(name, stages, M, r) if (not table.split or whole) and (M % stages == 0 or r <= 1) else \
        table.bubble()
    if tables.pairs(cfg) and table.paired().any():
      keeps += (f"; {100 * table.paired().mean():.0f}% of a stage's ticks run a "
                f"forward beside a backward in one program (train.pipeline_overlap: each exchange beside the other's "
                f"compute; the backward a tick after the loss)")
  else:
    schedule = "GPipe" if r <= 1 else f"circular, {r} repeats"
    keeps = "all microbatches' activations kept until the backward; embedding, head and MTP run on every stage"
    idle = bubble(cfg.train.pipeline_schedule, stages, M, r)
  outside = ""
  if sizes is not None and not splits_batch(cfg, sizes):
    shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    outside = (f" | train.batch_size={cfg.train.batch_size} is not divisible by pipeline x data x fsdp x expert = "
               f"{stages * shards}: outside the schedule the batch is split over data x fsdp x expert = {shards} "
               f"only, every stage computing the same rows")
  return (f"pipeline: {stages} stages x {M} microbatches ({schedule}), bubble {formula} = {100 * idle:.1f}% | "
          f"{', '.join(stacks)}; {keeps}; weights outside the pipelined stack stored 1/{stages} per stage{outside}")


def split_microbatches(x: jax.Array, m: int) -> jax.Array:
  """[B, ...] → [M, B/M, ...], microbatch j = rows j, j + M, j + 2M, …"""
  return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def merge_microbatches(x: jax.Array) -> jax.Array:
  """Inverse of split_microbatches."""
  return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def run(body: Callable, layer_state, x_BTD: jax.Array, side: tuple, microbatches: int, repeats: int = 1,
        per_row: tuple[str, ...] = ("balance",), num_layers: int | None = None):
  """Runs `body(x_bTD, layer_state_l, side) → (x_bTD, aux_l: dict)` over all layers as a pipeline.

  `layer_state` leaves are [L, ...] in storage order (sharded on `pipeline`); `side` holds per-row inputs
  [B, ...] (or None) that every layer reads. Returns (x_BTD, aux) as a scan over the layers would, with aux in
  storage order: entries named in `per_row` (per-sequence terms [L, b] per microbatch) are reassembled into
  [L, B]; the others (expert loads, dropped counts) are summed over the microbatches. Rows from `num_layers` on
  are identity padding (all-zero parameters): their aux entries are zeroed.
  """
  S, M, R = stages(), microbatches, max(repeats, 1)
  x_MbTD = split_microbatches(x_BTD, M)
  side_M = jax.tree.map(lambda a: split_microbatches(a, M), side)
  items = -(-M // S) * R * S if R > 1 else M  # work items per stage, bubble items included

  def per_stage(state_local, x_MbTD, side_M):
    s = jax.lax.axis_index(AXIS)
    chunks = jax.tree.map(lambda a: a.reshape(R, a.shape[0] // R, *a.shape[1:]), state_local)  # [R, C, ...]

    def stage(x_bTD, side_b, chunk):
      return jax.lax.scan(lambda h, layer: body(h, layer, side_b), x_bTD, chunk)

    (_, aux_shape) = jax.eval_shape(stage, x_MbTD[0], jax.tree.map(lambda a: a[0], side_M),
                                    jax.tree.map(lambda a: a[0], chunks))
    rows = {k: k in per_row for k in aux_shape}

    def tick(carry, t):
      held_bTD, aux_acc = carry
      r, mc, valid = work_item(t - s, S, M, R, items)
      x_bTD = jnp.where((s == 0) & (r == 0), x_MbTD[mc], held_bTD)
      y_bTD, aux = stage(x_bTD, jax.tree.map(lambda a: a[mc], side_M), jax.tree.map(lambda a: a[r], chunks))
      aux_acc = jax.tree.map(
          lambda acc, a, per: jnp.where(valid, acc.at[r, :, mc].set(a) if per else acc.at[r].add(a), acc),
          aux_acc, aux, rows)
      held_bTD = jax.lax.ppermute(y_bTD, AXIS, [(i, (i + 1) % S) for i in range(S)])
      return (held_bTD, aux_acc), y_bTD  # outputs leave per tick, not in the carry (which autodiff saves per tick)

    aux_zero = jax.tree.map(
        lambda a, per: jnp.zeros((R, a.shape[0], M, *a.shape[1:]) if per else (R, *a.shape), a.dtype),
        aux_shape, rows)
    init = (jnp.zeros_like(x_MbTD[0]), aux_zero)
    (_, aux_acc), y_tbTD = jax.lax.scan(tick, init, jnp.arange(num_ticks(S, M, R)))
    # the last stage's outputs, shared (replicated over `pipeline` from here on)
    out_MbTD = jax.lax.psum(jnp.where(s == S - 1, y_tbTD[finish_ticks(S, M, R)], 0), AXIS)
    aux_acc = jax.tree.map(lambda a: a.reshape(R * a.shape[1], *a.shape[2:]), aux_acc)  # [R, C] → storage rows
    aux_acc = {k: merge_rows(a) if rows[k] else a for k, a in aux_acc.items()}
    return out_MbTD, aux_acc

  out_MbTD, aux = jax.shard_map(per_stage, in_specs=(P(AXIS), P(), P()), out_specs=(P(), P(AXIS)),
                                axis_names={AXIS}, check_vma=False)(layer_state, x_MbTD, side_M)
  # the output is on every stage; from here on each stage takes its share of the batch again (rows of every
  # microbatch split over pipeline × data × …, which after merging is the batch's own split)
  out_MbTD = shard(out_MbTD, (None, "batch", "length", "embed"))
  return merge_microbatches(out_MbTD), zero_padding_rows(aux, jax.tree.leaves(layer_state)[0].shape[0], num_layers)


@dataclasses.dataclass(frozen=True)
class StackRunner:
  """The model's `run_stack` hook (model/transformer.py Stack) for a GPipe or circular schedule: runs a layer
  stack as a pipeline on a mesh whose pipeline axis splits it, else returns None (the model's own scan)."""

  microbatches: int
  repeats: int
  shape: str = "ring"  # "v": layers stored for DualPipeV, run here in the circular order

  def __call__(self, body: Callable, layer_state, x_BTD: jax.Array, side: tuple, num_layers: int):
    repeats = stack_repeats(num_layers, stages(), self.repeats)
    if not repeats:
      return None
    layout = (stages(), self.repeats)
    ring = relayout_index(num_layers, (*layout, self.shape), (*layout, "ring"))
    if ring is not None:  # a forward outside DualPipeV's own schedule (evaluation): the V's layers gathered
      # into ring order at each call (the rows that change stage cross the pipeline axis)
      layer_state = jax.tree.map(lambda a: jnp.take(a, ring, axis=0), layer_state)
    out, aux = run(body, layer_state, x_BTD, side, self.microbatches, repeats, num_layers=num_layers)
    return out, aux if ring is None else jax.tree.map(lambda a: jnp.take(a, np.argsort(ring), axis=0), aux)


def stack_runner(cfg: Config) -> StackRunner:
  """The `run_stack` of cfg's pipeline (model.build): its microbatches, repeats and how chunks sit on stages."""
  return StackRunner(cfg.train.microbatches, cfg.train.pipeline_repeats, shape(cfg))


def work_item(k: jax.Array, S: int, M: int, R: int, items: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A stage's k-th work item (k = tick − stage): (round r, microbatch m clipped to [0, M), whether it is real
  work rather than a bubble). With R rounds, S microbatches at a time go round all R chunks before the next S."""
  kc = jnp.clip(k, 0, items - 1)
  r, m = (kc % (R * S)) // S, (kc // (R * S)) * S + kc % S
  if R == 1:
    r, m = jnp.zeros_like(kc), kc
  return r, jnp.clip(m, 0, M - 1), (k >= 0) & (k < items) & (m < M)


def finish_ticks(S: int, M: int, R: int) -> np.ndarray:
  """The tick at which the last stage finishes each microbatch m: S − 1 + its last round's work item."""
  m = np.arange(M)
  return S - 1 + ((m // S) * R * S + (R - 1) * S + m % S if R > 1 else m)


def zero_padding_rows(aux: dict, stored: int, num_layers: int | None) -> dict:
  """aux with the rows of identity padding layers (from `num_layers` on) zeroed."""
  if num_layers is None or num_layers >= stored:
    return aux
  real = np.arange(stored) < num_layers
  return jax.tree.map(lambda a: jnp.where(real.reshape(-1, *([1] * (a.ndim - 1))), a, jnp.zeros((), a.dtype)), aux)


def merge_rows(a_lMb: jax.Array) -> jax.Array:
  """[l, M, b, ...] per-microbatch rows → [l, B] in the original row order."""
  return jax.vmap(merge_microbatches)(a_lMb)
