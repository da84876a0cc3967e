"""Pipeline parallelism over the `pipeline` axis (GPipe and circular schedules) against the single-device run."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config, run_steps
from jaxseek import checkpoint as checkpoint_lib
from jaxseek import train as train_lib
from jaxseek import step as step_lib
from jaxseek.errors import UserError
from jaxseek.explore import compile as explore_compile
from jaxseek.input import GlobalBatches, global_batches
from jaxseek.pipeline import restgrads, tables
from jaxseek.pipeline import stages as pipeline
from jaxseek.sharding.mesh import make_mesh

STEPS = 5


def run(name, overrides, devices=None, steps=STEPS):
  cfg = load_config(name, *overrides)
  mesh = make_mesh(cfg, devices)
  trainer, state = step_lib.init_state(cfg, mesh)
  _, records = run_steps(cfg, mesh, trainer, state, global_batches(cfg, mesh), steps)
  # per-MoE-layer loads and biases too: they must come back in layer order from any storage order
  return np.array([[float(m["loss"]), float(m["grad_norm"]),
                    *np.ravel(m.get("moe_load_max_over_mean_by_layer", [])),
                    *np.ravel(m.get("moe_bias_range_by_layer", []))] for m in records])


# AdamW's eps for the exactness tests. The pipelined and the single-device programs sum a gradient in different
# orders, so its entries differ by up to ~1e-6 of the leaf's largest (tiny dense, 8 layers, ZB-V: 2e-8 of 0.019).
# m/(√v + eps) changes by up to that difference over eps, in steps: with eps = 1e-8 an entry that cancels to about
# eps (-9.7e-9 on one device, -1.03e-8 pipelined) moves its weight 2.3e-5 apart in the first step, and 4 steps
# later the gradient norms differ by 1.07e-5 (seed 0). eps = 1e-5 bounds that gain to ~2e-3 of a step (the same
# case: 2.8e-6) and leaves AdamW as it is for every entry above 1e-5 (the median is 2.3e-3); nothing in the
# pipeline reads it.
EXACT = ("optim.eps=1e-5",)


@functools.lru_cache(maxsize=None)
def single_device(name, layers):
  return run(name, ("mesh.data=1", f"model.num_hidden_layers={layers}", *EXACT), jax.devices()[:1])


def selection_margin(logits_XE, bias_E, routing):
  """[X]: the smallest gap by which moe.route decides each token's experts: between the last kept and the first
  dropped group score (group-limited routing), and between the K-th and the (K+1)-th selection score in the kept
  groups."""
  scores_XE = jax.nn.sigmoid(logits_XE) if routing.scoring_func == "sigmoid" else jax.nn.softmax(logits_XE, -1)
  choice_XE = scores_XE + (0 if bias_E is None else bias_E)
  X, E = choice_XE.shape
  gaps = []
  if routing.topk_method != "greedy" and 1 < routing.n_group:
    grouped_XGe = choice_XE.reshape(X, routing.n_group, E // routing.n_group)
    group_XG = (jax.lax.top_k(grouped_XGe, 2)[0].sum(-1) if routing.topk_method == "noaux_tc"
                else grouped_XGe.max(-1))
    if routing.topk_group < routing.n_group:
      top_XG = jax.lax.top_k(group_XG, routing.topk_group + 1)[0]
      gaps.append(top_XG[:, -2] - top_XG[:, -1])
    keep_XG = group_XG >= jax.lax.top_k(group_XG, routing.topk_group)[0][:, -1:]
    choice_XE = jnp.where(keep_XG[..., None], grouped_XGe, -jnp.inf).reshape(X, E)
  top_XK = jax.lax.top_k(choice_XE, routing.num_experts_per_tok + 1)[0]
  gaps.append(top_XK[:, -2] - top_XK[:, -1])
  return jnp.min(jnp.stack(gaps), axis=0)


def routing_margins(name, overrides, steps=STEPS):
  """Per step, the selection margins (selection_margin) of every MoE layer's routing of every token in the
  single-device run of `overrides` (empty for a model without routing)."""
  from jaxseek.model import moe

  per_step, route = [], moe.route

  def recorded(logits_XE, bias_E, routing, *rest):
    jax.debug.callback(lambda m: per_step[-1].append(np.asarray(m)), selection_margin(logits_XE, bias_E, routing))
    return route(logits_XE, bias_E, routing, *rest)

  cfg = load_config(name, *overrides)
  mesh = make_mesh(cfg, jax.devices()[:1])
  moe.route = recorded
  try:
    trainer, state = step_lib.init_state(cfg, mesh)
    step_fn, batches = step_lib.compile_step(trainer, cfg, mesh), global_batches(cfg, mesh)
    with jax.set_mesh(mesh):
      for _ in range(steps):
        per_step.append([])
        state, _ = step_fn(state, next(batches))
        jax.effects_barrier()
  finally:
    moe.route = route
  return [np.concatenate(m) if m else np.zeros(0) for m in per_step]


# Selection scores are float32 of about 0.5 to 1.5 (a unit in the last place 6e-8 to 1.2e-7), and the two programs'
# hidden states differ by about 1e-7 of their size after a few steps: a margin within ten such units may be
# decided the other way.
NEAR_TIE = 1e-6


def assert_trains_as_one_device(got, want, name, reference):
  """got == want at rtol 1e-5 (rows: steps; columns: loss, gradient norm, per-layer loads and bias ranges). If
  not, the message says whether the single-device run (`reference`: its overrides) routed a token by a near-tie
  up to the first step that differs, which the pipelined program's rounding may decide the other way, and whether
  the per-layer MoE statistics differ at that step too (as a token routed elsewhere may make them)."""
  bad = ~np.isclose(got, want, rtol=1e-5, atol=0)
  if not bad.any():
    return
  step, column = (int(i) for i in np.argwhere(bad)[0])
  label = {0: "loss", 1: "gradient norm"}.get(column, f"MoE statistic column {column}")
  margins = routing_margins(name, reference, step + 1)
  if not any(m.size for m in margins):
    cause = "the model routes nothing, so no near-tie explains it"
  else:
    low = min(range(len(margins)), key=lambda k: margins[k].min())
    ties = sum(int((m < NEAR_TIE).sum()) for m in margins)
    moe_stats = "differ too" if bad[step, 2:].any() else "agree"
    cause = (f"up to that step the single-device run routes {ties} token-layer choices by a margin below "
             f"{NEAR_TIE:g} (the smallest {margins[low].min():.2e}, step {low}), which the pipelined program's "
             f"rounding may decide the other way; the per-layer MoE statistics at step {step} {moe_stats}"
             if ties else f"no routing margin up to that step is below {NEAR_TIE:g} (the smallest "
             f"{margins[low].min():.2e}, step {low}), so no near-tie explains it")
  raise AssertionError(f"pipelined training differs from one device's at step {step}, {label}: "
                       f"{float(got[step, column])!r} against {float(want[step, column])!r} (rtol 1e-5); {cause}")


@pytest.mark.parametrize("name, layers, mesh, micro", [
    ("tiny-dense", 4, ("mesh.pipeline=4", "mesh.data=2"), 8),
    ("tiny-v3", 5, ("mesh.pipeline=4", "mesh.data=2"), 8),  # 1 dense layer on every stage, 4 MoE layers piped
    # circular: 2 chunks per stage (layers stored out of order, see pipeline.storage_order)
    ("tiny-dense", 8, ("mesh.pipeline=4", "mesh.data=2", "train.pipeline_repeats=2"), 8),
    ("tiny-v3", 5, ("mesh.pipeline=2", "mesh.data=1", "mesh.expert=2", "mesh.tensor=2",
                    "train.pipeline_repeats=2"), 4),
    ("tiny-v3", 5, ("mesh.pipeline=2", "mesh.data=4", "train.pipeline_repeats=2", "train.remat=full"), 1),
    # stacks the stages do not divide: padded with identity layers (5 dense → 6; 5 MoE → 8 in 2 rounds)
    ("tiny-dense", 5, ("mesh.pipeline=2", "mesh.data=4"), 4),
    ("tiny-v3", 6, ("mesh.pipeline=2", "mesh.data=4", "train.pipeline_repeats=2"), 4),
], ids=["dense-p4-m8", "v3-p4-m8", "dense-p4-r2-m8", "v3-p2e2t2-r2-m4", "v3-p2-r2-m1-remat",
        "dense5-p2-padded", "v3-moe5-p2-r2-padded"])
def test_pipelined_training_equals_single_device(name, layers, mesh, micro):
  """Losses, gradient norms, and per-layer expert loads and bias ranges over 5 steps (so MoE correction biases,
  updated from the loads the pipeline gathers, matter too) equal the single-device run."""
  got = run(name, (*mesh, f"train.microbatches={micro}", f"model.num_hidden_layers={layers}", *EXACT))
  assert_trains_as_one_device(got, single_device(name, layers), name,
                              ("mesh.data=1", f"model.num_hidden_layers={layers}", *EXACT))


ONE_F_ONE_B, INTERLEAVED = "train.pipeline_schedule=1f1b", "train.pipeline_schedule=interleaved_1f1b"
DUALPIPEV = ("train.pipeline_schedule=dualpipev", "train.pipeline_repeats=2")
ZBV, ZB_H1 = ("train.pipeline_schedule=zbv", "train.pipeline_repeats=2"), "train.pipeline_schedule=zb_h1"
KEEP = "train.pipeline_recompute=false"
PAIR = "train.pipeline_overlap=true"


@pytest.mark.parametrize("name, layers, mesh, micro, model", [
    ("tiny-v3", 5, ("mesh.pipeline=4", "mesh.data=2", ONE_F_ONE_B), 8, ()),  # the dense layer before the schedule
    ("tiny-dense", 5, ("mesh.pipeline=2", "mesh.data=4", "train.pipeline_repeats=2", INTERLEAVED), 4, ()),  # 8 rows
    # 5 MoE layers in 6 rows: the last stage skips its identity layer (pipeline.stages.skips_padding), with MTP
    ("tiny-v3", 6, ("mesh.pipeline=2", "mesh.data=2", "mesh.expert=2", ONE_F_ONE_B), 4,
     ("model.num_nextn_predict_layers=1",)),
    ("tiny-v3", 9, ("mesh.pipeline=4", "mesh.data=2", "train.pipeline_repeats=2", INTERLEAVED), 8,
     ()),  # 8 MoE layers in 2 chunks of 1 per stage
    # a tick's forward beside its backward (train.pipeline_overlap): the chunks unrolled outside the conditionals,
    # the backward a tick after the loss
    ("tiny-v3", 5, ("mesh.pipeline=4", "mesh.data=2", ONE_F_ONE_B, PAIR), 8, ()),
    ("tiny-v3", 9, ("mesh.pipeline=4", "mesh.data=2", "train.pipeline_repeats=2", INTERLEAVED, PAIR), 8, ()),
    ("tiny-v3", 5, ("mesh.pipeline=2", "mesh.data=1", "mesh.expert=2", "mesh.tensor=2", ONE_F_ONE_B, PAIR), 4,
     ("model.num_nextn_predict_layers=1",)),
    # zero-bubble tables: the backward split into b and W (M = S < 2S: DeepSeek's order with the missing
    # microbatches left out)
    ("tiny-dense", 8, ("mesh.pipeline=4", "mesh.data=2", *DUALPIPEV), 4, ()),
    ("tiny-dense", 8, ("mesh.pipeline=4", "mesh.data=2", *ZBV), 8, ()),
    ("tiny-dense", 4, ("mesh.pipeline=2", "mesh.data=2", "mesh.tensor=2", ZB_H1), 4, ()),
    ("tiny-v3", 5, ("mesh.pipeline=2", "mesh.data=1", "mesh.expert=2", "mesh.tensor=2", *DUALPIPEV), 4,
     ("model.num_nextn_predict_layers=1",)),  # MTP and the head inside the schedule, tensor-split vocabulary
    ("tiny-v3", 5, ("mesh.pipeline=2", "mesh.data=1", "mesh.expert=2", "mesh.tensor=2", *ZBV), 4, ()),
    ("tiny-v3", 9, ("mesh.pipeline=4", "mesh.data=2", *DUALPIPEV), 8, ()),
    ("tiny-v3", 5, ("mesh.pipeline=4", "mesh.expert=2", ZB_H1), 8, ()),
    # F keeps the forward's residuals for b (the unit orders)
    ("tiny-dense", 8, ("mesh.pipeline=4", "mesh.data=2", *ZBV, KEEP), 8, ()),
    ("tiny-v3", 5, ("mesh.pipeline=2", "mesh.data=1", "mesh.expert=2", "mesh.tensor=2", ZB_H1, KEEP), 4, ()),
    # 1F1B keeping the forward's residuals: nothing recomputed, b and W in the backward's tick
    ("tiny-v3", 9, ("mesh.pipeline=4", "mesh.data=2", "train.pipeline_repeats=2", INTERLEAVED, KEEP), 8, ()),
    ("tiny-dense", 8, ("mesh.pipeline=4", "mesh.data=2", ONE_F_ONE_B, KEEP), 8, ()),
], ids=["v3-p4-m8-1f1b", "dense5-p2-r2-m4-interleaved-padded", "v3-moe5-p2e2-m4-mtp-1f1b-padded",
         "v3-p4-r2-m8-interleaved", "v3-p4-m8-1f1b-paired",
        "v3-p4-r2-m8-interleaved-paired", "v3-p2e2t2-m4-mtp-1f1b-paired", "dense-p4-m4-dualpipev",
        "dense-p4-m8-zbv", "dense-p2t2-m4-zb_h1", "v3-p2e2t2-m4-mtp-dualpipev", "v3-p2e2t2-m4-zbv",
        "v3-p4-m8-dualpipev", "v3-p4e2-m8-zb_h1", "dense-p4-m8-zbv-kept", "v3-p2e2t2-m4-zb_h1-kept",
        "v3-p4-r2-m8-interleaved-kept", "dense-p4-m8-1f1b-kept"])
def test_memory_bounded_schedules_equal_single_device(name, layers, mesh, micro, model):
  """1F1B, interleaved 1F1B and the zero-bubble tables (ZB-H1, ZB-V, DualPipeV: b and W split), recomputing or
  keeping the forward's residuals: losses, gradient norms, per-layer expert loads and bias ranges over 5 steps
  equal the single-device run's."""
  reference = ("mesh.data=1", f"model.num_hidden_layers={layers}", *model, *EXACT)
  got = run(name, (*mesh, f"train.microbatches={micro}", f"model.num_hidden_layers={layers}", *model, *EXACT))
  assert_trains_as_one_device(got, run(name, reference, jax.devices()[:1]), name, reference)


def test_selection_margin_is_the_gap_the_routing_decides_by():
  """Group-limited routing (4 groups of 2 experts, 2 groups kept, K = 2): groups score 1.0, 0.95, 0.94, 0.2, so
  the group choice is decided by 0.01 and the experts in the kept groups (0.9, 0.1 | 0.5, 0.45) by 0.05.
  Moving expert 5's selection score up by just over the margin changes moe.route's choice; by just under, not."""
  from jaxseek.model import moe

  routing = moe.Routing("sigmoid", "noaux_tc", 4, 2, 2, True, 1.0, True)
  scores_E = np.array([0.9, 0.1, 0.5, 0.45, 0.5, 0.44, 0.1, 0.1], np.float32)
  logits_XE = np.log(scores_E / (1 - scores_E))[None]
  margin = float(selection_margin(logits_XE, None, routing)[0])
  assert margin == pytest.approx(0.01, abs=1e-6)
  chosen = lambda shift: set(np.asarray(moe.route(logits_XE, np.eye(8, dtype=np.float32)[5] * shift, routing)[0][0]))
  assert chosen(0.0) == chosen(0.99 * margin) == {0, 2} and chosen(1.01 * margin) == {0, 4}


def compiled_text(*overrides):
  cfg = load_config("tiny-v3", *overrides)
  mesh = make_mesh(cfg)
  trainer = step_lib.make_trainer(cfg, mesh)
  batches = global_batches(cfg, mesh)
  with jax.set_mesh(mesh):
    return step_lib.compile_step(trainer, cfg, mesh).lower(trainer.abstract_state, next(batches)).compile().as_text()


def test_compiled_step_passes_activations_with_collective_permute():
  piped = compiled_text("mesh.pipeline=2", "mesh.data=4", "train.microbatches=4")
  flat = compiled_text("mesh.data=8")
  count = lambda text: sum(m.group(1) == "collective-permute" for m in explore_compile.COLLECTIVE.finditer(text))
  assert count(piped) >= 2  # forward and backward
  assert count(flat) == 0


@functools.lru_cache(maxsize=None)
def zbv_step_text():
  """The compiled text of a ZB-V step (tiny-dense, 8 layers, pipeline 4 × data 2, 8 microbatches), with its
  config."""
  cfg = load_config("tiny-dense", "mesh.pipeline=4", "mesh.data=2", *ZBV, "train.microbatches=8",
                    "model.num_hidden_layers=8")
  mesh = make_mesh(cfg)
  trainer = step_lib.make_trainer(cfg, mesh)
  with jax.set_mesh(mesh):
    return step_lib.compile_step(trainer, cfg, mesh).lower(trainer.abstract_state, next(global_batches(
        cfg, mesh))).compile().as_text(), cfg


def test_the_v_moves_activations_and_cotangents_in_one_ppermute_a_direction():
  """ZB-V's tick sends by two collective-permutes, down the V and up it, each carrying the forward's output and
  the input's cotangent stacked, inside a conditional that runs it only in the ticks the table sends by it (its
  share of the ticks on it for the HLO's readers). It ran four, one per kind and direction, in every tick."""
  text, cfg = zbv_step_text()
  x = f"{cfg.train.batch_size // cfg.train.microbatches // 2},{cfg.train.seq_len},{cfg.model.hidden_size}]"
  permutes = [line for line in text.splitlines() if re.search(r"\bcollective-permute(-start)?\(", line) and x in line]
  assert len(permutes) == 2 and all(f"f32[2,{x}" in line and "jaxseek_share" in line for line in permutes), permutes


def test_the_tick_loop_copies_no_slot_buffer():
  """The tick writes what the last one received into the stage-input and cotangent slots before it reads any:
  when the sends wrote them after the tick's reads, nothing ordered the backward's read before the write, and
  XLA copied the whole stage-input buffer (9 slots of ZB-V's at S = 4) twice in every tick."""
  text, cfg = zbv_step_text()
  table = tables.for_config(cfg, 4, 2)
  loop = re.search(rf"body=%?([\w.\-]+)[^\n]*known_trip_count\":{{\"n\":\"{table.ticks}\"", text)
  body = text[text.index(f"%{loop.group(1)} "):]
  body = body[:body.index("\n}\n")]
  x = f"{cfg.train.batch_size // cfg.train.microbatches // 2},{cfg.train.seq_len},{cfg.model.hidden_size}]"
  buffers = {f"f32[{n},{x}" for n in (table.slots, table.grad_slots)}
  copies = [line for line in body.splitlines() if " copy(" in line and any(b in line.split("=")[1] for b in buffers)]
  assert table.slots == 9 and not copies, copies


def _branches(text: str) -> dict[str, list[str]]:
  """The HLO module's computations: name → instruction lines."""
  comps, current = {}, None
  for line in text.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head:
      current = comps.setdefault(head.group(1), [])
    elif current is not None and line.startswith(" "):
      current.append(line)
  return comps


def test_on_cpu_w_reads_its_stash_and_adds_to_its_chunk_in_one_op_a_weight():
  """The W branch of a ZB-V tick on CPU: at most one slice read per stash array (the stash of a tiny-dense layer
  holds 15; XLA fuses some into their readers) and per weight one fused op that adds the gradient to its chunk's slot, a pass over both slots. A slot's
  read and its in-place update were two ops a weight (9 more slice reads and 9 updates, ~2 µs each, in each of
  the 32 W a stage runs at M = 16)."""
  text, _ = zbv_step_text()
  comps = _branches(text)
  w, = [c for c, lines in comps.items() if any(" dot(" in l and "pipeline_weights" in l for l in lines)]
  fused = [comps[re.search(r"calls=%?([\w.\-]+)", l).group(1)] for l in comps[w] if " fusion(" in l]
  reads = [f for f in fused if any("dynamic-slice(" in l for l in f)]
  writes = [f for f in fused if any("dynamic-update-slice(" in l for l in f)]
  assert len(reads) <= 15 and not writes, (len(reads), len(writes))  # 25 and 9 before


def test_circular_storage_order_and_bubble():
  """Stage s holds chunks s, S + s, …: with 8 layers, 2 stages and 2 repeats, stage 0 stores layers 0, 1, 4, 5."""
  np.testing.assert_array_equal(pipeline.storage_order(8, 2, 2), [0, 1, 4, 5, 2, 3, 6, 7])
  np.testing.assert_array_equal(pipeline.storage_order(12, 2, 3), [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11])
  np.testing.assert_array_equal(pipeline.storage_order(8, 2, 1), np.arange(8))  # GPipe: contiguous
  np.testing.assert_array_equal(pipeline.storage_order(6, 2, 2), np.arange(6))  # 2·2 ∤ 6 but 2 | 6: GPipe
  assert pipeline.stack_repeats(6, 2, 2) == 1 and pipeline.stack_repeats(3, 2, 1) == 0  # 2 ∤ 3 < 2·2: every stage
  # 5 layers, 2 stages, 2 repeats: 8 rows, the 3 of padding last; the schedule visits positions 0 1 | 4 5 | 2 3 |
  # 6 7 (round, stage) and finds layers 0 1 | 2 pad | 3 4 | pad pad
  assert pipeline.stack_repeats(5, 2, 2) == 2 and pipeline.stored_layers(5, 2, 2) == 8
  np.testing.assert_array_equal(pipeline.storage_order(5, 2, 2), [0, 1, 3, 4, 2, 5, 6, 7])
  assert pipeline.stored_layers(95, 4, 1) == 96 and pipeline.stored_layers(58, 16, 1) == 64
  for S, M, R in [(2, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 2), (4, 16, 4)]:
    assert pipeline.num_ticks(S, M, R) == R * M + S - 1
    assert pipeline.bubble("gpipe", S, M, R) == pytest.approx((S - 1) / (R * M + S - 1))
  # M not a multiple of S: the last group of microbatches is partial; its last item ends the schedule
  assert pipeline.num_ticks(4, 6, 2) == (1 * 2 * 4) + (1 * 4) + 1 + 4
  # reorder moves a stack from one storage order to another and back; other leaves pass through
  tree = {"moe_layers": {"w": np.arange(8.0)[:, None]}, "embed": np.arange(3.0)}
  moved = pipeline.reorder(tree, {"moe_layers": 8}, (1, 1), (2, 2))
  np.testing.assert_array_equal(moved["moe_layers"]["w"][:, 0], pipeline.storage_order(8, 2, 2))
  np.testing.assert_array_equal(moved["embed"], tree["embed"])
  back = pipeline.reorder(moved, {"moe_layers": 8}, (2, 2), (4, 1))
  np.testing.assert_array_equal(back["moe_layers"]["w"][:, 0], np.arange(8))
  # padding: rows of zeros appear where the target stores padding and disappear in the flat order
  tree = {"moe_layers": {"w": np.arange(1.0, 6.0)[:, None]}}
  padded = pipeline.reorder(tree, {"moe_layers": 5}, (1, 1), (2, 2))
  np.testing.assert_array_equal(padded["moe_layers"]["w"][:, 0], [1, 2, 4, 5, 3, 0, 0, 0])
  flat = pipeline.reorder(padded, {"moe_layers": 5}, (2, 2), (1, 1))
  np.testing.assert_array_equal(flat["moe_layers"]["w"][:, 0], [1, 2, 3, 4, 5])


def test_layer_stacks_are_split_into_stages():
  cfg = load_config("tiny-v3", "mesh.pipeline=2", "mesh.data=4", "train.microbatches=4")
  trainer = step_lib.make_trainer(cfg, make_mesh(cfg))
  moe_spec = jax.tree.leaves(trainer.state_shardings.params["moe_layers"])[0].spec
  dense_spec = jax.tree.leaves(trainer.state_shardings.params["dense_layers"])[0].spec
  assert moe_spec[0] == "pipeline"  # 2 MoE layers: one per stage
  assert dense_spec[0] is None  # 1 dense layer: not pipelined, its model dimension split over the stages instead
  shardings = jax.tree_util.tree_leaves_with_path(trainer.state_shardings.params)
  shapes = dict(zip([path for path, _ in shardings], jax.tree.leaves(trainer.abstract_state.params)))
  outside = [(path, s) for path, s in shardings if "moe_layers" not in jax.tree_util.keystr(path)]
  split = [(path, s) for path, s in outside if "pipeline" in str(s.spec)]
  names = {jax.tree_util.keystr(path) for path, _ in split}
  assert {"['embed']['table_VD']", "['head_DV']", "['dense_layers']['blocks']['mlp']['w_down_FD']",
          "['dense_layers']['blocks']['attn']['w_uk_CNH']"} <= names
  assert len(split) == len(outside)  # every one of them
  for path, s in split:  # each device holds half of such a weight (and of its gradient)
    shape = shapes[path].shape
    assert math.prod(s.shard_shape(shape)) * 2 == math.prod(shape), jax.tree_util.keystr(path)
  moments = [s for s in jax.tree.leaves(trainer.state_shardings.opt_state) if "pipeline" in str(s.spec)]
  assert len(moments) >= 2 * len(split)  # Adam's two moments follow their parameters
  assert pipeline.bubble("gpipe", 2, 4) == pytest.approx(1 / 5)
  summary = pipeline.summary(cfg, 2)
  assert "bubble (S-1)/(M+S-1) = 20.0%" in summary and "MoE stack 1 layers per stage" in summary
  assert "dense stack (1 layers) on every stage" in summary


def test_the_start_up_line_says_where_the_other_stack_runs_and_whether_the_padding_does():
  """5 MoE layers on 2 stages are stored as 6. Under 1F1B the dense layer runs with the first virtual stage and the
  last stage skips its identity layer; paired ticks and GPipe run it (and GPipe runs the dense layer on every
  stage, data-parallel)."""
  line = lambda *over: pipeline.summary(load_config("tiny-v3", "model.num_hidden_layers=6", "mesh.pipeline=2",
                                                    "mesh.data=4", "train.microbatches=4", *over), 2)
  one_f_one_b = line(ONE_F_ONE_B)
  assert "dense stack (1 layers) with the first virtual stage, on stage 0" in one_f_one_b
  assert "MoE stack 3 layers per stage (1 identity padding, skipped)" in one_f_one_b
  assert "(1 identity padding, run)" in line(ONE_F_ONE_B, PAIR) and "(1 identity padding, run)" in line(ONE_F_ONE_B, KEEP)
  gpipe = line()
  assert "dense stack (1 layers) on every stage" in gpipe and "(1 identity padding, run)" in gpipe


def test_pipeline_longer_than_every_stack_is_refused():
  cfg = load_config("tiny-v3", "mesh.pipeline=4", "mesh.data=2")  # 1 dense and 2 MoE layers
  with pytest.raises(UserError, match="mesh.pipeline: 4 stages split neither layer stack"):
    step_lib.make_trainer(cfg, make_mesh(cfg))
  cfg = load_config("tiny-v3", "mesh.pipeline=2", "mesh.data=4", "train.pipeline_repeats=2")  # 2 MoE layers
  with pytest.raises(UserError, match="train.pipeline_repeats: 2 repeats x 2 stages exceed both layer stacks"):
    step_lib.make_trainer(cfg, make_mesh(cfg))
  with pytest.raises(UserError, match="train.pipeline_repeats: 0 must be"):
    load_config("tiny-v3", "train.pipeline_repeats=0")
  with pytest.raises(UserError, match="dualpipev runs two chunks per stage .* set train.pipeline_repeats=2"):
    load_config("tiny-v3", "train.pipeline_schedule=dualpipev")
  with pytest.raises(UserError, match="train.pipeline_stashes: 2 caps the stashes of zb_h1 and zbv"):
    load_config("tiny-v3", "train.pipeline_schedule=1f1b", "train.pipeline_stashes=2")
  with pytest.raises(UserError, match="train.pipeline_recompute: false keeps the forward's residuals"):
    load_config("tiny-v3", "train.pipeline_schedule=gpipe", "train.pipeline_recompute=false")
  with pytest.raises(UserError, match="train.pipeline_overlap: true pairs a tick's forward with a backward that "
                                      "recomputes"):
    load_config("tiny-v3", "mesh.pipeline=2", "mesh.data=4", "train.pipeline_schedule=1f1b",
                "train.pipeline_recompute=false", "train.pipeline_overlap=true")
  cfg = load_config("tiny-v3", "mesh.pipeline=2", "mesh.data=4", "model.num_hidden_layers=7", *DUALPIPEV)
  with pytest.raises(UserError, match="its 6 layers on 2 stages make one chunk a stage; choose mesh.pipeline"):
    step_lib.make_trainer(cfg, make_mesh(cfg))  # 6 MoE layers: 3 a stage, not two chunks


P2R2, FLAT = ("mesh.pipeline=2", "mesh.data=4", "train.pipeline_repeats=2"), ("mesh.data=4", "mesh.tensor=2")


@pytest.mark.parametrize("before, after", [((*P2R2, "train.pipeline_schedule=dualpipev"), FLAT),
                                           (FLAT, (*P2R2, INTERLEAVED)),
                                           ((*P2R2, "train.pipeline_schedule=zbv"), (*P2R2[:2], ZB_H1))],
                         ids=["p2-dualpipev-to-p1", "p1-to-p2r2-interleaved", "p2-zbv-to-p2-zb_h1"])
def test_checkpoint_moves_between_pipelined_and_flat_meshes(tmp_path, before, after):
  """The next losses after a restore on another pipeline layout equal those of the run that saved. DualPipeV's V
  and the circular layout store the 7 MoE layers in 8 rows, in different orders (identity padding): restore
  cuts or adds the padding."""
  base = ("checkpoint.async_save=false", f"train.run_dir={tmp_path}", "train.microbatches=4",
          "model.num_hidden_layers=8")
  cfg = load_config("tiny-v3", *before, *base)
  mesh = make_mesh(cfg)
  trainer, state = step_lib.init_state(cfg, mesh)
  batches = GlobalBatches(cfg, mesh)
  step_fn = step_lib.compile_step(trainer, cfg, mesh)
  with jax.set_mesh(mesh):
    for _ in range(2):
      state, _ = step_fn(state, next(batches))
  ckpt = checkpoint_lib.Checkpointer(cfg, tmp_path / "checkpoints")
  ckpt.save(2, state, batches.iterator)
  ckpt.close()
  expected = []
  with jax.set_mesh(mesh):
    for _ in range(2):
      state, metrics = step_fn(state, next(batches))
      expected.append(float(metrics["loss"]))

  new_cfg = load_config("tiny-v3", *after, *base)
  new_mesh = make_mesh(new_cfg)
  new_trainer = step_lib.make_trainer(new_cfg, new_mesh)
  new_batches = GlobalBatches(new_cfg, new_mesh)
  restored = checkpoint_lib.Checkpointer(new_cfg, tmp_path / "checkpoints").restore(
      2, new_trainer.abstract_state, new_trainer.state_shardings, new_batches.iterator)
  new_step = step_lib.compile_step(new_trainer, new_cfg, new_mesh)
  got = []
  with jax.set_mesh(new_mesh):
    for _ in range(2):
      restored, metrics = new_step(restored, next(new_batches))
      got.append(float(metrics["loss"]))
  np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_export_of_a_circular_checkpoint_is_in_layer_order(tmp_path):
  """A checkpoint of a circular pipeline stores its layers out of order, padded (5 MoE layers in 8 rows); reading
  it back as a model (what export to Hugging Face and load_pretrained use) gives the same parameters as a fresh
  flat model."""
  from jaxseek.convert import pretrained
  from flax import nnx

  base = ("checkpoint.async_save=false", f"train.run_dir={tmp_path}", "model.num_hidden_layers=6")
  cfg = load_config("tiny-v3", *P2R2, *base, "train.microbatches=4")
  mesh = make_mesh(cfg)
  trainer, state = step_lib.init_state(cfg, mesh)
  train_lib.prepare_run_dir(cfg)
  ckpt = checkpoint_lib.Checkpointer(cfg, tmp_path / "checkpoints")
  ckpt.save(0, state, None)
  ckpt.close()
  stored = np.asarray(state.params["moe_layers"]["blocks"]["mlp"]["w_router_DE"][...])

  flat_cfg = load_config("tiny-v3", "mesh.data=1", *base)
  _, flat = step_lib.init_state(flat_cfg, make_mesh(flat_cfg, jax.devices()[:1]))
  model, _, _ = pretrained.from_checkpoint(tmp_path)
  got = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  want = dict(nnx.to_flat_state(flat.params))
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_array_equal(np.asarray(got[key][...]), np.asarray(want[key][...]), err_msg=str(key))
  flat_router = np.asarray(flat.params["moe_layers"]["blocks"]["mlp"]["w_router_DE"][...])
  assert not np.array_equal(stored, flat_router)  # the saved layers really were out of order
  order = pipeline.storage_order(5, 2, 2)
  assert stored.shape[0] == 8 and not stored[order >= 5].any()  # the padding rows are zeros
  np.testing.assert_array_equal(stored[order < 5], flat_router[order[order < 5]])


def compiled_temp_bytes(schedule, micro, devices=4, *extra):
  """XLA's temp memory per device for a step of an 8-layer dense model on 4 stages, 2 sequences a microbatch."""
  return compiled_dense_step(schedule, micro, devices, *extra).memory_analysis().temp_size_in_bytes


def compiled_dense_step(schedule, micro, devices=4, *extra):
  """The compiled step of an 8-layer dense model (hidden 64) on `devices` stages, 2 sequences of 64 a microbatch."""
  cfg = load_config("tiny-dense", f"mesh.pipeline={devices}", "mesh.data=1", f"train.microbatches={micro}",
                    f"train.batch_size={2 * micro}", "train.seq_len=64", "model.max_position_embeddings=64",
                    "model.hidden_size=64", "model.num_hidden_layers=8", f"train.pipeline_schedule={schedule}",
                    f"train.pipeline_repeats={2 if schedule in ('dualpipev', 'zbv') else 1}", *extra)
  mesh = make_mesh(cfg, jax.devices()[:devices])
  trainer = step_lib.make_trainer(cfg, mesh)
  with jax.set_mesh(mesh):
    return step_lib.compile_step(trainer, cfg, mesh).lower(trainer.abstract_state,
                                                           next(global_batches(cfg, mesh))).compile()


def test_1f1b_keeping_the_forward_residuals_runs_no_forward_twice():
  """1F1B with train.pipeline_recompute=false (8 dense layers on 4 stages, M = 16): its table runs each backward's
  b and W in one tick and keeps a chunk's residuals per microbatch in flight (2S − 1 on stage 0, whose first
  backward comes 2S − 2 ticks after its first forward); the compiled tick's FLOPs (a forward,
  then a backward: XLA counts the costliest branch of each) drop from F + (F + B) to F + B for the layers, as
  nothing is recomputed (measured 0.82 of them with the loss head, which both run); XLA's temp memory grows by the residuals, and the explorer's estimate follows it within 25%
  (measured 14.96 MB against 15.93; recomputing, 3.77 MB)."""
  from jaxseek.explore import memory
  from jaxseek.explore.layout import describe

  table = tables.table("1f1b", 4, 16, 1, recompute=False)
  assert table.split and table.residual_slots == 2 * 4 - 1, table.kept()  # stage 0: 2S − 1 forwards before a b
  assert (table.steps["w_micro"] == table.b_micro).all()  # W in its b's tick
  again, kept = compiled_dense_step("1f1b", 16), compiled_dense_step("1f1b", 16, 4, "train.pipeline_recompute=false")
  ratio = kept.cost_analysis()["flops"] / again.cost_analysis()["flops"]
  assert 0.7 < ratio < 0.9, ratio  # recomputing again would be 1
  cfg = load_config("tiny-dense", "mesh.pipeline=4", "mesh.data=1", "train.microbatches=16", "train.batch_size=32",
                    "train.seq_len=64", "model.max_position_embeddings=64", "model.hidden_size=64",
                    "model.num_hidden_layers=8", "train.pipeline_schedule=1f1b", "train.pipeline_recompute=false")
  sizes = dict(pipeline=4, data=1, fsdp=1, expert=1, context=1, tensor=1)
  estimate = memory.memory(describe(cfg), sizes, "cpu")["bytes"]["activations"]
  compiled = kept.memory_analysis().temp_size_in_bytes
  assert compiled > 3 * again.memory_analysis().temp_size_in_bytes
  assert 0.75 < estimate / compiled < 1.25, (estimate, compiled)


def test_1f1b_memory_is_bounded_by_the_stage_count():
  """GPipe keeps every microbatch's activations until the backward; 1F1B at most 2S − 3 stage inputs a stage (and
  the whole model runs per microbatch inside the schedule). At M = 16, S = 4, XLA's temp memory per device is
  at most 0.5× GPipe's (measured 0.10×) and flat from M = 8 to 16 (it grows by less than one microbatch's hidden
  states: the batch's token arrays), where GPipe's grows by 8 more microbatches' activations. The zero-bubble
  tables keep, besides stage inputs, a stash per pending W (the layers' matmul inputs and output cotangents):
  ZB-H1 (one stash) and ZB-V (S stashes of half a stage) stay within 1.3x of 1F1B's (measured 1.03x, 1.17x);
  ZB-V with as many stashes as its order wants does not (1.65x)."""
  gpipe = {m: compiled_temp_bytes("gpipe", m) for m in (8, 16)}
  ours = {m: compiled_temp_bytes("1f1b", m) for m in (8, 16)}
  assert ours[16] <= 0.5 * gpipe[16], (ours, gpipe)
  microbatch = 2 * 64 * 64 * 4  # one microbatch's hidden states
  assert ours[16] - ours[8] <= microbatch, ours  # flat: the batch arrays grow (tokens, masks), no hidden state
  assert gpipe[16] - gpipe[8] > 8 * microbatch, gpipe
  assert compiled_temp_bytes("zb_h1", 16) <= 1.3 * ours[16]
  assert compiled_temp_bytes("zbv", 16) <= 1.3 * ours[16]
  assert compiled_temp_bytes("zbv", 16, 4, "train.pipeline_stashes=8") > 1.3 * ours[16]
  table = tables.one_f_one_b(4, 16)  # stage 1 keeps 2S − 3 inputs (stage 0 recomputes its own from the batch)
  assert table.slots == 2 * 4 - 3 and table.bubble() == pytest.approx(3 / 19)


def test_schedule_tables():
  """Every microbatch runs forward then backward once per chunk on every stage; forwards move one stage on per
  tick, backwards one stage back; the last virtual stage runs a microbatch's backward in its forward's tick."""
  for S, M, R in [(2, 4, 1), (4, 8, 1), (4, 6, 1), (2, 4, 2), (4, 8, 2), (4, 6, 2), (3, 7, 3)]:
    t = tables.one_f_one_b(S, M, R)
    where = {}
    for kind, micro, chunk in (("f", t.f_micro, t.f_chunk), ("b", t.b_micro, t.b_chunk)):
      for tick, s in zip(*np.nonzero(micro >= 0)):
        key = (kind, int(micro[tick, s]), int(chunk[tick, s]) * S + int(s))  # (kind, microbatch, virtual stage)
        assert key not in where
        where[key] = int(tick)
    assert len(where) == 2 * M * R * S
    for m in range(M):
      for v in range(R * S - 1):
        assert where["f", m, v + 1] == where["f", m, v] + 1 and where["b", m, v] == where["b", m, v + 1] + 1
      assert where["b", m, R * S - 1] == where["f", m, R * S - 1]
    # a stage input stays in its slot from its arrival (the tick before its forward) until its backward read it;
    # virtual stage 0 keeps none (it recomputes its input from the batch)
    for s in range(S):
      live = [(where["f", m, r * S + s] - 1, where["b", m, r * S + s], t.f_slot[where["f", m, r * S + s], s])
              for m in range(M) for r in range(R) if r * S + s]
      for a in live:
        for b in live:
          assert a is b or a[2] != b[2] or a[1] <= b[0] or b[1] <= a[0]
    if M % S == 0:
      assert t.bubble() == pytest.approx((S - 1) / (R * M + S - 1))


def test_zero_bubble_tables():
  """The tables the step runs for ZB-H1, ZB-V and DualPipeV (zero_bubble's packed orders): every microbatch runs
  forward, b and W once on every virtual stage, b after the next virtual stage's b and W after its b (the
  checker refuses a backward run too early); the V's loss runs on stage 0. A stash stays in its slot from its
  b to its W; what a stage keeps does not grow with M from M = 2S on. Bubbles under the costs the step runs
  (F = 1, b = 2: it recomputes the chunk's forward, W = 1): at S = 4, M = 16 ZB-V's at most 9.5% with its
  default S stashes, 7% with 2S, 1F1B's 15.8%."""
  for name in ("zb_h1", "zbv", "dualpipev"):
    for S in (2, 3, 4):
      for M in (1, S, 2 * S, 3 * S + 1):
        t = tables.from_order(tables.zero_bubble_order(name, S, M))
        V = t.virtual.size
        when = {}
        for kind in ("f", "b", "w"):
          micro, chunk = t.steps[f"{kind}_micro"], t.steps[f"{kind}_chunk"]
          for k, s in zip(*np.nonzero(micro >= 0)):
            when[kind, int(micro[k, s]), int(t.virtual[s, chunk[k, s]])] = int(k)
        assert len(when) == 3 * M * V, (name, S, M)
        for m in range(M):
          for v in range(V):
            assert when["f", m, v] < when["b", m, v] < when["w", m, v]
            assert v == V - 1 or when["b", m, v + 1] < when["b", m, v]
        if name != "zb_h1":
          np.testing.assert_array_equal(t.virtual, np.stack([np.arange(S), 2 * S - 1 - np.arange(S)], 1))
          assert (t.steps["loss_grad"][:, 1:] < 0).all() and (t.steps["loss_grad"][:, 0] >= 0).sum() == M
        for s in range(S):  # a slot's stash is not overwritten before its W has read it
          live = {}
          for k in range(t.ticks):
            if t.steps["b_micro"][k, s] >= 0:
              assert t.steps["b_stash"][k, s] not in live.values()
              live[k] = t.steps["b_stash"][k, s]
            if t.steps["w_micro"][k, s] >= 0:
              slot = t.steps["w_stash"][k, s]
              assert slot in live.values()
              live = {a: b for a, b in live.items() if b != slot}
      big = tables.from_order(tables.zero_bubble_order(name, S, 8 * S))
      assert tables.from_order(tables.zero_bubble_order(name, S, 4 * S)).kept() == big.kept()
  assert tables.from_order(tables.zero_bubble_order("zbv", 4, 16)).bubble() <= 0.095  # S stashes
  assert tables.from_order(tables.zero_bubble_order("zbv", 4, 16, stashes=8)).bubble() <= 0.07
  assert tables.one_f_one_b(4, 16).bubble() == pytest.approx(3 / 19)
  with pytest.raises(AssertionError, match="before its input"):  # the checker refuses a backward run too early
    tables.build(2, 1, 1, np.array([[0], [1]]), {(0, 0): 0, (0, 1): 1}, {(0, 0): 1, (0, 1): 1})



def test_tables_that_keep_the_forward_residuals_run_the_unit_orders():
  """train.pipeline_recompute=false: b does not recompute the chunk's forward, so the tables are the unit orders
  (F = b = W = 1) with their bubbles: S = 4, M = 16 ZB-V 3.0%, ZB-H1 and DualPipeV at most 6.5%; S = 8, M = 16
  ZB-V at most 7.5%. Every virtual stage (the first too) keeps its residuals in a slot from its F to its b, not
  overwritten before b reads it; the stage inputs are free after F."""
  limits = {("zbv", 4): 0.035, ("zb_h1", 4): 0.065, ("dualpipev", 4): 0.065, ("zbv", 8): 0.075}
  for (name, S), limit in limits.items():
    t = tables.table(name, S, 16, 1 if name == "zb_h1" else 2, recompute=False)
    assert t.bubble() <= limit and t.bubble() == t.bubble({"f": 1, "b": 1, "w": 1}), (name, S, t.bubble())
    assert t.residual_slots > 0 and t.kept()["residuals"] == t.residual_slots
    for s in range(S):
      live = set()
      for k in range(t.ticks):
        f, b = t.steps["f_micro"][k, s] >= 0, t.steps["b_micro"][k, s] >= 0
        if f:
          assert t.steps["f_residual"][k, s] not in live
          live.add(int(t.steps["f_residual"][k, s]))
        if b:
          assert int(t.steps["b_residual"][k, s]) in live
          live.discard(int(t.steps["b_residual"][k, s]))
      assert not live
  recomputing = tables.table("zbv", 4, 16, 2)
  assert recomputing.residual_slots == 0 and recomputing.bubble() > 0.09  # packed for b costing two

@pytest.mark.parametrize("recompute", ["true", "false"])
@pytest.mark.parametrize("schedule", [DUALPIPEV, ZBV, (ZB_H1,)], ids=["dualpipev", "zbv", "zb_h1"])
def test_the_summary_prints_the_bubble_its_table_runs(schedule, recompute):
  """Every bubble the start-up line prints is counted on a table: at M = 4 < 2S = 8 (and M = 2 < S) DualPipeV's W
  cannot fill its warm-up and drain, so its unit order idles 20% of the time where (S-1)/(6M+S-1) says 11.1%;
  the closed form is named only where a table meets it (M = 8 here)."""
  for M in (2, 4, 8):
    cfg = load_config("tiny-dense", "mesh.pipeline=4", "mesh.data=2", "model.num_hidden_layers=8",
                      f"train.microbatches={M}", f"train.pipeline_recompute={recompute}", *schedule)
    name, R = cfg.train.pipeline_schedule, cfg.train.pipeline_repeats
    run_table = tables.table(name, 4, M, R, recompute=recompute == "true")
    unit_table = tables.table(name, 4, M, R, recompute=False)  # F = b = W = 1: idle ticks over all ticks
    idle = 1 - (unit_table.f_micro >= 0).sum(0).max() * 3 / unit_table.ticks
    assert unit_table.bubble() == pytest.approx(idle)
    line = pipeline.summary(cfg, 4).split(" | ")[0]
    printed = {float(x) for x in re.findall(r"(\d+\.\d)%", line)}
    assert printed == {round(100 * run_table.bubble(), 1), round(100 * idle, 1)}, line
    closed = pipeline.bubble(name, 4, M)
    assert (pipeline.FORMULA[name] in line) == (closed == pytest.approx(idle)), line


def test_a_table_is_refused_for_a_schedule_without_one():
  """tables.table knows the table schedules by name; any other name (GPipe, circular, a typo) raises rather
  than run 1F1B."""
  assert tables.table("interleaved_1f1b", 2, 4, 2).repeats == 2
  for name in ("gpipe", "circular", "dualpipe", ""):
    with pytest.raises(ValueError, match=f"no table for schedule '{name}'; the table schedules are 1f1b"):
      tables.table(name, 2, 4, 1)
  with pytest.raises(ValueError, match="no zero-bubble order named '1f1b'"):
    tables.zero_bubble_order("1f1b", 2, 4)


def test_the_rest_of_the_model_accumulates_its_gradients_where_its_part_runs():
  """Under 1F1B the first part (embedding, layers before the stack) runs on stage 0 and the last (head, MTP) on
  stage S − 1: the leaves only one part reads share one float32 buffer as long as the larger part, each part
  accumulating at its own offsets; a leaf both read keeps its own accumulator, one neither reads none. In
  DualPipeV's V both parts run on stage 0, so every leaf read keeps its own."""
  import jax.numpy as jnp

  params = {"both": jnp.ones((3,)), "first": jnp.ones((5, 2)), "last": jnp.ones((2,)), "unused": jnp.ones((4,))}
  first_fn = lambda p, x: p["both"].sum() * p["first"].sum() * x
  post_fn = lambda p, h, x: p["both"].sum() + p["last"].sum() * h * x
  first = restgrads.used_leaves(first_fn, params, 1.0)
  post = restgrads.used_leaves(post_fn, params, 1.0, 1.0)
  order = sorted(params)  # the leaves in tree order: both, first, last, unused
  assert dict(zip(order, first)) == {"both": True, "first": True, "last": False, "unused": False}
  assert dict(zip(order, post)) == {"both": True, "first": False, "last": True, "unused": False}

  layout = restgrads.RestGrads(tables.one_f_one_b(4, 8), params, first, post)
  assert (layout.first_stage, layout.post_stage, layout.whole, layout.size) == (0, 3, [0], 10)
  acc = layout.add(layout.init(), "first", [jnp.full((3,), 1.0), jnp.arange(10.0).reshape(5, 2)])
  acc = layout.add(acc, "first", [jnp.full((3,), 1.0), jnp.ones((5, 2))])
  on_0 = layout.tree(acc, 0)
  np.testing.assert_array_equal(on_0["both"], 2.0)
  np.testing.assert_array_equal(on_0["first"], np.arange(10.0).reshape(5, 2) + 1)
  np.testing.assert_array_equal(on_0["last"], 0.0)
  np.testing.assert_array_equal(on_0["unused"], 0.0)
  acc = layout.add(layout.init(), "post", [jnp.full((3,), 1.0), jnp.array([4.0, 5.0])])  # as stage 3 would
  on_3 = layout.tree(acc, 3)
  np.testing.assert_array_equal(on_3["both"], 1.0)
  np.testing.assert_array_equal(on_3["last"], [4.0, 5.0])
  np.testing.assert_array_equal(on_3["first"], 0.0)
  np.testing.assert_array_equal(layout.tree(acc, 1)["last"], 0.0)  # a middle stage runs neither part

  v = restgrads.RestGrads(tables.dualpipev(4, 8), params, first, post)
  assert (v.first_stage, v.post_stage, v.whole, v.size) == (0, 0, [0, 1, 2], 0)


def test_a_forward_outside_the_dualpipev_schedule_reads_the_v_layout():
  """Evaluation runs the model's forward (the circular pipeline) on parameters stored for DualPipeV: its logits
  equal those of the same model on one device."""
  from flax import nnx

  base = ("model.num_hidden_layers=8", "train.microbatches=2")  # 7 MoE layers in 8 rows, not the ring's order
  cfg = load_config("tiny-v3", "mesh.pipeline=2", "mesh.data=4", *DUALPIPEV, *base)
  mesh = make_mesh(cfg)
  trainer, state = step_lib.init_state(cfg, mesh)
  flat_cfg = load_config("tiny-v3", "mesh.data=1", *base)
  flat_trainer, flat = step_lib.init_state(flat_cfg, make_mesh(flat_cfg, jax.devices()[:1]))
  tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (8, 16), np.int32)
  forward = lambda graphdef: jax.jit(lambda s: nnx.merge(graphdef, s.params, s.biases).forward(tokens))
  with jax.set_mesh(mesh):
    got, got_aux = jax.device_get(forward(trainer.graphdef)(state))
  want, want_aux = jax.device_get(forward(flat_trainer.graphdef)(flat))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  order = pipeline.storage_order(7, 2, 2, "v")  # the loads come back in the V's storage order, padding zero
  assert not np.array_equal(order, pipeline.storage_order(7, 2, 2))
  np.testing.assert_allclose(got_aux["load"][order < 7], want_aux["load"][order[order < 7]], rtol=1e-6)
  assert not got_aux["load"][order >= 7].any()


def test_explorer_accounts_for_the_1f1b_schedule():
  """The explorer's activation estimate, 2 sequences a microbatch: 1F1B's does not grow from M = 8 to 16 (its
  kept stage inputs, one chunk's recompute and the per-microbatch head do not depend on M), GPipe's grows by 8
  more microbatches' activations; 1F1B's is within a factor 2 of XLA's compiled temp memory."""
  from jaxseek.explore import memory
  from jaxseek.explore.layout import describe

  sizes = dict(pipeline=4, data=1, fsdp=1, expert=1, context=1, tensor=1)

  def estimate(schedule, micro):
    cfg = load_config("tiny-dense", "mesh.pipeline=4", "mesh.data=1", f"train.microbatches={micro}",
                      f"train.batch_size={2 * micro}", "train.seq_len=64", "model.max_position_embeddings=64",
                      "model.hidden_size=64", "model.num_hidden_layers=8", f"train.pipeline_schedule={schedule}")
    return memory.memory(describe(cfg), sizes, "cpu")["bytes"]["activations"]

  assert estimate("1f1b", 16) == estimate("1f1b", 8)
  assert estimate("gpipe", 16) - estimate("gpipe", 8) > 10 * 2 * 16 * 64 * 64 * 4
  assert estimate("1f1b", 16) < 0.25 * estimate("gpipe", 16)
  compiled = compiled_temp_bytes("1f1b", 16)
  assert 0.5 < estimate("1f1b", 16) / compiled < 2, (estimate("1f1b", 16), compiled)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_batch_only_the_data_axes_divide_trains_on_a_pipeline(schedule):
  """6 sequences on pipeline 2 × data 2 × tensor 2 (6 is not a multiple of 4): outside the schedule the batch is
  split over data alone, every stage on the same rows, and training equals one device's."""
  mesh = ("mesh.pipeline=2", "mesh.data=2", "mesh.tensor=2", "train.batch_size=6", "train.microbatches=3",
          f"train.pipeline_schedule={schedule}")
  got = run("tiny-dense", (*mesh, "model.num_hidden_layers=4"))
  want = run("tiny-dense", ("mesh.data=1", "train.batch_size=6", "model.num_hidden_layers=4"), jax.devices()[:1])
  np.testing.assert_allclose(got, want, rtol=1e-5)
  sizes = dict(pipeline=2, data=2, fsdp=1, expert=1, context=1, tensor=2)
  line = pipeline.summary(load_config("tiny-dense", *mesh), 2, sizes)
  assert "train.batch_size=6 is not divisible by pipeline x data x fsdp x expert = 4" in line
  assert "split over data x fsdp x expert = 2 only" in line


def test_weights_outside_the_stack_enter_the_schedule_in_the_compute_dtype():
  """The schedule gathers the matrices the model casts at use in bfloat16; the router and the norm scales, which
  the model reads in float32, stay float32."""
  from flax import nnx

  from jaxseek import model as model_lib
  from jaxseek import objective

  cfg = load_config("tiny-v3", "model.num_nextn_predict_layers=1")
  params = nnx.state(nnx.eval_shape(lambda: model_lib.build(cfg.model, seed=0, param_dtype="float32",
                                                              dtype="bfloat16")), nnx.Param)
  cast = jax.eval_shape(lambda p: objective.as_computed(p, "bfloat16"), params)
  kinds = {jax.tree_util.keystr(path): a.dtype.name for path, a in jax.tree_util.tree_leaves_with_path(cast)}
  assert {d for k, d in kinds.items() if "table_VD" in k or "head_DV" in k} == {"bfloat16"}
  assert all(d == "float32" for k, d in kinds.items() if "router" in k or "scale_D" in k)
  assert any("router" in k for k in kinds) and sum(d == "bfloat16" for d in kinds.values()) > len(kinds) // 2


def test_paired_ticks_hold_a_forward_and_a_backward_that_do_not_wait_for_each_other():
  """1F1B pairs a tick's forward with a backward whose cotangent is not that tick's loss: without the delay the
  last stage never pairs (it runs a microbatch's loss and backward after its forward), with it every stage's
  steady ticks pair; the delay costs one tick and leaves the bubble as it was. Split tables never pair."""
  S, M = 4, 8
  plain, delayed = tables.one_f_one_b(S, M, 1), tables.one_f_one_b(S, M, 1, delay=1)
  assert plain.paired()[:, S - 1].sum() == 0 and delayed.paired()[:, S - 1].sum() == M - 1
  assert delayed.ticks == plain.ticks + 1 and delayed.bubble() == pytest.approx(plain.bubble())
  for table in (plain, delayed, tables.one_f_one_b(S, M, 2, delay=1)):
    p = table.paired()
    st = table.steps
    assert ((st["f_micro"] >= 0) & (st["b_micro"] >= 0))[p].all()
    assert not ((st["loss_grad"] >= 0) & (st["loss_grad"] == st["b_grad"]))[p].any()
  assert not tables.table("zbv", S, M, 2).paired().any()
  cfg = load_config("tiny-v3", "train.pipeline_schedule=1f1b", f"train.microbatches={M}")
  paired = load_config("tiny-v3", "train.pipeline_schedule=1f1b", f"train.microbatches={M}", PAIR, f"mesh.pipeline={S}",
                       "mesh.data=1")
  assert tables.pairs(paired) and not tables.pairs(cfg)
  assert tables.for_config(paired, S, 1).ticks == tables.for_config(cfg, S, 1).ticks + 1 == plain.ticks + 1
