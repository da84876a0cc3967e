"""Context parallelism over the `context` axis (queries split on length) against the single-device run, and
the MLA latent as what crosses the axis."""

import collections
import re

import jax
import numpy as np
import pytest

from conftest import load_config
from jaxseek import step as step_lib
from jaxseek.config import MESH_AXES
from jaxseek.explore import compile as explore_compile
from jaxseek.input import global_batches
from jaxseek.sharding.mesh import make_mesh
from test_pipeline import run

PACKED = ("data.source=python-stdlib", "data.max_bytes=200000", "train.seq_len=64")


RING = ("model.context_attention=ring",)
ZIGZAG = ("model.context_attention=zigzag",)


@pytest.mark.parametrize("name, context, extra", [
    ("tiny-v3", 2, RING), ("tiny-dense", 4, ()),  # tiny-dense: grouped-query attention
    ("tiny-dense", 2, RING + PACKED),  # the grouped-query ring, segment ids travelling with the chunks
    # packed documents (segment ids split over the axis too) in zigzag storage, MTP shifts
    ("tiny-v3", 4, ZIGZAG + PACKED + ("model.num_nextn_predict_layers=1",)),
], ids=["v3-c2-ring", "dense-c4", "dense-c2-ring-packed", "v3-c4-zigzag-packed-mtp"])
def test_context_parallel_training_equals_single_device(name, context, extra):
  """Losses and gradient norms over 5 steps (MoE bias ranges and loads too) equal one device's."""
  single = run(name, ("mesh.data=1", *extra), jax.devices()[:1])
  got = run(name, (f"mesh.context={context}", f"mesh.data={8 // context}", *extra))
  np.testing.assert_allclose(got, single, rtol=1e-5)


def test_mla_gathers_the_latent_not_the_heads():
  """With queries split over context, the forward's context all-gathers carry the compressed key/value latent
  [.., T, C] and the shared rope key [.., T, 1, R] (and the documents' segment ids [.., T] for the mask): C + R
  numbers per token, not N heads × (H + R + P). The backward reduce-scatters their gradients at the same size;
  no expanded key or value gradient over the whole sequence is all-reduced. Every collective of the compiled
  step over context is counted."""
  cfg = load_config("tiny-v3", "mesh.context=4", "mesh.data=2", "train.seq_len=64")
  found, embedding = {}, set()
  for kind, axes, arrays, op in compiled_collectives(cfg)[0]:
    if axes == ("context",):
      found.setdefault(kind, set()).update(arrays)
      embedding |= arrays if EMBEDDING_BACKWARD in op else set()
  m = cfg.model
  # the embedding's backward (a scatter-add of the input gradient into the table) gathers the token ids
  # [.., T, 1] and the input gradient [.., T, D] over context rather than all-reduce the [V, D] table gradient
  # (XLA's choice, the cheaper one for any real vocabulary): no key or value
  assert embedding == {("s32", (8, 64, 1)), ("f32", (8, 64, m.hidden_size))}, embedding
  assert found["all-gather"] == {("f32", (8, 64, m.kv_lora_rank)), ("f32", (8, 64, 1, m.qk_rope_head_dim)),
                                 ("s32", (8, 64)), *embedding}, found
  assert found["reduce-scatter"] == {("f32", (8, 16, m.kv_lora_rank)), ("f32", (8, 16, 1, m.qk_rope_head_dim))}, found
  assert not [a for a in found["all-reduce"] if 64 in a[1]], found  # weight gradients only, no [.., 64, ..]
  assert set(found) == {"all-gather", "reduce-scatter", "all-reduce"}, found  # nothing else crosses context


EMBEDDING_BACKWARD = "transpose(jvp(jit(_take)))/scatter-add"  # the op_name of the embedding's backward


def collectives(text, sizes):
  """(kind, mesh axes, result arrays as {(dtype, dims)}, op_name) of every collective op in a compiled module:
  each line the collective regex (explore_compile.COLLECTIVE) matches, none left out."""
  found = []
  for line in text.splitlines():
    match = explore_compile.COLLECTIVE.search(line)
    if match:
      result = line[:match.start()].split(" = ", 1)[-1]  # the result type: one array or a tuple of them
      arrays = {(dtype, tuple(int(d) for d in dims.split(",") if d))
                for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result)}
      op = re.search(r'op_name="([^"]*)"', line)
      found.append((match.group(1), explore_compile.collective_axes(line, sizes), arrays, op.group(1) if op else ""))
  return found


def compiled_collectives(cfg):
  """`collectives` of cfg's compiled step, and XLA's temporary bytes per device."""
  mesh = make_mesh(cfg)
  trainer = step_lib.make_trainer(cfg, mesh)
  with jax.set_mesh(mesh):
    out = step_lib.compile_step(trainer, cfg, mesh).lower(trainer.abstract_state,
                                                         next(global_batches(cfg, mesh))).compile()
  return collectives(out.as_text(), tuple(mesh.shape[a] for a in MESH_AXES)), out.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("name", ["tiny-v3", "tiny-dense"])
def test_ring_passes_chunks_and_holds_less(name):
  """model.context_attention=ring: the key/value chunks (MLA: the latent and rope key; grouped-query: the keys
  and values) travel round the context axis by collective-permute (nothing of attention is all-gathered over
  it), and the compiled step needs less temporary memory than the gather. Every collective over context is
  counted: besides attention's, the embedding's backward gathers the token ids and the input gradient."""
  def compiled(mode):
    cfg = load_config(name, "mesh.context=4", "mesh.data=2", "train.seq_len=256", "model.max_position_embeddings=256",
                      f"model.context_attention={mode}")
    ops, temp = compiled_collectives(cfg)
    over_context = [(kind, arrays, EMBEDDING_BACKWARD in op) for kind, axes, arrays, op in ops if axes == ("context",)]
    return over_context, temp, cfg.model.hidden_size

  (gather, gather_temp, D), (ring, ring_temp, _) = compiled("gather"), compiled("ring")
  kinds = lambda ops, embedding: collections.Counter(kind for kind, _, e in ops if e == embedding)
  for ops in (gather, ring):  # as in test_mla_gathers_the_latent_not_the_heads: no key or value
    assert kinds(ops, True) == {"all-gather": 2}, ops
    assert set().union(*(a for _, a, e in ops if e)) == {("s32", (8, 256, 1)), ("f32", (8, 256, D))}, ops
  attention_gather, attention_ring = kinds(gather, False), kinds(ring, False)
  assert attention_gather["all-gather"] > 0 and attention_gather["collective-permute"] == 0, attention_gather
  assert attention_ring["all-gather"] == 0 and attention_ring["collective-permute"] > 0, attention_ring
  assert ring_temp < 0.6 * gather_temp, (ring_temp, gather_temp)


def test_zigzag_order_gives_each_device_an_early_and_a_late_chunk():
  order = step_lib.zigzag_order(16, 4)  # 8 chunks of 2 tokens; device i holds chunks i and 7 - i
  np.testing.assert_array_equal(order.reshape(4, 4), [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                                      [6, 7, 8, 9]])
  assert sorted(order) == list(range(16))


def test_zigzag_ring_computes_half_blocks():
  """After its own chunk, a device under zigzag attends t queries to half a chunk or half its queries to a whole
  chunk: the compiled step's score blocks are t × t/2 and t/2 × t (t = 64 tokens per device), where the plain
  ring computes t × t for every chunk."""
  def score_shapes(mode):
    cfg = load_config("tiny-dense", "mesh.context=4", "mesh.data=2", "train.seq_len=256",
                      "model.max_position_embeddings=256",
                      f"model.context_attention={mode}")
    mesh = make_mesh(cfg)
    trainer = step_lib.make_trainer(cfg, mesh)
    with jax.set_mesh(mesh):
      text = step_lib.compile_step(trainer, cfg, mesh).lower(trainer.abstract_state,
                                                            next(global_batches(cfg, mesh))).compile().as_text()
    heads = cfg.model.num_attention_heads
    return {tuple(int(d) for d in dims.split(",")[-2:]) for dims in re.findall(r"f32\[([\d,]+)\]\S* (?:dot|fusion)", text)
            if len(dims.split(",")) >= 3 and int(dims.split(",")[-3]) == heads}

  ring, zigzag = score_shapes("ring"), score_shapes("zigzag")
  assert (64, 64) in ring and (64, 32) not in ring and (32, 64) not in ring, ring
  assert (64, 32) in zigzag and (32, 64) in zigzag, zigzag


def test_sequence_parallel_training_equals_single_device():
  """Megatron-style sequence parallelism (the residual stream split on length over tensor too) with context 2 ×
  tensor 2 on tiny V3 (MLA, MoE): losses, gradient norms and MoE statistics over 5 steps equal one device's."""
  single = run("tiny-v3", ("mesh.data=1",), jax.devices()[:1])
  got = run("tiny-v3", ("mesh.context=2", "mesh.tensor=2", "mesh.data=2", "mesh.sequence_parallel=true"))
  np.testing.assert_allclose(got, single, rtol=1e-5)


def test_sequence_parallel_gathers_the_norm_outputs_over_tensor():
  """Without sequence parallelism a tensor-parallel step gathers nothing over `tensor` (partial sums are
  all-reduced); with it the residual stream is split there, so the norm outputs are all-gathered before the
  projections, and the compiled step's temporaries shrink (the residual stream is stored split)."""
  def compiled(sp):
    ops, temp = compiled_collectives(load_config("tiny-dense", "mesh.data=4", "mesh.tensor=2",
                                                 f"mesh.sequence_parallel={sp}"))
    return sum(kind == "all-gather" and axes == ("tensor",) for kind, axes, _, _ in ops), temp

  (gathers_off, temp_off), (gathers_on, temp_on) = compiled("false"), compiled("true")
  assert gathers_off == 0 and gathers_on > 0, (gathers_off, gathers_on)
  assert temp_on < temp_off, (temp_on, temp_off)


YARN = ("model.max_position_embeddings=96", "train.seq_len=96",
        "model.rope_scaling={type: yarn, factor: 4, original_max_position_embeddings: 24, beta_fast: 32, "
        "beta_slow: 1, mscale: 1, mscale_all_dim: 1}")


def test_context_extension_continues_a_checkpoint_at_4x_the_length_with_yarn(tmp_path):
  """The recipe of docs/context.md: train at 24 tokens, then load those parameters into a run at 96 tokens with
  YaRN scaling (factor 4 over the original 24). The extended run starts from what the short one learnt; resuming
  the short run itself with other RoPE settings is still refused."""
  from jaxseek import train as train_lib
  from jaxseek.errors import UserError

  text = ("data.source=python-stdlib", "data.max_bytes=300000", "optim.lr=0.003", "optim.warmup_steps=5",
          "checkpoint.async_save=false", "mesh.data=8")
  short = train_lib.run(load_config("tiny-v3", *text, "train.steps=25", f"train.run_dir={tmp_path / 'short'}"))
  long = train_lib.run(load_config("tiny-v3", *text, *YARN, "train.steps=2", f"train.run_dir={tmp_path / 'long'}",
                                   f"checkpoint.load_from={tmp_path / 'short'}"))
  fresh = train_lib.run(load_config("tiny-v3", *text, *YARN, "train.steps=2", f"train.run_dir={tmp_path / 'fresh'}"))
  assert short["last_loss"] < 0.8 * short["first_loss"]
  assert long["first_loss"] < 0.85 * fresh["first_loss"], (long, fresh)
  with pytest.raises(UserError, match="was written for model.max_position_embeddings"):
    train_lib.run(load_config("tiny-v3", *text, *YARN, "train.steps=27", f"train.run_dir={tmp_path / 'short'}"))
