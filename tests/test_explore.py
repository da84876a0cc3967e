"""The sharding layout explorer: analytic bytes against real sharded arrays and XLA, collectives, planning."""

import json
import math
import os
import re
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CONFIGS, ROOT, load_config
from jaxseek import step as step_lib
from jaxseek.errors import UserError
from jaxseek.explore import __main__ as explore_cli
from jaxseek.explore import compile as explore_compile
from jaxseek.explore import core as explore
from jaxseek.explore import layout as explore_layout
from jaxseek.explore import suggest as explore_suggest
from jaxseek.input.batches import batch_shardings
from jaxseek.model import transformer
from jaxseek.sharding.mesh import make_mesh

GOLDEN = ROOT / "tests" / "golden"
MESHES = {"d2f2t2": (1, 2, 2, 1, 1, 2), "f2e2t2": (1, 1, 2, 2, 1, 2), "d8": (1, 8, 1, 1, 1, 1),
          "f4t2": (1, 1, 4, 1, 1, 2), "e4d2": (1, 2, 1, 4, 1, 1), "p2d2t2": (2, 2, 1, 1, 1, 2),
          "p2d4": (2, 4, 1, 1, 1, 1)}
TINY = ("tiny-dense", "tiny-v2", "tiny-v3")


def mesh_overrides(name):
  return [f"mesh.{a}={n}" for a, n in zip(("pipeline", "data", "fsdp", "expert", "context", "tensor"), MESHES[name])]


def sizes_of(name):
  return dict(zip(("pipeline", "data", "fsdp", "expert", "context", "tensor"), MESHES[name]))


def device_bytes(tree):
  """Bytes each device holds of a tree of real arrays: the sum of its addressable shards' sizes."""
  out = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out


@pytest.mark.parametrize("name,mesh", [("tiny-v3", "d2f2t2"), ("tiny-v3", "e4d2"), ("tiny-v2", "f4t2"),
                                       ("tiny-dense", "f2e2t2"), ("tiny-dense", "d8"), ("tiny-v3", "p2d2t2"),
                                       ("tiny-dense", "p2d4")])
def test_state_bytes_per_device_equal_real_sharded_arrays(name, mesh):
  cfg = load_config(name, *mesh_overrides(mesh))
  trainer = step_lib.make_trainer(cfg, make_mesh(cfg))
  real = jax.tree.map(lambda sh, s: jax.device_put(np.zeros(s.shape, s.dtype), sh), trainer.state_shardings,
                      trainer.abstract_state)
  memory = explore.plan(explore.describe(cfg), sizes_of(mesh), explore.hardware("h100-80g"))["memory_per_device"]
  params, opt = device_bytes((real.params, real.biases)), device_bytes(real.opt_state)
  assert len(params) == len(opt) == 8
  assert set(params.values()) == {memory["parameters"]}
  assert set(opt.values()) == {memory["optimizer"]}


def test_state_bytes_of_an_initialised_state():
  """The same equality for the state the trainer initialises (jit with out_shardings), not only device_put."""
  cfg = load_config("tiny-v3", *mesh_overrides("f2e2t2"))
  _, state = step_lib.init_state(cfg, make_mesh(cfg))
  memory = explore.plan(explore.describe(cfg), sizes_of("f2e2t2"), explore.hardware("h100-80g"))["memory_per_device"]
  assert set(device_bytes((state.params, state.biases)).values()) == {memory["parameters"]}
  assert set(device_bytes(state.opt_state).values()) == {memory["optimizer"]}


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("mesh", ["d2f2t2", "f2e2t2"])
def test_layout_matches_golden_file(name, mesh):
  """A change to the rules or the model's parameters shows up as a diff of these files (regenerate with
  JAXSEEK_UPDATE_GOLDEN=1)."""
  cfg = load_config(name, *mesh_overrides(mesh))
  got = explore.layout(explore.plan(explore.describe(cfg), sizes_of(mesh), explore.hardware("h100-80g")))
  got = json.loads(json.dumps(got))
  path = GOLDEN / f"explore-{name}-{mesh}.json"
  if os.environ.get("JAXSEEK_UPDATE_GOLDEN"):
    path.write_text(golden_text(got))
  assert got == json.loads(path.read_text())


def golden_text(layout):
  """JSON with one line per row, so that a review diff shows exactly the parameters whose layout changed."""
  parts = []
  for key, value in layout.items():
    if isinstance(value, list):
      body = ",\n".join(f"  {json.dumps(row)}" for row in value)
      parts.append(f" {json.dumps(key)}: [\n{body}\n ]")
    else:
      parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
  return "{\n" + ",\n".join(parts) + "\n}\n"


def leaves_by_path(tree):
  """The arrays of a state tree by path: dict keys and attribute names joined by ".", nnx's "value" left out."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))) for k in path]
    out[".".join(k for k in keys if k != "value")] = leaf
  return out


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("explore-*.json")), ids=lambda p: p.stem)
def test_golden_state_bytes_equal_the_real_sharded_state(path):
  """The golden files are written by the explorer, so each is checked against the trainer's real state (zeros
  placed with `state_shardings` on the golden's mesh of 8 devices): every parameter's bytes per device, every
  optimiser row (slot × stack) and the state totals equal those of the fullest device, in the file and in the
  explorer's plan now."""
  name, mesh = path.stem.removeprefix("explore-").rsplit("-", 1)
  golden = json.loads(path.read_text())
  assert golden["mesh"] == sizes_of(mesh)
  cfg = load_config(name, *mesh_overrides(mesh))
  trainer = step_lib.make_trainer(cfg, make_mesh(cfg))
  real = jax.tree.map(lambda sh, s: jax.device_put(np.zeros(s.shape, s.dtype), sh), trainer.state_shardings,
                      trainer.abstract_state)
  assert len(device_bytes(real)) == 8
  params = leaves_by_path(real.params) | leaves_by_path(real.biases)
  optimizer = {}  # (slot, stack) -> bytes per device
  for key, leaf in leaves_by_path(real.opt_state).items():
    keys = key.split(".")
    slot = next((k for k in keys if k in ("mu", "nu")), "count")
    group = optimizer.setdefault((slot, keys[keys.index(slot) + 1] if slot != "count" else None), {})
    for device, nbytes in device_bytes(leaf).items():
      group[device] = group.get(device, 0) + nbytes
  state = {"parameters": max(device_bytes((real.params, real.biases)).values()),
           "optimizer": max(device_bytes(real.opt_state).values())}
  plan = explore.layout(explore.plan(explore.describe(cfg), sizes_of(mesh), explore.hardware("h100-80g")))
  for source in (golden, json.loads(json.dumps(plan))):
    assert {r["name"]: (tuple(r["shape"]), r["dtype"]) for r in source["parameters"]} == \
        {k: (x.shape, x.dtype.name) for k, x in params.items()}
    assert {r["name"]: r["bytes_per_device"] for r in source["parameters"]} == \
        {k: max(device_bytes(x).values()) for k, x in params.items()}
    assert {(r["slot"], r["stack"]): r["bytes_per_device"] for r in source["optimizer"]} == \
        {k: max(v.values()) for k, v in optimizer.items()}
    assert source["state_bytes_per_device"] == state


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("explore-*.json")), ids=lambda p: p.stem)
def test_golden_activation_rows_equal_sizes_counted_from_the_config(path):
  """Each activation row of the golden files placed over the mesh (`name[dims]`) has the shape the config gives
  its letters (B = batch / microbatches, T = train.seq_len, D, Q, C, N, G, H, P, F, V from the model), and its
  bytes are a whole number of copies of that shape's share on one device: the product of the mesh sizes named in
  its subscripts, at the compute dtype's size."""
  name, mesh = path.stem.removeprefix("explore-").rsplit("-", 1)
  golden, sizes = json.loads(path.read_text()), sizes_of(mesh)
  cfg = load_config(name, *mesh_overrides(mesh))
  m, t = cfg.model, cfg.train
  dims = {"B": t.batch_size // t.microbatches, "T": t.seq_len, "D": m.hidden_size, "N": m.num_attention_heads,
          "G": m.kv_heads, "V": m.vocab_size, "Q": m.q_lora_rank, "C": m.kv_lora_rank,
          "H": m.qk_nope_head_dim + m.qk_rope_head_dim if m.is_mla else m.dense_head_dim,
          "P": m.v_head_dim if m.is_mla else m.dense_head_dim}
  width = {"dense layer": m.intermediate_size, "moe layer": m.moe_intermediate_size * m.n_shared_experts}
  itemsize = np.dtype(t.compute_dtype).itemsize
  checked = 0
  for row in golden["activations"]:
    if "per device" in row["placement"]:
      continue
    letters = re.findall(r"([A-Z])(?:_(\w+|\([\w,]+\)))?", row["placement"].split("[", 1)[1])
    want = [width[row["layer"]] if letter == "F" else dims[letter] for letter, _ in letters]
    assert row["shape"] == want, row
    shards = math.prod(sizes[a] for _, sub in letters for a in sub.strip("()").split(",") if sub)
    share = math.prod(want) // shards * itemsize
    assert math.prod(want) % shards == 0 and row["bytes_per_device"] % share == 0, row
    assert row["bytes_per_device"] >= share
    checked += 1
  assert checked >= 6


def test_placement_notation():
  cfg = load_config("tiny-v3", *mesh_overrides("f2e2t2"))
  rows = {r["name"]: r for r in explore.plan(explore.describe(cfg), sizes_of("f2e2t2"),
                                             explore.hardware("h100-80g"))["parameters"]}
  assert rows["dense_layers.blocks.mlp.w_gate_DF"]["placement"] == "w_gate[L, D_fsdp, F_tensor]"
  assert rows["moe_layers.blocks.mlp.w_down_EMD"]["placement"] == "w_down[L, E_expert, M_tensor, D_fsdp]"
  assert rows["dense_layers.blocks.attn.w_uqr_QNR"]["placement"] == "w_uqr[L, Q, N_tensor, R]"
  assert rows["dense_layers.blocks.attn.q_norm.scale_D"]["placement"] == "scale[L, Q]"


def collective_counts(text):
  counts = {}
  for m in re.finditer(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\(", text):
    counts[m.group(1)] = counts.get(m.group(1), 0) + 1
  return counts


def test_compiled_figures_and_collective_counts_match_the_module(tmp_path):
  """--compile: XLA's argument size equals the analytic state + batch, temporaries within 25%, and the
  collective counts it reports are those of the compiled module (counted here from a separate compilation)."""
  overrides = mesh_overrides("d2f2t2") + ["train.seq_len=16"]
  out = tmp_path / "plan.json"
  assert explore_cli.main(["--config", str(CONFIGS / "tiny-dense.yaml"), *overrides, "--compile",
                           "--json", str(out)]) == 0
  compiled = json.loads(out.read_text())["compiled"]
  assert abs(compiled["predicted_argument_bytes"] / compiled["argument_bytes"] - 1) < 0.02
  assert abs(compiled["predicted_temp_bytes"] / compiled["temp_bytes"] - 1) < 0.25
  cfg = load_config("tiny-dense", *overrides)
  mesh = make_mesh(cfg)
  trainer = step_lib.make_trainer(cfg, mesh)
  batch = {k: jax.ShapeDtypeStruct((16, 16), jnp.float32 if k == "loss_mask" else jnp.int32, sharding=s)
           for k, s in batch_shardings(mesh).items()}
  with jax.set_mesh(mesh), transformer.scanned():  # as --compile compiles it (explore/compile.py)
    text = step_lib.compile_step(trainer, cfg, mesh).lower(trainer.abstract_state, batch).compile().as_text()
  reported = {kind: sum(by_axes.values()) for kind, by_axes in compiled["collectives"].items()}
  assert reported == collective_counts(text) and sum(reported.values()) > 10
  # every collective the analytic model implies is in the module, on the axis it names
  for kind, axes in compiled["predicted_collectives"].items():
    if kind == "reduce-scatter":
      continue  # XLA:CPU emits it as all-reduce + dynamic-slice
    for axis in axes:
      assert any(axis in label.split("+") for label in compiled["collectives"].get(kind, {})), (kind, axis)


def test_compiled_expert_parallel_step_matches_analytic():
  """The MoE model with expert parallelism: all-to-all runs on the expert axis only, memory as estimated."""
  cfg = load_config("tiny-v3", *mesh_overrides("f2e2t2"), "train.seq_len=16")
  sizes = sizes_of("f2e2t2")
  compiled = explore_compile.compare(cfg, explore.describe(cfg), sizes, explore.hardware("h100-80g"))
  assert abs(compiled["predicted_argument_bytes"] / compiled["argument_bytes"] - 1) < 0.02
  assert abs(compiled["predicted_temp_bytes"] / compiled["temp_bytes"] - 1) < 0.25
  assert set(compiled["collectives"]["all-to-all"]) == {"expert"}
  assert "expert" in compiled["predicted_collectives"]["all-to-all"]


@pytest.mark.parametrize("line,axes", [
    ("all-reduce(%a), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true",
     ("data", "fsdp")),
    ("all-gather(%a), channel_id=2, replica_groups=[4,2]<=[8], dimensions={0}", ("tensor",)),
    ("all-gather(%a), channel_id=3, replica_groups=[4,2]<=[4,2]T(1,0), dimensions={0}", ("fsdp",)),
    ("all-gather(%a), channel_id=4, replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) "
     "{'axis_0'}, dimensions={0}", ("fsdp",)),
    ("collective-permute(%a), channel_id=5, source_target_pairs={{0,0},{1,2},{2,1},{3,3}}", ("fsdp", "tensor")),
    ("all-reduce(%a), channel_id=6, replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}", ()),
])
def test_collective_axes_from_replica_groups(line, axes):
  """Device groups map back to the mesh axes along which their devices differ (mesh data=2 × fsdp=2 ×
  tensor=2, device i at np.unravel_index(i, mesh shape))."""
  assert explore_compile.collective_axes(line, (1, 2, 2, 1, 1, 2)) == axes


def test_the_published_v3_config_trains_deepseeks_recipe_from_the_layout_alone():
  """configs/deepseek-v3-671b.yaml with only DeepSeek's layout (PP16 × EP64 × DP2 on 2,048 H800s): the explorer plans
  the report's recipe: 1F1B (stage inputs bounded by the stage count, not GPipe's 60 microbatches), AdamW's moments
  in bfloat16, the dispatch in float8, dropless, FP8 GEMMs on Hopper (rowwise) and Blackwell (MXFP8), and it fits
  an H800 in the explorer's estimate."""
  from jaxseek.kernels import fp8_gemm

  layout = ("mesh.pipeline=16", "mesh.expert=64", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1",
            "train.batch_size=15360", "train.seq_len=4096", "train.microbatches=60", "mesh.allow_cross_host=true")
  cfg = load_config("deepseek-v3-671b", *layout)
  plan = explore.plan(explore.describe(cfg), explore.mesh_sizes(cfg, 2048), explore.hardware("h800-80g"))
  m, t = cfg.model, cfg.train
  assert m.moe_capacity_factor is None and m.moe_dispatch_dtype == "float8_e4m3fn"
  assert fp8_gemm.resolve(t.fp8, "gpu", 9.0) == "rowwise" and fp8_gemm.resolve(t.fp8, "gpu", 10.0) == "mxfp8"
  mem = plan["memory_per_device"]
  # float32 parameters, bfloat16 mu and nu: the moments take as many bytes as the parameters (float32: twice)
  assert mem["optimizer"] == pytest.approx(mem["parameters"], rel=1e-3)
  assert mem["total"] <= 0.9 * 79.65 * 2**30
  # FP8 GEMMs timed at the float8 peak: most of the step's FLOPs
  assert plan["compute"]["fp8_flops_per_device"] > 0.8 * plan["compute"]["flops_per_device"]
  gpipe = load_config("deepseek-v3-671b", *layout, "train.pipeline_schedule=gpipe")
  gpipe_plan = explore.plan(explore.describe(gpipe), explore.mesh_sizes(gpipe, 2048), explore.hardware("h800-80g"))
  assert mem["activations"] < gpipe_plan["memory_per_device"]["activations"] / 10
  bytes_out = {c["what"].split(";")[0]: c for c in plan["communication"]["expert"] if c["collective"] == "ragged-all-to-all"}
  assert bytes_out and all("float8_e4m3fn" in what for what in bytes_out)


def test_deepseek_v3_on_2048_devices_in_seconds():
  start = time.perf_counter()
  cfg = load_config("deepseek-v3-671b", "mesh.pipeline=2", "mesh.expert=64", "mesh.data=4", "mesh.fsdp=1",
                    "mesh.tensor=4")
  sizes = explore.mesh_sizes(cfg, None)
  result = explore.plan(explore.describe(cfg), sizes, explore.hardware("h800-80g"))
  assert time.perf_counter() - start < 30
  assert result["devices"] == 2048
  main = result["total_parameters"] - result["mtp_parameters"]
  assert abs(main / 671e9 - 1) < 0.005 and 11e9 < result["mtp_parameters"] < 12.5e9
  m = cfg.model
  # 58 MoE layers: 29 per stage; the 3 dense layers (2 ∤ 3) run on both stages, data-parallel
  assert explore_layout.stage_layers(cfg, 2) == [{"dense_layers": 3, "moe_layers": 29}] * 2
  rows = {r["name"]: r for r in result["parameters"]}
  experts = 29 * (m.n_routed_experts // 64) * m.hidden_size * (m.moe_intermediate_size // 4) * 4
  assert rows["moe_layers.blocks.mlp.w_gate_EDM"]["bytes_per_device"] == experts
  assert rows["moe_layers.blocks.mlp.w_gate_EDM"]["placement"] == "w_gate[L_pipeline, E_expert, D, M_tensor]"
  assert rows["dense_layers.blocks.mlp.w_gate_DF"]["stages"] == 1
  assert rows["moe_layers.blocks.mlp.w_gate_EDM"]["stages"] == 2
  # 16 stages, as DeepSeek trained V3: 58 MoE layers padded to 16 × 4; the 3 dense layers on every stage
  assert explore_layout.stage_layers(cfg, 16) == [{"dense_layers": 3, "moe_layers": 4}] * 16
  explore.plan(explore.describe(cfg), {**sizes, "pipeline": 16, "tensor": 1, "data": 2}, explore.hardware("h800-80g"))
  with pytest.raises(UserError, match="mesh.pipeline: 32 stages split neither layer stack"):
    explore.plan(explore.describe(cfg), {**sizes, "pipeline": 32, "tensor": 1, "data": 1}, explore.hardware("h800-80g"))
  assert set(result["communication"]) >= {"pipeline", "expert", "data"}
  # on GPU the dispatch is ragged: the copy counts all-gathered, then the copies themselves
  assert {c["collective"] for c in result["communication"]["expert"]} >= {"all-gather", "ragged-all-to-all"}


def test_communication_of_pure_data_and_fsdp_parallelism():
  """Ring all-reduce moves 2(n−1)/n of the gradients over data; fsdp gathers (n−1) shards per use."""
  cfg = load_config("tiny-dense", "mesh.data=8")
  model = explore.describe(cfg)
  hw = explore.hardware("h100-80g")
  data = explore.plan(model, sizes_of("d8"), hw)
  grads = data["memory_per_device"]["parameters"]
  (reduce,) = data["communication"]["data"]
  assert reduce["collective"] == "all-reduce" and reduce["bytes_per_device"] == int(2 * 7 / 8 * grads)
  assert set(data["communication"]) == {"data"}
  fsdp = explore.plan(model, {**sizes_of("d8"), "data": 1, "fsdp": 8}, hw)["communication"]["fsdp"]
  gather = next(c for c in fsdp if c["collective"] == "all-gather")
  split = sum(r["bytes_per_device"] for r in explore.plan(model, {**sizes_of("d8"), "data": 1, "fsdp": 8}, hw)
              ["parameters"] if "fsdp" in sum(r["mesh_axes"], []))
  assert gather["bytes_per_device"] == 2 * 7 * split  # forward and backward, float32 compute


def test_remat_and_microbatches_shrink_activations():
  cfg = load_config("demo")
  model, hw, sizes = explore.describe(cfg), explore.hardware("h100-80g"), sizes_of("d2f2t2")
  base = explore.plan(model, sizes, hw)["memory_per_device"]
  remat = explore.plan(model.with_train(remat="full"), sizes, hw)["memory_per_device"]
  micro = explore.plan(model.with_train(microbatches=2), sizes, hw)["memory_per_device"]
  assert remat["activations"] < base["activations"] / 2 and remat["parameters"] == base["parameters"]
  assert micro["activations"] < base["activations"] and micro["gradients"] == 2 * base["gradients"]


def test_suggest_tries_the_tensor_ranks_as_expert_shards():
  """DeepSeek-V3 on fsdp 4 × expert 4 × tensor 16 (256 H100s): the search plans model.moe_tensor both ways and
  keeps experts, whose tensor ranks dispatch each token once instead of 16 times: less exposed expert exchange, a
  shorter predicted step, and the override in the result."""
  cfg = load_config("deepseek-v3-671b", "mesh.allow_cross_host=true", "train.batch_size=1024",
                    "model.moe_capacity_factor=null")
  model, hw = explore.describe(cfg), explore.hardware("h100-80g")
  sizes = dict(pipeline=1, data=1, fsdp=4, expert=4, context=1, tensor=16)
  assert [o for _, o in explore_suggest._moe_tensor_options(model, sizes)] == ["split", "experts"]
  best = explore_suggest.evaluate(model, sizes, hw)
  at = dict(remat=best.remat, microbatches=best.microbatches)
  split = explore_suggest.measure(model.with_train(**at), sizes, hw)
  experts = explore_suggest.measure(model.with_model(moe_tensor="experts").with_train(**at), sizes, hw)
  assert best.moe_tensor == "experts" and best.step_s == pytest.approx(experts.step_s) and experts.step_s < split.step_s
  assert experts.parts["exposed expert exchange"] < 0.5 * split.parts["exposed expert exchange"]
  assert "model.moe_tensor=experts" in best.overrides()


def test_suggest_for_deepseek_llm_7b_and_compile_the_best(tmp_path):
  """8 devices of 80 GB: layouts that fit, fastest first, each with why it loses; the first compiles."""
  cfg = load_config("deepseek-llm-7b")
  hw = explore.hardware("h100-80g")
  rows = explore_suggest.suggest(explore.describe(cfg), 8, hw)
  assert 3 <= len(rows) <= 10
  assert all(r["memory_bytes"] <= hw.memory_bytes * hw.usable_fraction for r in rows)
  assert [r["predicted_step_s"] for r in rows] == sorted(r["predicted_step_s"] for r in rows)
  assert all(r["why_not_first"].startswith("+") for r in rows[1:] if r["predicted_step_s"] > rows[0]["predicted_step_s"])
  assert all(math.prod(r["mesh"].values()) == 8 for r in rows)
  out = tmp_path / "best.json"
  best = rows[0]["overrides"] + ["train.seq_len=128"]
  assert explore_cli.main(["--config", str(CONFIGS / "deepseek-llm-7b.yaml"), *best, "--compile",
                           "--json", str(out)]) == 0
  compiled = json.loads(out.read_text())["compiled"]
  assert abs(compiled["predicted_argument_bytes"] / compiled["argument_bytes"] - 1) < 0.02


def test_out_of_memory_names_the_explorer_and_a_change_that_fits():
  cfg = load_config("deepseek-llm-7b", "mesh.fsdp=8")
  hw = explore.hardware("a100-40g")
  error = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9663676416 bytes.")
  line = explore_suggest.explain_oom(cfg, error, "configs/deepseek-llm-7b.yaml", ["mesh.fsdp=8"], devices=8, hw=hw)
  assert "python -m jaxseek.explore --config configs/deepseek-llm-7b.yaml mesh.fsdp=8 --devices 8" in line
  change = re.search(r"try (.*?);", line).group(1).split()
  fixed = load_config("deepseek-llm-7b", "mesh.fsdp=8", *change)
  memory = explore.plan(explore.describe(fixed), explore.mesh_sizes(fixed, 8), hw)
  assert memory["memory"]["fits"] and "\n" not in line
  assert explore_suggest.explain_oom(cfg, ValueError("shapes do not match"), None, [], devices=8, hw=hw) is None


def test_json_schema_and_user_errors(tmp_path, capsys):
  out = tmp_path / "plan.json"
  assert explore_cli.main(["--config", str(CONFIGS / "tiny-v2.yaml"), *mesh_overrides("f2e2t2"),
                           "--json", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["total_parameters"] == explore.describe(load_config("tiny-v2")).total_parameters
  assert set(result["memory_per_device"]) == {"parameters", "gradients", "optimizer", "activations", "moe_dispatch",
                                              "gathered_weights", "other", "total"}
  assert set(result["communication"]) == {"fsdp", "expert", "tensor"}
  capsys.readouterr()
  assert explore_cli.main(["--config", str(CONFIGS / "tiny-v2.yaml"), "--suggest"]) == 2
  assert "--devices" in capsys.readouterr().err
  plot = explore_cli.main(["--config", str(CONFIGS / "tiny-v2.yaml"), *mesh_overrides("f2e2t2"),
                           "--plot", str(tmp_path / "p.png")])
  err = capsys.readouterr().err
  try:
    import matplotlib  # noqa: F401
    assert plot == 0 and (tmp_path / "p.png").stat().st_size > 1000
  except ImportError:
    assert plot == 2 and err.count("\n") == 1 and "matplotlib" in err
  # an output path that cannot be written: one line, exit 2, before any work
  for flag, path, words in (("--json", tmp_path / "no" / "plan.json", "folder " + str(tmp_path / "no") +
                             " does not exist"), ("--json", tmp_path, "is a folder; name a file"),
                            ("--devices", 0, "--devices 0 must be ≥ 1"), ("--devices", -8, "--devices -8 must be ≥ 1"),
                            ("--devices-per-node", 0, "--devices-per-node 0 must be ≥ 1")):
    assert explore_cli.main(["--config", str(CONFIGS / "tiny-v2.yaml"), flag, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
  # targets and kernels
  for args, words in ((["--target", "a100"], "--target names the GPU to --compile for; add --compile"),
                      (["model.attention_impl=mosaic", "train.compute_dtype=bfloat16", "--compile", "--target", "a100",
                        "--devices", "1"],
                       "mosaic (tokamax's Mosaic GPU kernels) runs on sm_90 and sm_100 GPUs and this is sm_80"),
                      (["model.attention_impl=mosaic", "--device-memory", "a100-80g", "--devices", "1"],
                       "mosaic takes bfloat16"),
                      (["model.moe_matmul=warp"], "config key model.moe_matmul")):
    assert explore_cli.main(["--config", str(CONFIGS / "tiny-v2.yaml"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err, err


EXPLORE_BAD_FLAGS = [
    (["--device-memory", "80..GiB"], "--device-memory '80..GiB' is neither a known device"),
    (["--device-memory", "1.2.3"], "--device-memory '1.2.3' is neither a known device"),
    (["--device-memory", "0"], "--device-memory '0' is not a device's memory; give a size from 1 byte"),
    (["--device-memory", "0GiB"], "--device-memory '0GiB' is not a device's memory"),
    (["--device-memory", "1e400"], "--device-memory '1e400' is not a device's memory"),
    (["--usable-fraction", "0"], "--usable-fraction 0 must be in (0, 1]"),
    (["--usable-fraction", "1.5"], "--usable-fraction 1.5 must be in (0, 1]"),
    (["--peak-tflops", "-5"], "--peak-tflops -5 must be a positive number"),
    (["--peak-tflops", "0"], "--peak-tflops 0 must be a positive number"),
    (["--intra-node-gbps", "-1"], "--intra-node-gbps -1 must be a positive number"),
    (["--inter-node-gbps", "0"], "--inter-node-gbps 0 must be a positive number"),
    (["--top", "0", "--suggest"], "--top 0 must be ≥ 1"),
]


@pytest.mark.parametrize("args,words", EXPLORE_BAD_FLAGS, ids=[" ".join(a[:2]) for a, _ in EXPLORE_BAD_FLAGS])
def test_bad_hardware_flags_are_one_line(args, words, tmp_path, capsys):
  """A malformed or empty size, a share outside (0, 1], a rate ≤ 0: one line, exit 2, nothing written."""
  out = tmp_path / "plan.json"
  assert explore_cli.main(["--config", str(CONFIGS / "tiny-v2.yaml"), "--devices", "8", "--json", str(out),
                           *args]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith(f"error: {words}") and "Traceback" not in err, err
  assert not out.exists()


def test_deepseek_v3_published_layout_and_batch():
  """DeepSeek-V3's training layout (16 stages × 64-way expert × 2 data = 2,048 GPUs) with its batch of 15,360
  sequences, which 2,048 does not divide: the explorer plans it with the parts outside the schedule split over
  expert × data only, and says so. Under GPipe the 3 dense layers, the embedding and the head run outside the
  schedule on all 120 sequences of a replica (over 100 GiB of activations a device); under 1F1B they run per
  microbatch inside it (on the first and last stage, as DeepSeek ran them), and with bfloat16 parameters and
  a capacity factor the layout fits an 80 GiB device."""
  overrides = ("mesh.pipeline=16", "mesh.expert=64", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1",
               "train.batch_size=15360", "train.microbatches=120", "train.seq_len=4096")
  bf16 = ("train.param_dtype=bfloat16", "train.compute_dtype=bfloat16", "model.moe_capacity_factor=1.25")
  plans = {}
  for name, extra in (("gpipe", ()), ("1f1b", ()), ("1f1b-bf16", bf16)):
    cfg = load_config("deepseek-v3-671b", *overrides, *extra, f"train.pipeline_schedule={name.split('-')[0]}")
    sizes = explore.mesh_sizes(cfg, None)
    plans[name] = explore.plan(explore.describe(cfg), sizes, explore.hardware("h800-80g"))
  assert plans["1f1b"]["devices"] == 2048
  assert "is not divisible by pipeline x data x fsdp x expert = 2048" in plans["1f1b"]["pipeline"]
  assert "29 microbatch stage inputs + 1 cotangents kept per stage" in plans["1f1b"]["pipeline"]
  assert "all microbatches' activations kept" in plans["gpipe"]["pipeline"]
  activations = {k: plan["memory_per_device"]["activations"] for k, plan in plans.items()}
  assert activations["gpipe"] > 100 * 2**30 and not plans["gpipe"]["memory"]["fits"]
  assert activations["1f1b"] < 8 * 2**30, activations
  assert plans["1f1b-bf16"]["memory"]["fits"] and plans["1f1b-bf16"]["memory_per_device"]["total"] < 80 * 2**30


def test_ragged_dispatch_bytes_equal_a_hand_count():
  """tiny-v3 on expert 4 × data 2, one microbatch, no remat, float8 dispatch, 2 GPUs a node. A device holds
  x = 16·24 / 8 = 48 tokens and sends J = K·x = 96 copies, 3/4 of them to other shards: per MoE layer the
  forward sends them as float8 rows (40 bytes + one float32 scale) and gets the float32 results back; the
  backward sends the results' gradients to the experts as float8 rows too and gets the rows' gradients back in
  float32; before the forward each device all-gathers the 8 experts' counts of the 3 others. 2 MoE layers. Of
  the copies that leave, 1/3 go to the one other shard of the node."""
  cfg = load_config("tiny-v3", *mesh_overrides("e4d2"), "model.moe_dispatch_dtype=float8_e4m3fn",
                    "model.moe_dispatch=ragged")
  hw = explore.hardware("h100-80g", devices_per_node=2)
  plan = explore.plan(explore.describe(cfg), sizes_of("e4d2"), hw)
  leaving, row_fp8, row_f32 = 96 * 3 // 4, 40 + 4, 40 * 4
  per_layer = 2 * leaving * (row_fp8 + row_f32) + 3 * 8 * 4
  dispatch = plan["expert_dispatch"]
  assert (dispatch["kind"], dispatch["rows_sent"], dispatch["rows_received"]) == ("ragged", 96, 192)  # R = 2·J
  assert dispatch["bytes_total"] == 2 * per_layer
  rows = {(c["collective"], c["link"]): c["bytes_per_device"] for c in plan["communication"]["expert"]
          if c["collective"] != "all-reduce"}
  assert rows == {("ragged-all-to-all", "inter-node"): 2 * (per_layer - 96) * 2 // 3,
                  ("ragged-all-to-all", "intra-node"): 2 * (per_layer - 96) // 3,
                  ("all-gather", "inter-node"): 2 * 96}
  buffers = {r["name"]: r["shape"] for r in plan["activations"] if r["scope"] == "moe"}
  assert buffers["rows received (float8 + scales)"] == [192, 44] and buffers["results returned"] == [96, 40]


def test_two_stage_dispatch_bytes_equal_a_hand_count():
  """The same layout with model.moe_dispatch=two_stage (the expert axis spans 2 nodes of 2 shards).
  Across nodes, per MoE layer: each of the x = 48 tokens' rows goes to the c other nodes its experts are on
  (comm.nodes_reached) — in the forward as a float8 row with K = 2 expert ids and gate weights (2K float32) out
  and its float32 sum back, in the backward the sum's gradient out and the row's gradient back (float32) with the
  weights' gradients. Within the node half of the K·x copies go to the other shard, out as float8 rows and back
  in float32, forward and backward. The counts: 2 nodes' counts across, 2 shards × 2 experts within."""
  from jaxseek.explore import comm

  cfg = load_config("tiny-v3", *mesh_overrides("e4d2"), "model.moe_dispatch_dtype=float8_e4m3fn",
                    "model.moe_dispatch=two_stage")
  hw = explore.hardware("h100-80g", devices_per_node=2)
  plan = explore.plan(explore.describe(cfg), sizes_of("e4d2"), hw)
  x, K, row_fp8, row_f32, meta = 48, 2, 40 + 4, 40 * 4, 2 * 2 * 4
  c = comm.nodes_reached(cfg, 4, 2)
  inter = x * c * ((row_fp8 + meta + row_f32) + (2 * row_f32 + meta))
  intra = 2 * x * K / 2 * (row_fp8 + row_f32)
  counts = (1 * 2 + 1 * 2 * 2) * 4
  dispatch = plan["expert_dispatch"]
  assert dispatch["kind"] == "two_stage" and 0 < c <= dispatch["inter_node_sends_per_token_one_per_node_max"] == 1
  assert dispatch["bytes_inter_node"] == pytest.approx(2 * inter)
  assert dispatch["bytes_total"] == pytest.approx(2 * (inter + intra + counts))
  rows = {c["link"]: c["bytes_per_device"] for c in plan["communication"]["expert"]
          if c["collective"] == "ragged-all-to-all"}
  assert rows == pytest.approx({"inter-node": 2 * inter, "intra-node": 2 * intra}, abs=1)  # whole bytes
  one = explore.plan(explore.describe(load_config("tiny-v3", *mesh_overrides("e4d2"), "model.moe_dispatch=ragged",
                                                  "model.moe_dispatch_dtype=float8_e4m3fn")), sizes_of("e4d2"), hw)
  assert dispatch["bytes_inter_node"] < one["expert_dispatch"]["bytes_inter_node"]
  # memory: the buffers of sharding/experts.py experts_two_stage, the first stage's as the rows it sends (reach·x,
  # reach = min(N, K) = 2 nodes, its own included) and receives a round (f·x·reach, at most N·x), the second
  # stage's window W = min(R₁·K, R) with R = f·K·x
  f, N = cfg.model.moe_recv_factor, 2
  R1 = min(N * x, math.ceil(f * x * min(N, K)))
  W = min(R1 * K, math.ceil(f * K * x))
  buffers = {r["name"]: r["shape"] for r in plan["activations"] if r["scope"] == "moe"}
  assert buffers["node rows sent"] == [min(N, K) * x, 40] and buffers["node rows received"] == [R1, 40]
  assert buffers["node rows received (float8 + scales)"] == [R1, row_fp8]
  assert buffers["token copies sorted by expert"] == [W, 40] and buffers["rows received, dequantised"] == [W, 40]
  # in 2 chunks each chunk of x/2 tokens has an exchange of its own (experts.routed): the buffers hold one chunk's,
  # and the bytes moved stay those of all x tokens
  cfg2 = load_config("tiny-v3", *mesh_overrides("e4d2"), "model.moe_dispatch_dtype=float8_e4m3fn",
                     "model.moe_dispatch=two_stage", "model.moe_overlap_chunks=2")
  plan2 = explore.plan(explore.describe(cfg2), sizes_of("e4d2"), hw)
  halves = {r["name"]: r["shape"] for r in plan2["activations"] if r["scope"] == "moe"}
  x2 = x // 2
  R1 = min(N * x2, math.ceil(f * x2 * min(N, K)))
  assert halves["node rows sent"] == [min(N, K) * x2, 40] and halves["node rows received"] == [R1, 40]
  assert halves["token copies sorted by expert"] == [min(R1 * K, math.ceil(f * K * x2)), 40]
  assert plan2["expert_dispatch"]["bytes_inter_node"] == pytest.approx(dispatch["bytes_inter_node"])


def test_nodes_a_token_reaches_match_the_closed_form():
  """comm.nodes_reached against the exact expectation. DeepSeek-V3 on 64 shards, 8 to a node: a group's 32
  experts fill one node, a token picks 4 of the 8 nodes and 8 of their 128 experts; a chosen node is missed with
  q = C(96, 8) / C(128, 8); the token's own node is one of the 4 with probability 1/2, so it reaches
  4(1 − q) − (1 − q)/2 others. Greedy routing: 8 of 256 experts on 8 nodes of 32, q = C(224, 8) / C(256, 8),
  8(1 − q) − (1 − q) others."""
  from jaxseek.explore import comm

  cfg = load_config("deepseek-v3-671b")
  q = math.comb(96, 8) / math.comb(128, 8)
  assert comm.nodes_reached(cfg, 64, 8) == pytest.approx(3.5 * (1 - q), abs=0.03)
  greedy = load_config("deepseek-v3-671b", "model.topk_method=greedy")
  q = math.comb(224, 8) / math.comb(256, 8)
  assert comm.nodes_reached(greedy, 64, 8) == pytest.approx(7 * (1 - q), abs=0.03)


def test_gradient_sums_on_gradsum_axes_run_once_per_step():
  """More microbatches repeat the gradient all-reduce of an axis the step sums per microbatch, not of one it
  sums once per step (sharding/gradsum.py)."""
  from jaxseek.explore import comm as explore_comm

  cfg = load_config("tiny-v3", *mesh_overrides("e4d2"))
  model, hw, sizes = explore.describe(cfg), explore.hardware("h100-80g"), sizes_of("e4d2")
  once = explore_comm.summed_axes(cfg, sizes)
  assert "data" in once
  reductions = {}
  for micro in (1, 2, 4):
    comm = explore.plan(model.with_train(microbatches=micro), sizes, hw)["communication"]
    reductions[micro] = {axis: next((c["count"], c["bytes_per_device"]) for c in comm[axis]
                                    if c["collective"] == "all-reduce") for axis in ("data", "expert")}
  for axis in ("data", "expert"):
    counts = [reductions[m][axis] for m in (1, 2, 4)]
    if axis in once:
      assert counts[0] == counts[1] == counts[2]
    else:
      assert [c[0] for c in counts] == [counts[0][0] * m for m in (1, 2, 4)]


def test_weights_outside_the_pipelined_stack_are_stored_over_the_stages():
  """tiny-dense on pipeline 2 × data 4 under 1F1B: both layers are pipelined (one a stage); the embedding
  [V, D], final norm [D] and head [D, V] are stored split over the stages on D, so a stage holds half of
  every parameter; it gathers them whole once per step (float32), accumulates their gradients in float32 in
  one buffer as long as the larger part (the first stage's embedding, the last stage's norm and head:
  restgrads.RestGrads), and reduce-scatters them once."""
  cfg = load_config("tiny-dense", *mesh_overrides("p2d4"), "train.pipeline_schedule=1f1b", "train.microbatches=2")
  model = explore.describe(cfg)
  plan = explore.plan(model, sizes_of("p2d4"), explore.hardware("h100-80g"))
  memory = plan["memory_per_device"]
  outer = (2 * 264 * 48 + 48) * 4
  assert memory["parameters"] == model.total_parameters * 4 // 2
  assert memory["parameters"] == (model.total_parameters * 4 - outer) // 2 + outer // 2
  last = (264 * 48 + 48) * 4
  assert memory["gathered_weights"] == outer and memory["gradients"] == memory["parameters"] + last
  pipeline = {c["collective"]: c["bytes_per_device"] for c in plan["communication"]["pipeline"]}
  assert pipeline["all-gather"] == pipeline["reduce-scatter"] == outer // 2
  rows = {r["name"]: r["placement"] for r in plan["parameters"]}
  assert rows["embed.table_VD"] == "table[V, D_pipeline]" and rows["head_DV"] == "head[D_pipeline, V]"


HLO = """HloModule m, is_scheduled=true

%fused_add (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %add = f32[8]{0} add(%p0, %p0)
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped_all_to_all (q: f32[8]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  ROOT %a2a = f32[8]{0} all-to-all(%q), channel_id=3, replica_groups={{0,1}}, dimensions={0}
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8]{0} get-tuple-element(%t), index=1
  %ag-start = (f32[4]{0}, f32[8]{0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_add
  %ag-done = f32[8]{0} all-gather-done(%ag-start)
  %ar-start = f32[8]{0} all-reduce-start(%f), channel_id=2, replica_groups={{0,1}}, to_apply=%sum
  %ar-done = f32[8]{0} all-reduce-done(%ar-start)
  %a2a-start = ((f32[8]{0}), f32[8]{0}) async-start(%ar-done), calls=%wrapped_all_to_all
  %g = f32[8]{0} fusion(%ag-done), kind=kLoop, calls=%fused_add
  %a2a-done = f32[8]{0} async-done(%a2a-start)
  %cp-start = (f32[8]{0}, f32[8]{0}) collective-permute-start(%g), backend_config={"collective_backend_config":{"is_sync":true}}
  %h = f32[8]{0} fusion(%a2a-done), kind=kLoop, calls=%fused_add
  %cp-done = f32[8]{0} collective-permute-done(%cp-start)
  ROOT %out = (s32[], f32[8]{0}) tuple(%i, %cp-done)
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  ROOT %go = pred[] constant(true)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %x)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[8]{0} get-tuple-element(%w), index=1
  ROOT %r = f32[8]{0} all-reduce(%y), channel_id=5, replica_groups={{0,1}}, to_apply=%sum
}
"""


def test_overlap_of_async_collectives_in_a_scheduled_module():
  """In the loop (3 trips): the all-gather and the wrapped all-to-all have a fusion between start and done,
  the all-reduce none, the collective-permute one but XLA runs it synchronously; the final all-reduce is not
  async."""
  from jaxseek.explore import overlap

  got = {kind: (r["ops"], r["async"], r["overlapped"], r["overlapped_bytes"])
         for kind, r in overlap.overlap(HLO).items()}
  assert got == {"all-gather": (3, 3, 3, 3 * 32), "all-reduce": (4, 3, 0, 0), "all-to-all": (3, 3, 3, 3 * 32),
                 "collective-permute": (3, 3, 0, 0)}


def test_overlap_estimates_what_the_kernels_between_start_and_done_hide():
  """A 1 ms matmul (a dot fusion) beside a 2 ms all-gather within a node hides half of it; a 1 ms GEMM custom
  call beside an all-gather across two nodes that takes 4 ms hides a quarter; a 1 µs fusion beside a third
  all-gather counts as overlapped but hides almost nothing."""
  from jaxseek.explore import overlap

  hlo = """HloModule m, is_scheduled=true

%fused_dot (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[1024,1024] {
  %p0 = bf16[1024,1024]{1,0} parameter(0)
  %p1 = bf16[1024,1024]{1,0} parameter(1)
  ROOT %d = bf16[1024,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (q0: bf16[256]) -> bf16[256] {
  %q0 = bf16[256]{0} parameter(0)
  ROOT %a = bf16[256]{0} add(%q0, %q0)
}

ENTRY %main (x: bf16[1024,1024], w: bf16[1024,1024], v: bf16[256]) -> bf16[256] {
  %x = bf16[1024,1024]{1,0} parameter(0)
  %w = bf16[1024,1024]{1,0} parameter(1)
  %v = bf16[256]{0} parameter(2)
  %s1 = (bf16[1024,1024]{1,0}, bf16[8192,1024]{1,0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %g = bf16[1024,1024]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot
  %d1 = bf16[8192,1024]{1,0} all-gather-done(%s1)
  %s2 = (bf16[1024,1024]{1,0}, bf16[2048,1024]{1,0}) all-gather-start(%g), channel_id=2, replica_groups={{0,8}}, dimensions={0}
  %h = bf16[1024,1024]{1,0} custom-call(%x, %w), custom_call_target="__cublas$gemm"
  %d2 = bf16[2048,1024]{1,0} all-gather-done(%s2)
  %s3 = (bf16[1024,1024]{1,0}, bf16[8192,1024]{1,0}) all-gather-start(%h), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %f = bf16[256]{0} fusion(%v), kind=kLoop, calls=%fused_add
  %d3 = bf16[8192,1024]{1,0} all-gather-done(%s3)
  ROOT %out = bf16[256]{0} add(%f, %f)
}
"""
  big, cross = 8192 * 1024 * 2, 2048 * 1024 * 2
  rates = overlap.Rates(flops=2 * 1024**3 / 1e-3, memory=1e12, intra_node=big / 2e-3, inter_node=cross / 4e-3,
                        per_node=8)
  row = overlap.overlap(hlo, rates)["all-gather"]
  assert row["overlapped"] == 3 and row["overlapped_bytes"] == 2 * big + cross
  tiny = (2 * 512 / 1e12) / 2e-3  # the add fusion writes 512 bytes (and reads as many) beside a 2 ms transfer
  assert row["hidden_bytes"] == pytest.approx(0.5 * big + 0.25 * cross + tiny * big)
  assert overlap.overlap(hlo)["all-gather"]["hidden_bytes"] == 0  # no rates, no estimate
  est = overlap.beside_estimate({"all-gather": row}, {"x": [{"collective": "all-gather", "time_s": 1.0}]}, 5.0)
  assert est["step_if_estimate_hidden_s"] == pytest.approx(5.0 - row["hidden_bytes"] / (2 * big + cross))
  assert est["step_if_overlap_hidden_s"] == 4.0


def test_overlap_counts_what_runs_every_step_apart():
  """An all-gather that always runs, with a fusion beside it, and one in a further round of the dropless
  exchange (marked jaxseek_round="further": it runs only under skew) with nothing beside it: both count in the
  ops and bytes, only the first in what runs every step, so 100% of those bytes overlap and 50% of all."""
  from jaxseek.explore import overlap

  hlo = """HloModule m, is_scheduled=true

%fused_add (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %add = f32[8]{0} add(%p0, %p0)
}

%round (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %s = (f32[4]{0}, f32[8]{0}) all-gather-start(%x), channel_id=2, replica_groups={{0,1}}, dimensions={0}, frontend_attributes={jaxseek_round="further"}
  ROOT %d = f32[8]{0} all-gather-done(%s)
}

%skip (y: f32[8]) -> f32[8] {
  ROOT %y = f32[8]{0} parameter(0)
}

ENTRY %main (x: f32[8], p: pred[]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %p = pred[] parameter(1)
  %s = (f32[4]{0}, f32[8]{0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_add
  %d = f32[8]{0} all-gather-done(%s)
  ROOT %c = f32[8]{0} conditional(%p, %d, %f), true_computation=%round, false_computation=%skip
}
"""
  row = overlap.overlap(hlo)["all-gather"]
  assert (row["ops"], row["overlapped"], row["bytes"], row["always_bytes"]) == (2, 1, 64, 32)
  assert row["always_overlapped_bytes"] == row["overlapped_bytes"] == 32
  est = overlap.beside_estimate({"all-gather": row}, {"x": [{"collective": "all-gather", "time_s": 2.0}]}, 10.0)
  assert est["kinds"]["all-gather"]["overlapped_share"] == 0.5
  assert est["step_if_overlap_hidden_s"] == 8.0  # the always-run share (all of it) of the 2 s hidden
  assert est["step_if_estimate_hidden_s"] == 10.0  # without Rates nothing is estimated hidden


def test_collective_bytes_weigh_loop_bodies_by_their_trip_count():
  """The same module: per step, 3 all-gathers of f32[8] (the start's output element, not its operand), 3
  all-reduces in the loop and 1 after it, 3 wrapped all-to-alls, over devices {0, 1} (the `pipeline` axis of a
  mesh of 2), and 3 collective-permutes without pairs (axes unknown: "?")."""
  from jaxseek.explore import compile as explore_compile

  got = explore_compile.collective_bytes(HLO, (2, 1, 1, 1, 1, 1))
  assert got == {"all-gather": {"pipeline": 3 * 32}, "all-reduce": {"pipeline": 4 * 32},
                 "all-to-all": {"pipeline": 3 * 32}, "collective-permute": {"?": 3 * 32}}
  assert explore_compile.gradient_reduction_bytes(got) == 4 * 32
  assert explore_compile._tuple_elements("(bf16[1,24]{1,0}, (f32[2]{0}, s32[]), u32[])") == \
      ["bf16[1,24]{1,0}", "(f32[2]{0}, s32[])", "u32[]"]


def test_group_limited_routing_bounds_the_nodes_a_token_reaches():
  """DeepSeek-V3's routing keeps the 4 best of 8 groups of 32 experts: on 64 expert shards of 8 to a node a
  group fills one node, so a token reaches at most 4 nodes (32 shards); on 16 shards a group is 2 shards of a
  2-node axis; greedy top-k routing has no such bound."""
  from jaxseek.explore import comm

  cfg = load_config("deepseek-v3-671b")
  assert comm.group_reach(cfg, 64, 8) == (32, 4)
  assert comm.group_reach(cfg, 16, 8) == (8, 2)
  assert comm.group_reach(cfg, 64, 4) == (32, 8)  # a group spans 2 nodes of 4 shards
  greedy = load_config("deepseek-v3-671b", "model.topk_method=greedy")
  assert comm.group_reach(greedy, 64, 8) is None


def test_fp8_gemms_are_timed_at_the_float8_peak():
  """train.fp8: the attention and MLP projections' FLOPs (forward and both gradients: 6 per weight element and
  token) run at the GPU's float8 peak, the head and attention scores at its bfloat16 peak; the emulated
  blockwise recipe and a GPU without FP8 (explorer plans refuse it) keep everything at bfloat16."""
  from jaxseek.explore import comm

  def compute(*overrides, device="h100-80g"):
    cfg = load_config("tiny-dense", "mesh.data=1", *overrides)
    return comm.compute_seconds(explore.describe(cfg), explore.mesh_sizes(cfg, 1), explore.hardware(device))

  m = load_config("tiny-dense").model
  D, F, N, G, H, L = (m.hidden_size, m.intermediate_size, m.num_attention_heads, m.num_key_value_heads,
                      m.head_dim, m.num_hidden_layers)
  per_token = 6 * L * (D * N * H * 2 + 2 * D * G * H + 3 * D * F)  # q, o, k, v, then gate, up, down
  tokens = 16 * 24
  bf16, fp8, blockwise = compute(), compute("train.fp8=true"), compute("train.fp8=blockwise")
  assert fp8["fp8_flops_per_device"] == pytest.approx(per_token * tokens)
  assert fp8["time_s"] == pytest.approx((bf16["flops_per_device"] - per_token * tokens) / 989e12
                                        + per_token * tokens / 1979e12)
  assert fp8["time_at_bf16_s"] == pytest.approx(bf16["time_s"])
  assert blockwise["time_s"] == pytest.approx(bf16["time_s"]) and not blockwise["fp8_flops_per_device"]
  with pytest.raises(UserError, match="sm_89 or later"):
    compute("train.fp8=true", device="a100-80g")


def test_the_compiled_fp8_share_counts_the_recipes_gemms_by_name_and_operand_type():
  """explore/compile.matmul_flops on a hand-written module: a float8 projection inside a GEMM fusion in a loop
  of 3 trips, its bfloat16 gradient, a float8 grouped expert GEMM (custom call) and the head's bfloat16 dot; the
  recipe's GEMMs are the projections and experts (by their names), the head counts only in all."""
  hlo = """HloModule m, is_scheduled=true

%gemm (p0: f8e4m3fn[64,128], p1: f8e4m3fn[128,32]) -> f32[64,32] {
  %p0 = f8e4m3fn[64,128]{1,0} parameter(0)
  %p1 = f8e4m3fn[128,32]{1,0} parameter(1)
  ROOT %d = f32[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/fp8_rowwise/BTD,DF->BTF/dot_general"}
}

%body (t: (s32[], f8e4m3fn[64,128], f8e4m3fn[128,32])) -> (s32[], f8e4m3fn[64,128], f8e4m3fn[128,32]) {
  %t = (s32[], f8e4m3fn[64,128]{1,0}, f8e4m3fn[128,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f8e4m3fn[64,128]{1,0} get-tuple-element(%t), index=1
  %w = f8e4m3fn[128,32]{1,0} get-tuple-element(%t), index=2
  %y = f32[64,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm
  ROOT %r = (s32[], f8e4m3fn[64,128]{1,0}, f8e4m3fn[128,32]{1,0}) tuple(%i, %x, %w)
}

%cond (c: (s32[], f8e4m3fn[64,128], f8e4m3fn[128,32])) -> pred[] {
  %c = (s32[], f8e4m3fn[64,128]{1,0}, f8e4m3fn[128,32]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: f8e4m3fn[64,128], b: f8e4m3fn[128,32], g: bf16[64,32], v: bf16[128,1000], e: f8e4m3fn[4,128,32], bw: bf16[128,32]) -> bf16[64,128] {
  %a = f8e4m3fn[64,128]{1,0} parameter(0)
  %b = f8e4m3fn[128,32]{1,0} parameter(1)
  %g = bf16[64,32]{1,0} parameter(2)
  %v = bf16[128,1000]{1,0} parameter(3)
  %e = f8e4m3fn[4,128,32]{2,1,0} parameter(4)
  %z = s32[] constant(0)
  %init = (s32[], f8e4m3fn[64,128]{1,0}, f8e4m3fn[128,32]{1,0}) tuple(%z, %a, %b)
  %loop = (s32[], f8e4m3fn[64,128]{1,0}, f8e4m3fn[128,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %bw = bf16[128,32]{1,0} parameter(5)
  %dx = bf16[64,128]{1,0} dot(%g, %bw), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(step)/transpose(jvp(BTD,DF->BTF))/dot_general"}
  %ex = f32[64,32]{1,0} custom-call(%a, %e), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/routed_experts/RD,EDM->RM/tokamax"}
  %xh = bf16[64,128]{1,0} convert(%a)
  %head = bf16[64,1000]{1,0} dot(%xh, %v), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/BcD,DV->BcV/dot_general"}
  ROOT %out = bf16[64,128]{1,0} add(%dx, %dx)
}
"""
  got = explore_compile.matmul_flops(hlo)
  projection, gradient, expert, head = 3 * 2 * 64 * 32 * 128, 2 * 64 * 128 * 32, 2 * 64 * 32 * 128, 2 * 64 * 1000 * 128
  assert got["recipe"] == projection + gradient + expert
  assert got["recipe_f8"] == projection + expert
  assert got["all"] == got["recipe"] + head and got["all_f8"] == got["recipe_f8"]


def test_overlap_weighs_a_pipeline_ticks_branches_by_their_share():
  """A loop of 10 ticks whose conditional runs a paired branch (share 0.3: an all-gather with a fusion beside it)
  or a serial one (share 0.7: an all-gather with nothing beside it, and a conditional inside it whose branch
  carries the serial share too, since its ops were made inside it: not applied twice). 3 paired and 7 + 7 serial
  runs, so 3 of 17 all-gathers overlap; without the shares every branch would count 10 times."""
  from jaxseek.explore import overlap

  gather = lambda name, share: (
      f"%{name} (x: f32[8]) -> f32[8] {{\n  %x = f32[8]{{0}} parameter(0)\n"
      f"  %s = (f32[4]{{0}}, f32[8]{{0}}) all-gather-start(%x), channel_id=1, replica_groups={{{{0,1}}}}, "
      f"dimensions={{0}}, frontend_attributes={{jaxseek_share=\"{share}\"}}\n"
      + ("  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_add\n" if name == "paired" else "")
      + f"  ROOT %d = f32[8]{{0}} all-gather-done(%s)\n}}\n")
  hlo = f"""HloModule m, is_scheduled=true

%fused_add (p0: f32[8]) -> f32[8] {{
  %p0 = f32[8]{{0}} parameter(0)
  ROOT %add = f32[8]{{0}} add(%p0, %p0)
}}

{gather("paired", 0.3)}
{gather("inner", 0.7)}
%skip (y: f32[8]) -> f32[8] {{
  ROOT %y = f32[8]{{0}} parameter(0)
}}

%serial (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  %s = (f32[4]{{0}}, f32[8]{{0}}) all-gather-start(%x), channel_id=2, replica_groups={{{{0,1}}}}, dimensions={{0}}, frontend_attributes={{jaxseek_share="0.7"}}
  %d = f32[8]{{0}} all-gather-done(%s)
  %p = pred[] constant(true)
  ROOT %c = f32[8]{{0}} conditional(%p, %d, %d), true_computation=%inner, false_computation=%skip, frontend_attributes={{jaxseek_share="0.7"}}
}}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %t = (s32[], f32[8]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8]{{0}} get-tuple-element(%t), index=1
  %b = s32[] constant(1)
  %y = f32[8]{{0}} conditional(%b, %x, %x), branch_computations={{%serial, %paired}}
  ROOT %out = (s32[], f32[8]{{0}}) tuple(%i, %y)
}}

%cond (c: (s32[], f32[8])) -> pred[] {{
  %c = (s32[], f32[8]{{0}}) parameter(0)
  ROOT %go = pred[] constant(true)
}}

ENTRY %main (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{{0}}) tuple(%zero, %x)
  %w = (s32[], f32[8]{{0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"10"}}}}
  ROOT %r = f32[8]{{0}} get-tuple-element(%w), index=1
}}
"""
  row = overlap.overlap(hlo)["all-gather"]
  assert row["ops"] == pytest.approx(17) and row["overlapped"] == pytest.approx(3)
  assert row["bytes"] == pytest.approx(17 * 32) and row["overlapped_bytes"] == pytest.approx(3 * 32)


def test_analytic_profile_times_each_transfer_and_kernel():
  """The PGLE profile written from a compiled module (train.pgle_profile): each async start costs its transfer
  (bytes the done delivers over the link its groups use) and each fusion its time at the rates, by name, once; ops
  that are neither (parameters, tuples, dones) have no entry."""
  from jaxseek.explore import overlap

  rates = overlap.Rates(flops=1e12, memory=1e6, intra_node=1e6, inter_node=1e3, per_node=8)
  got = dict(re.findall(r'costs \{ name: "([\w.\-]+)" cost_us: ([\d.]+) \}', overlap.analytic_profile(HLO, rates)))
  assert set(got) == {"ag-start", "ar-start", "a2a-start", "cp-start", "f", "g", "h"}
  assert float(got["ag-start"]) == pytest.approx(32 / 1e6 * 1e6)  # 32 bytes within a node at 1 MB/s: 32 µs
  assert float(got["f"]) == pytest.approx(2 * 32 / 1e6 * 1e6)  # writes and reads 32 bytes at 1 MB/s: 64 µs
  from jaxseek.kernels import choice
  written = Path(tempfile.mkdtemp()) / "costs.pbtxt"  # a train.pgle_profile the run's check reads as XLA would
  written.write_text(overlap.analytic_profile(HLO, rates))
  assert choice.pgle_profile_error(str(written)) is None
