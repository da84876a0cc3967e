"""load_pretrained against the Hugging Face transformers models: float32 logits of tiny random models agree to
max|Δ| / max|ref| ≤ 1e-5, including length 1 and lengths beyond YaRN's original context."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from jaxseek import load_pretrained  # noqa: E402

TOL = 1e-5
EAGER = dict(attn_implementation="eager", experts_implementation="eager")  # the plain reference code paths
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32,
            beta_slow=1)
COMMON = dict(vocab_size=97, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64,
              initializer_range=0.2, rms_norm_eps=1e-6)
MLA = dict(kv_lora_rank=22, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, num_key_value_heads=4)
MOE = dict(intermediate_size=92, moe_intermediate_size=26, first_k_dense_replace=1, n_routed_experts=8,
           n_group=4, topk_group=2)

VARIANTS = {
    "v3_q_lora_yarn": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        **COMMON, **MLA, **MOE, q_lora_rank=18, n_shared_experts=1, num_experts_per_tok=3, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_parameters=dict(**YARN, mscale=1.0, mscale_all_dim=1.0))),
    "v3_eps_1e-5": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(  # MLA latents: 1e-6
        **dict(COMMON, rms_norm_eps=1e-5), **MLA, **MOE, q_lora_rank=18, n_shared_experts=1, num_experts_per_tok=3,
        norm_topk_prob=True, routed_scaling_factor=2.5)),
    "v2_q_lora_group_limited": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM, dict(
        **COMMON, **MLA, **MOE, q_lora_rank=18, n_shared_experts=2, num_experts_per_tok=3,
        topk_method="group_limited_greedy", routed_scaling_factor=16.0,
        rope_parameters=dict(**YARN, mscale=0.707, mscale_all_dim=0.707))),
    "v2_lite": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM, dict(
        **COMMON, **MLA, **dict(MOE, n_group=1, topk_group=1), q_lora_rank=None, n_shared_experts=2,
        num_experts_per_tok=2, topk_method="greedy", rope_parameters=dict(**YARN, mscale=0.707, mscale_all_dim=0.707))),
    "llama_mha": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        **COMMON, intermediate_size=92, num_key_value_heads=4)),
    "llama_gqa": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        **COMMON, intermediate_size=92, num_key_value_heads=2, head_dim=14,
        rope_parameters=dict(rope_type="default", rope_theta=50000.0))),
}


def hf_model(name: str, seed: int = 0):
  """A tiny random transformers model (eval, float32): norm scales perturbed so that each one matters, and a
  non-zero correction bias where the router has one."""
  config_cls, model_cls, kwargs = VARIANTS[name]
  torch.manual_seed(seed)
  model = model_cls(config_cls(**kwargs, **EAGER)).eval()
  with torch.no_grad():
    for param_name, p in model.named_parameters():
      if param_name.endswith("norm.weight"):
        p.add_(0.2 * torch.randn_like(p))
    for buffer_name, b in model.named_buffers():
      if buffer_name.endswith("e_score_correction_bias"):
        b.copy_(0.3 * torch.rand_like(b))
  return model


def save(model, folder, **kwargs):
  model.save_pretrained(folder, safe_serialization=True, **kwargs)
  return folder


def with_mtp_layer(model, tmp_path):
  """The saved folder plus one multi-token-prediction layer's tensors (model.layers.{L}.*), as DeepSeek-V3
  checkpoints hold them and transformers does not write them."""
  tensors = load_file(save(model, tmp_path / "plain") / "model.safetensors")
  L, D = model.config.num_hidden_layers, model.config.hidden_size
  g = torch.Generator().manual_seed(5)
  for name in [n for n in list(tensors) if n.startswith(f"model.layers.{L - 1}.")]:
    tensors[name.replace(f"layers.{L - 1}.", f"layers.{L}.")] = torch.randn(tensors[name].shape, generator=g)
  mtp = {"enorm.weight": (D,), "hnorm.weight": (D,), "eh_proj.weight": (D, 2 * D), "shared_head.norm.weight": (D,)}
  tensors.update({f"model.layers.{L}.{n}": torch.randn(s, generator=g) for n, s in mtp.items()})
  tensors[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
  tensors[f"model.layers.{L}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
  folder = tmp_path / "mtp"
  folder.mkdir()
  save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
  (folder / "config.json").write_text((tmp_path / "plain" / "config.json").read_text())
  return folder


def sequences(vocab: int):
  """Lengths 1, 9 and 40 (beyond original_max_position_embeddings=16), batches of 1-2."""
  rng = np.random.default_rng(7)
  return [rng.integers(0, vocab, (1, 1)), rng.integers(0, vocab, (2, 9)), rng.integers(0, vocab, (2, 40))]


def relative_error(ours, ref) -> float:
  return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


def run_all(model, token_arrays):
  """The model's logits for each token array, from one compilation."""
  return nnx.jit(lambda m, arrays: [m(tokens) for tokens in arrays])(model, [jnp.asarray(t, jnp.int32)
                                                                             for t in token_arrays])


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_match_transformers(name, tmp_path):
  model = hf_model(name)
  token_arrays = sequences(model.config.vocab_size)
  with torch.no_grad():
    refs = [model(torch.from_numpy(tokens)).logits.numpy() for tokens in token_arrays]
  outs = run_all(load_pretrained(save(model, tmp_path / name)), token_arrays)
  for tokens, out, ref in zip(token_arrays, outs, refs):
    assert out.dtype == jnp.float32 and out.shape == ref.shape
    assert relative_error(out, ref) <= TOL, (name, tokens.shape, relative_error(out, ref))
  if "v3" in name:  # the check can fail: without the correction bias the logits move far beyond TOL
    with torch.no_grad():
      for layer in model.model.layers[model.config.first_k_dense_replace:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
      assert relative_error(model(torch.from_numpy(token_arrays[2])).logits.numpy(), refs[2]) > 100 * TOL


def deepseek_reference(llama, v2, tokens):
  """DeepSeek-MoE 16B's forward pass from transformers parts: Llama's embedding, norms, attention and head,
  V2's MLP / MoE blocks (softmax gate, greedy top-k, weights not renormalised, shared experts)."""
  hidden = llama.model.embed_tokens(tokens)
  positions = torch.arange(tokens.shape[1])[None]
  rope = llama.model.rotary_emb(hidden, positions)
  T = tokens.shape[1]
  mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
  for attn_layer, mlp_layer in zip(llama.model.layers, v2.model.layers):
    hidden = hidden + attn_layer.self_attn(attn_layer.input_layernorm(hidden), position_embeddings=rope,
                                           attention_mask=mask)[0]
    hidden = hidden + mlp_layer.mlp(attn_layer.post_attention_layernorm(hidden))
  return llama.lm_head(llama.model.norm(hidden))


def test_deepseek_moe_matches_llama_attention_and_v2_moe(tmp_path):
  """model_type "deepseek" (DeepSeek-MoE 16B) has no transformers class. Its decoder layer is Llama's (RMSNorm,
  multi-head attention with rotate-half RoPE on the whole head, SwiGLU) with DeepSeek's MoE in the MLP slot, and
  its MoE is V2's block configured as DeepSeek-MoE routes: softmax scores, greedy top-k, weights used as they
  are (norm_topk_prob false, scaling 1), shared experts added. So the reference is a forward pass built from a
  LlamaForCausalLM's attention and a DeepseekV2ForCausalLM's MLP blocks, and the checkpoint holds their
  tensors under the names DeepSeek-MoE uses (the same names)."""
  llama = hf_model("llama_mha", seed=1)
  v2_kwargs = dict(VARIANTS["v2_lite"][2], n_routed_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                   routed_scaling_factor=1.0)
  torch.manual_seed(2)
  v2 = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**v2_kwargs, **EAGER)).eval()
  llama_tensors = load_file(save(llama, tmp_path / "llama") / "model.safetensors")
  v2_tensors = load_file(save(v2, tmp_path / "v2") / "model.safetensors")
  tensors = {k: v for k, v in llama_tensors.items() if ".mlp." not in k}
  tensors.update({k: v for k, v in v2_tensors.items() if ".mlp." in k})
  folder = tmp_path / "deepseek"
  folder.mkdir()
  save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
  config = {k: VARIANTS["llama_mha"][2][k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                     "num_attention_heads", "num_key_value_heads",
                                                     "max_position_embeddings", "rms_norm_eps")}
  config.update(model_type="deepseek", architectures=["DeepseekForCausalLM"], intermediate_size=92,
                moe_intermediate_size=26, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3,
                first_k_dense_replace=1, moe_layer_freq=1, scoring_func="softmax", norm_topk_prob=False,
                aux_loss_alpha=0.001, seq_aux=True, rope_theta=10000.0, rope_scaling=None, hidden_act="silu",
                torch_dtype="float32")
  (folder / "config.json").write_text(json.dumps(config))
  token_arrays = sequences(97)
  outs = run_all(load_pretrained(folder), token_arrays)
  for tokens, out in zip(token_arrays, outs):
    with torch.no_grad():
      ref = deepseek_reference(llama, v2, torch.from_numpy(tokens)).numpy()
    assert relative_error(out, ref) <= TOL, (tokens.shape, relative_error(out, ref))
