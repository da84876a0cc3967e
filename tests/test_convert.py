"""Conversion: HF → jaxseek → HF bit for bit, MTP rows, FP8 dequantisation, sharded loading, config.json
mapping, and the one-line errors of scripts/convert_checkpoint.py."""

import importlib.util
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from conftest import ROOT, load_config
from jaxseek import config as config_lib
from jaxseek.config import MESH_AXES
from jaxseek.convert import hf, pretrained
from jaxseek.errors import UserError
from jaxseek.sharding import rules

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from test_parity import EAGER, VARIANTS, hf_model, save, with_mtp_layer  # noqa: E402

_spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "scripts" / "convert_checkpoint.py")
convert_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_cli)


def tensors_of(folder) -> dict:
  """Every tensor of an HF folder (single file or shards)."""
  out = {}
  for file in sorted(folder.glob("*.safetensors")):
    out.update(load_file(file))
  return out


def assert_bitwise_equal(a: dict, b: dict):
  assert sorted(a) == sorted(b)
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
    assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


def variables(model) -> dict:
  return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))}


def cli_ok(*args):
  assert convert_cli.main(list(map(str, args))) == 0


# ------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("name,dtype,shard", [("v3_q_lora_yarn", "float32", "30KB"),
                                              ("v3_q_lora_yarn", "bfloat16", "5GB"),
                                              ("v2_lite", "float32", "5GB"), ("llama_gqa", "bfloat16", "5GB")])
def test_round_trip_is_bitwise_and_loads_in_transformers(name, dtype, shard, tmp_path):
  model = hf_model(name)
  source = save(model, tmp_path / "hf")
  if dtype == "bfloat16":  # as transformers keeps a bfloat16 model: the router (gate, correction bias) in float32
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16, **EAGER).eval()
    source = save(model, tmp_path / "hf_bf16")
  cli_ok("to-jaxseek", "--hf", source, "--out", tmp_path / "jax")
  assert (tmp_path / "jax" / "config.yaml").is_file() and (tmp_path / "jax" / "checkpoints" / "0").is_dir()
  cli_ok("to-hf", "--checkpoint", tmp_path / "jax", "--out", tmp_path / "back", "--dtype", dtype,
         "--max-shard-size", shard)
  assert_bitwise_equal(tensors_of(source), tensors_of(tmp_path / "back"))
  assert (tmp_path / "back" / hf.INDEX).is_file() == (shard == "30KB")
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=getattr(torch, dtype),
                                                               **EAGER).eval()
  tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 97, (2, 23)))
  with torch.no_grad():
    torch.testing.assert_close(exported(tokens).logits, model(tokens).logits, rtol=0, atol=0)


def test_jaxseek_checkpoint_layout_and_load_pretrained(tmp_path):
  source = save(hf_model("v3_q_lora_yarn"), tmp_path / "hf")
  cli_ok("to-jaxseek", "--hf", source, "--out", tmp_path / "jax")
  cfg = config_lib.load(tmp_path / "jax" / "config.yaml")
  assert cfg.model == pretrained.hf_model_config(hf.Folder(source))
  import orbax.checkpoint as ocp
  with ocp.CheckpointManager(tmp_path / "jax" / "checkpoints") as manager:
    assert manager.latest_step() == 0
  assert sorted(p.name for p in (tmp_path / "jax" / "checkpoints" / "0").iterdir() if p.is_dir()) == \
      ["config", "state"]
  from_hf, from_ckpt = variables(pretrained.load_pretrained(source)), variables(
      pretrained.load_pretrained(tmp_path / "jax"))
  assert from_hf.keys() == from_ckpt.keys()
  for path in from_hf:
    np.testing.assert_array_equal(from_hf[path], from_ckpt[path], err_msg=str(path))


def test_sharded_load_places_each_weight_on_its_shards(tmp_path):
  """Under a mesh (fsdp=2, expert=2, tensor=2) weights arrive with the rules' shardings and the same values,
  from an HF folder and from a jaxseek checkpoint."""
  m = load_config("tiny-v3").model
  kwargs = dict(VARIANTS["v3_q_lora_yarn"][2], vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                intermediate_size=m.intermediate_size, moe_intermediate_size=m.moe_intermediate_size)
  torch.manual_seed(0)
  source = save(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kwargs)), tmp_path / "hf")
  cli_ok("to-jaxseek", "--hf", source, "--out", tmp_path / "jax")
  reference = variables(pretrained.load_pretrained(source))
  sizes = {"pipeline": 1, "data": 1, "fsdp": 2, "expert": 2, "context": 1, "tensor": 2}
  mesh = jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * 6)
  for folder in (source, tmp_path / "jax"):
    with jax.set_mesh(mesh):
      model = pretrained.load_pretrained(folder)
    for path, var in nnx.to_flat_state(nnx.state(model)):
      value = var.get_value()
      assert value.sharding.spec == rules.param_spec(var.get_metadata()["logical_axes"]), path
      assert value.sharding.mesh == mesh
      np.testing.assert_array_equal(np.asarray(value), reference[path], err_msg=str(path))
  assert nnx.state(model)["moe_layers"]["blocks"]["mlp"]["w_gate_EDM"].get_value().sharding.spec[1] == "expert"


# ---------------------------------------------------------------------------------------------- MTP


def test_mtp_layers_round_trip(tmp_path):
  """DeepSeek-V3 keeps MTP depth k at model.layers.{L+k}: enorm, hnorm, eh_proj [D, 2D] (input columns [0, D)
  take enorm(embedding), [D, 2D) hnorm(hidden)), a full MoE decoder layer, shared_head.norm and copies of the
  head and embedding. transformers does not write them; test_parity.with_mtp_layer adds them."""
  model = hf_model("v3_q_lora_yarn")
  folder = with_mtp_layer(model, tmp_path)
  tensors = load_file(folder / "model.safetensors")
  L, D = model.config.num_hidden_layers, model.config.hidden_size
  assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1

  ours = pretrained.load_pretrained(folder)
  layer, eh = ours.mtp_layers[0], tensors[f"model.layers.{L}.eh_proj.weight"].numpy()
  np.testing.assert_array_equal(layer.w_e_DD[...], eh[:, :D].T)
  np.testing.assert_array_equal(layer.w_h_DD[...], eh[:, D:].T)
  np.testing.assert_array_equal(layer.hnorm.scale_D[...], tensors[f"model.layers.{L}.hnorm.weight"].numpy())
  np.testing.assert_array_equal(layer.block.mlp.bias_E[...],
                                tensors[f"model.layers.{L}.mlp.gate.e_score_correction_bias"].numpy())
  cli_ok("to-jaxseek", "--hf", folder, "--out", tmp_path / "jax")
  cli_ok("to-hf", "--checkpoint", tmp_path / "jax", "--out", tmp_path / "back")
  assert_bitwise_equal(tensors, tensors_of(tmp_path / "back"))


# ---------------------------------------------------------------------------------------------- FP8

FP8_BLOCK = 128


def quantize(w):
  """e4m3 weights and float32 scale_inv per 128×128 block (the grid rounds up; edge blocks are partial)."""
  rows, cols = w.shape
  grid = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
  scale = torch.empty(grid)
  for i in range(grid[0]):
    for j in range(grid[1]):
      block = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK]
      scale[i, j] = block.abs().max().clamp(min=1e-12) / 448.0
  full = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:rows, :cols]
  return (w / full).to(torch.float8_e4m3fn), scale


def reference_dequantize(w8, scale_inv):
  rows, cols = w8.shape
  return w8.float() * scale_inv.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:rows, :cols]


def test_fp8_block_scales_dequantise_exactly(tmp_path):
  kwargs = dict(VARIANTS["v3_q_lora_yarn"][2], hidden_size=200, intermediate_size=300, moe_intermediate_size=136,
                q_lora_rank=130, kv_lora_rank=132, num_hidden_layers=2, n_routed_experts=4, n_group=2, topk_group=1,
                num_experts_per_tok=2)
  torch.manual_seed(0)
  model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kwargs))
  plain = load_file(save(model, tmp_path / "plain") / "model.safetensors")
  quantized, dequantized = {}, {}
  for name, w in plain.items():
    if name.endswith("_proj.weight"):
      w8, scale_inv = quantize(w)
      quantized[name], quantized[name + "_scale_inv"] = w8, scale_inv
      dequantized[name] = reference_dequantize(w8, scale_inv)
    else:
      quantized[name] = dequantized[name] = w
  assert quantized["model.layers.0.mlp.gate_proj.weight"].shape == (300, 200)
  assert quantized["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (3, 2)
  config = json.loads((tmp_path / "plain" / "config.json").read_text())
  for kind, data, extra in (("fp8", quantized, {"quantization_config": {
      "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}),
                            ("ref", dequantized, {})):
    (tmp_path / kind).mkdir()
    save_file(data, tmp_path / kind / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / kind / "config.json").write_text(json.dumps({**config, **extra}))
  name = "model.layers.0.mlp.down_proj.weight"
  np.testing.assert_array_equal(hf.Folder(tmp_path / "fp8").read(name), dequantized[name].numpy())
  ours, ref = variables(pretrained.load_pretrained(tmp_path / "fp8")), variables(
      pretrained.load_pretrained(tmp_path / "ref"))
  for path in ref:
    np.testing.assert_array_equal(ours[path], ref[path], err_msg=str(path))


# ----------------------------------------------------------------------------------- config and layout


def test_rotate_half_and_interleaved_checkpoints_load_alike(tmp_path):
  """V3 with rope_interleave=false stores the RoPE rows in rotate-half order: rows (0, 2, 4, 6, 1, 3, 5, 7) of
  each interleaved RoPE block. Both layouts give the same jaxseek weights."""
  model = hf_model("v3_q_lora_yarn")
  c = model.config
  tensors = load_file(save(model, tmp_path / "interleaved") / "model.safetensors")
  order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
  head = c.qk_nope_head_dim + c.qk_rope_head_dim
  for name, w in list(tensors.items()):
    if name.endswith("q_b_proj.weight"):
      w = w.view(c.num_attention_heads, head, -1).clone()
      w[:, c.qk_nope_head_dim:] = w[:, c.qk_nope_head_dim + order]
      tensors[name] = w.reshape(-1, w.shape[-1])
    elif name.endswith("kv_a_proj_with_mqa.weight"):
      w = w.clone()
      w[c.kv_lora_rank:] = w[c.kv_lora_rank + order]
      tensors[name] = w
  (tmp_path / "half").mkdir()
  save_file(tensors, tmp_path / "half" / "model.safetensors", metadata={"format": "pt"})
  config = json.loads((tmp_path / "interleaved" / "config.json").read_text())
  (tmp_path / "half" / "config.json").write_text(json.dumps({**config, "rope_interleave": False}))
  a, b = variables(pretrained.load_pretrained(tmp_path / "interleaved")), variables(
      pretrained.load_pretrained(tmp_path / "half"))
  for path in a:
    np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))


@pytest.mark.parametrize("name", ["tiny-v3", "tiny-v2", "tiny-dense"])
def test_config_json_round_trip(name):
  cfg = load_config(name).model
  assert hf.model_config(hf.hf_config(cfg, "float32"), cfg.num_nextn_predict_layers) == cfg


def test_config_json_rope_parameters_and_ignored_keys():
  legacy = {"model_type": "deepseek_v2", "hidden_size": 40, "num_attention_heads": 4, "kv_lora_rank": 20,
            "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "q_lora_rank": None,
            "max_position_embeddings": 64, "n_group": None, "topk_group": None, "rope_theta": 5000.0,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                             "mscale": 0.707, "mscale_all_dim": 0.707}}
  v5 = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling")}
  v5["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                           "original_max_position_embeddings": 16, "mscale": 0.707, "mscale_all_dim": 0.707}
  hf_only = {"architectures": ["DeepseekV2ForCausalLM"], "dtype": "bfloat16", "bos_token_id": 100000,
             "eos_token_id": 100001, "use_cache": True, "attention_dropout": 0.0, "head_dim": 8,
             "num_key_value_heads": 128, "transformers_version": "5.24.0", "hidden_act": "silu"}
  a, b = hf.model_config(legacy, 0), hf.model_config({**v5, **hf_only}, 0)
  assert a == b
  assert a.rope_theta == 5000.0 and a.rope_scaling["factor"] == 4.0 and a.rope_scaling["type"] == "yarn"
  assert a.n_group == 1 and a.q_lora_rank is None and a.head_dim is None
  v3 = hf.model_config({"model_type": "deepseek_v3", "n_routed_experts": 8, "moe_intermediate_size": 4}, 0)
  assert (v3.scoring_func, v3.topk_method) == ("sigmoid", "noaux_tc")


def test_v2_norm_topk_prob_says_in_one_line_that_transformers_differs(capsys):
  """transformers' DeepseekV2 never renormalises the top-k weights; jaxseek does, as DeepSeek's reference."""
  raw = {"model_type": "deepseek_v2", "n_routed_experts": 8, "moe_intermediate_size": 4, "num_experts_per_tok": 2,
         "hidden_size": 40, "num_attention_heads": 4, "kv_lora_rank": 20, "qk_nope_head_dim": 12,
         "qk_rope_head_dim": 8, "v_head_dim": 10, "q_lora_rank": None}
  hf.model_config({**raw, "norm_topk_prob": False}, 0)
  assert capsys.readouterr().err == ""
  cfg = hf.model_config({**raw, "norm_topk_prob": True}, 0)
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("warning: deepseek_v2 norm_topk_prob=true")
  assert "transformers" in err and "renormalises" in err
  hf.hf_config(cfg, "float32")  # exporting it for transformers says so too
  assert capsys.readouterr().err == err
  hf.model_config({**raw, "model_type": "deepseek_v3", "norm_topk_prob": True}, 0)  # V3: both renormalise
  assert capsys.readouterr().err == ""


@pytest.mark.parametrize("key,value", [("hidden_act", "gelu"), ("mlp_bias", True), ("attention_bias", True),
                                       ("moe_layer_freq", 2), ("sliding_window", 4096),
                                       ("rope_parameters", {"rope_type": "llama3", "factor": 8.0})])
def test_config_json_rejects_what_jaxseek_cannot_represent(key, value):
  with pytest.raises(UserError) as e:
    hf.model_config({"model_type": "llama", key: value}, 0)
  assert "\n" not in str(e.value) and ("llama3" in str(e.value) if key == "rope_parameters" else key in str(e.value))


# ------------------------------------------------------------------------------------------------ errors


def broken_folders(tmp_path):
  """(folder, text the one-line error must contain) for each user error of item 5."""
  model = hf_model("llama_gqa")
  sharded = save(model, tmp_path / "sharded", max_shard_size="40KB")
  shards = sorted(sharded.glob("*.safetensors"))
  assert len(shards) > 2
  shards[1].unlink()
  wrong_type = save(model, tmp_path / "type")
  (wrong_type / "config.json").write_text(json.dumps({**json.loads((wrong_type / "config.json").read_text()),
                                                      "model_type": "mistral"}))
  wrong_shape = save(model, tmp_path / "shape")
  (wrong_shape / "config.json").write_text(json.dumps({**json.loads((wrong_shape / "config.json").read_text()),
                                                       "intermediate_size": 90}))
  missing = save(model, tmp_path / "missing")
  tensors = load_file(missing / "model.safetensors")
  del tensors["model.layers.1.self_attn.k_proj.weight"]
  save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
  no_config = save(model, tmp_path / "noconfig")
  (no_config / "config.json").unlink()
  return [(sharded, shards[1].name), (wrong_type, "'mistral'"), (wrong_shape, "model.layers.0.mlp.gate_proj.weight"),
          (missing, "model.layers.1.self_attn.k_proj.weight"), (no_config, "config.json")]


def test_user_errors_name_the_tensor_or_file(tmp_path, capsys):
  for k, (folder, needle) in enumerate(broken_folders(tmp_path)):
    with pytest.raises(UserError) as e:
      pretrained.load_pretrained(folder)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    capsys.readouterr()
    assert convert_cli.main(["to-jaxseek", "--hf", str(folder), "--out", str(tmp_path / f"out{k}")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
  assert convert_cli.main(["to-hf", "--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2


def test_cli_exits_2_without_traceback(tmp_path, run_env):
  out = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_checkpoint.py"), "inspect", str(tmp_path)],
                       capture_output=True, text=True, env=run_env, timeout=120)
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert out.stderr.strip().count("\n") == 0 and "config.json" in out.stderr


def test_inspect_lists_variant_and_tensors(tmp_path, capsys):
  source = save(hf_model("v2_lite"), tmp_path / "hf")
  cli_ok("to-jaxseek", "--hf", source, "--out", tmp_path / "jax")
  capsys.readouterr()
  cli_ok("inspect", source)
  text = capsys.readouterr().out
  assert "deepseek_v2 · MLA (4 heads, no q compression, kv_lora 22)" in text
  assert "model.layers.1.mlp.experts.7.down_proj.weight  [48, 26]  float32" in text
  cli_ok("inspect", tmp_path / "jax")
  text = capsys.readouterr().out
  assert "jaxseek checkpoint" in text and "(step 0)" in text
  assert "params/moe_layers.blocks.mlp.w_down_EMD  [3, 8, 26, 48]  float32" in text


def test_import_jaxseek_stays_cheap(run_env):
  code = "import sys, jaxseek; assert 'jax' not in sys.modules and 'jaxseek.convert' not in sys.modules"
  subprocess.run([sys.executable, "-c", code], check=True, env=run_env, timeout=60)
