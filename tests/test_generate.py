"""Generation: cached decoding equals the full forward pass, greedy tokens equal transformers' generate, sampling
filters, the cache size formula, and the command line."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, load_config
from jaxseek import generate as gen
from jaxseek import model as model_lib
from jaxseek.model import decode

TOL = 1e-5


def tiny(name: str, *overrides: str):
  cfg = load_config(name, "model.initializer_range=0.2", *overrides).model
  return model_lib.build(cfg, seed=3), cfg



@pytest.mark.parametrize("name, impl", [("tiny-v3", "auto"), ("tiny-dense", "auto"), ("tiny-v3", "blocked"),
                                        ("tiny-dense", "blocked")])
def test_cached_decode_equals_full_forward(name, impl, monkeypatch):
  """Prefill 5 tokens (row 1 left-padded by 2), then decode 6 one at a time: each step's logits equal the full
  forward pass's at that position. The prefill attends through model.attention_impl (blocked: flash.attention)."""
  from jaxseek.kernels import flash

  calls = []
  real = flash.attention
  monkeypatch.setattr(flash, "attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
  model, cfg = tiny(name, f"model.attention_impl={impl}")
  rng = np.random.default_rng(0)
  T0, steps = 5, 6
  seqs = [rng.integers(1, cfg.vocab_size, T0 + steps), rng.integers(1, cfg.vocab_size, T0 - 2 + steps)]
  tokens, mask, positions = gen.left_pad([s[:T0].tolist() if i == 0 else s[:T0 - 2].tolist()
                                          for i, s in enumerate(seqs)])
  # one jitted forward pass; row 1 padded on the right (causal: its earlier logits do not see the padding)
  both = np.stack([seqs[0], np.concatenate([seqs[1], [1, 1]])]).astype(np.int32)
  full = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(both)))
  cache = decode.init_cache(model, 2, T0 + steps)
  step = nnx.jit(decode.step)
  prefill = nnx.jit(lambda *a: decode.step(*a, 0))  # slot 0 static, as generate's prefill passes it
  logits, cache = prefill(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask), cache)
  np.testing.assert_allclose(logits[0, -1], full[0][T0 - 1], rtol=TOL, atol=TOL)
  np.testing.assert_allclose(logits[1, -1], full[1][T0 - 3], rtol=TOL, atol=TOL)
  np.testing.assert_allclose(logits[0], full[0][:T0], rtol=TOL, atol=TOL)  # every prompt position
  layers = cfg.num_dense_layers + cfg.num_moe_layers
  prompt_calls = [shape for shape in calls if shape[1] == T0]
  assert len(prompt_calls) == (0 if impl == "auto" else (cfg.num_dense_layers > 0) + (cfg.num_moe_layers > 0)) \
      and layers > 0  # traced once per stack (the layers are scanned); auto at 5 tokens is the dense reference
  for i in range(steps - 1):
    new = jnp.asarray([[seqs[0][T0 + i]], [seqs[1][T0 - 2 + i]]], jnp.int32)
    pos = jnp.asarray([[T0 + i], [T0 - 2 + i]], jnp.int32)
    logits, cache = step(model, new, pos, jnp.ones((2, 1), jnp.int32), cache, T0 + i)
    np.testing.assert_allclose(logits[0, 0], full[0][T0 + i], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(logits[1, 0], full[1][T0 - 2 + i], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("name", ["tiny-v3", "tiny-dense"])
def test_cache_size_matches_formula(name):
  model, cfg = tiny(name)
  cache = decode.init_cache(model, 3, 17, jnp.bfloat16)
  layers = cfg.num_dense_layers + cfg.num_moe_layers
  per = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 if cfg.is_mla else 2 * cfg.kv_heads * cfg.dense_head_dim * 2
  assert decode.cache_bytes_per_token(cfg, jnp.bfloat16) == per
  if cfg.is_mla:  # the latent and the rope key, never full keys and values
    assert {k: v.shape for k, v in cache["moe_layers"].items()} == {
        "ckv": (cfg.num_moe_layers, 3, 17, cfg.kv_lora_rank), "kr": (cfg.num_moe_layers, 3, 17, cfg.qk_rope_head_dim)}
  assert decode.cache_nbytes(cache) == per * layers * 3 * 17


def test_top_p_filter_keeps_smallest_set_reaching_p():
  probs = np.array([[0.5, 0.2, 0.25, 0.05]])
  logits = jnp.log(jnp.asarray(probs))
  kept = lambda p: np.isfinite(np.asarray(gen.top_p_filter(logits, p)))[0].tolist()
  assert kept(0.5) == [True, False, False, False]
  assert kept(0.6) == [True, False, True, False]
  assert kept(0.95) == [True, True, True, False]
  assert kept(0.96) == [True, True, True, True]
  assert kept(0.1) == [True, False, False, False]  # the most likely token always stays


def test_top_k_filter():
  logits = jnp.asarray([[0.1, 3.0, -1.0, 2.0]])
  assert np.isfinite(np.asarray(gen.top_k_filter(logits, 2)))[0].tolist() == [False, True, False, True]


def test_sampling_seeded_and_top_k_1_is_greedy():
  model, cfg = tiny("tiny-dense")
  prompts = [[5, 6, 7], [9, 10]]
  greedy = gen.generate(model, prompts, 8)
  a = gen.generate(model, prompts, 8, temperature=1.0, seed=1)
  assert a == gen.generate(model, prompts, 8, temperature=1.0, seed=1)
  assert a != gen.generate(model, prompts, 8, temperature=1.0, seed=2)
  assert gen.generate(model, prompts, 8, temperature=1.0, top_k=1, seed=4) == greedy
  assert gen.generate(model, prompts, 8, temperature=0.7, top_p=1e-6, seed=4) == greedy


def test_prefill_and_decode_loop_compile_once():
  """One compilation each for a new (batch, prompt length, new tokens); none for a second call of those shapes,
  whatever the number of steps the decode loop runs."""
  model, _ = tiny("tiny-dense")
  sizes = lambda: (gen._prefill._cache_size(), gen._decode._cache_size())
  before = sizes()
  first = gen.generate(model, [[1, 2, 3, 4], [5]], 7)
  assert sizes() == (before[0] + 1, before[1] + 1)
  assert gen.generate(model, [[8, 9, 10, 11], [12, 13]], 7) != first
  assert sizes() == (before[0] + 1, before[1] + 1)


def test_stops_at_eos():
  model, _ = tiny("tiny-dense")
  greedy = gen.generate(model, [[5, 6, 7]], 8)[0]
  eos = greedy[3]
  assert gen.generate(model, [[5, 6, 7]], 8, eos_id=eos)[0] == greedy[:greedy.index(eos)]


# ------------------------------------------------------------------------------ against transformers' generate

HF_VARIANTS = ["v3_q_lora_yarn", "v2_lite", "llama_gqa"]




@pytest.mark.parametrize("name", HF_VARIANTS)
def test_greedy_equals_transformers_generate(name, tmp_path):
  """32 greedy tokens for 2 prompts of lengths 7 and 3 in one batch (transformers: left padding, attention mask)."""
  torch = pytest.importorskip("torch")
  from test_parity import hf_model, save, with_mtp_layer

  from jaxseek import load_pretrained

  model = hf_model(name)
  if "v3" in name or "v2" in name:  # the same expert math as "eager", batched: 6× quicker on this CPU
    model.set_experts_implementation("batched_mm")
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  prompts = [[3, 14, 15, 92, 65, 35, 89], [27, 18, 28]]
  tokens, mask, _ = gen.left_pad(prompts)
  with torch.no_grad():
    ref = model.generate(torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(mask).long(),
                         do_sample=False, max_new_tokens=32, pad_token_id=0, eos_token_id=None)
  ref = ref[:, tokens.shape[1]:].numpy().tolist()
  folder = with_mtp_layer(model, tmp_path) if "v3" in name else save(model, tmp_path / name)
  ours = load_pretrained(folder)
  if "v3" in name:
    assert len(ours.mtp_layers) == 1  # loaded, and not run by generation
  out = gen.generate(ours, prompts, 32)
  assert [len(r) for r in ref] == [32, 32]
  assert out == ref
  assert min(len(set(row)) for row in out) > 4  # not one token repeated: the comparison can fail


@pytest.mark.parametrize("name,mesh", [("tiny-v3", ("mesh.tensor=2", "mesh.expert=2")),
                                       ("tiny-dense", ("mesh.tensor=2",))])
def test_parallel_generation_gives_single_device_tokens(name, mesh, tmp_path):
  """Weights loaded under a mesh (tensor: heads, MLP and vocab split; expert: routed experts and the batch split,
  the batch padded to a multiple of 2) generate the tokens of one device."""
  from jaxseek import load_pretrained
  from jaxseek.convert.pretrained import save_checkpoint

  model, cfg = tiny(name)
  save_checkpoint(model, cfg, tmp_path / "ckpt")
  prompts = [[5, 6, 7, 8, 9], [11, 12], [13]]  # 3 rows: padded to 4 for mesh.expert=2
  single = gen.generate(load_pretrained(tmp_path / "ckpt"), prompts, 12)
  with jax.set_mesh(gen.make_mesh(list(mesh))):
    sharded = load_pretrained(tmp_path / "ckpt")
    assert not sharded.embed.table_VD[...].sharding.is_fully_replicated  # split over tensor
    if cfg.is_moe:
      assert not sharded.moe_layers.blocks.mlp.w_gate_EDM[...].sharding.is_fully_replicated
    assert gen.generate(sharded, prompts, 12) == single


# ------------------------------------------------------------------------------------------------ command line


@pytest.fixture(scope="module")
def byte_checkpoint(tmp_path_factory):
  """A byte-level tiny V3 (vocab 256), untrained, as a jaxseek checkpoint folder."""
  from jaxseek.convert.pretrained import save_checkpoint

  model, cfg = tiny("tiny-v3", "model.vocab_size=256")
  return save_checkpoint(model, cfg, tmp_path_factory.mktemp("gen") / "ckpt")


def test_cli_generates_one_line_per_prompt(byte_checkpoint, tmp_path):
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("def main():\nimport os\n\n")
  result = subprocess.run([sys.executable, "-m", "jaxseek.generate", "--checkpoint", str(byte_checkpoint),
                           "--tokenizer", "byte", "--prompts", str(prompts), "--max-new-tokens", "10"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert result.returncode == 0, result.stderr
  assert len(result.stdout.splitlines()) == 2
  # MLA, float32: (kv_lora_rank 20 + qk_rope_head_dim 8) × 4 bytes; 11 prompt + 10 new slots
  assert f"KV cache: 112 bytes per token per layer × 3 layers × 2 rows × 21 slots = {112 * 3 * 2 * 21} bytes" \
      in result.stderr


@pytest.mark.parametrize("args,message", [
    (["--checkpoint", "/nonexistent/folder"], "--checkpoint /nonexistent/folder: no such folder"),
    (["--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
    (["--max-new-tokens", "many"], "argument --max-new-tokens: invalid int value"),
    (["--temperature", "-1"], "--temperature -1.0 must be ≥ 0"),
    (["mesh.tensor=3"], "is not divisible by mesh.tensor=3"),
    (["mesh.pipeline=2"], "generate takes mesh sizes mesh.<axis>=N for axis in data, fsdp, expert, tensor"),
    (["--prompts", "EMPTY"], "holds no prompt"),
    # sampling options at temperature 0 (greedy) would be ignored; a prompt and its new tokens past the positions
    (["--top-k", "5"], "--top-k 5 applies when sampling; pass --temperature > 0"),
    (["--top-p", "0.9"], "--top-p 0.9 applies when sampling"),
    (["--seed", "3"], "--seed 3 applies when sampling"),
    (["--max-new-tokens", "65"], "a prompt of 1 tokens + --max-new-tokens 65 needs 65 positions, more than the "
     "model's max_position_embeddings 64"),
])
def test_cli_bad_input_exits_2_with_one_line(byte_checkpoint, tmp_path, capsys, args, message):
  empty = tmp_path / "empty.txt"
  empty.write_text("\n\n")
  argv = ["--checkpoint", str(byte_checkpoint), "--tokenizer", "byte"]
  argv += ["--prompt", "x"] if "--prompts" not in args else []
  argv += [str(empty) if a == "EMPTY" else a for a in args]
  assert gen.main(argv) == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and message in err, err



def test_cli_with_tokenizer_json_and_hf_folder(tmp_path, capsys):
  """A Hugging Face folder with a word-level tokenizer.json whose EOS is </s>: output is decoded text, and
  generation stops at EOS (the model's most likely next token after the prompt is made </s>)."""
  tokenizers = pytest.importorskip("tokenizers")
  torch = pytest.importorskip("torch")
  from test_parity import hf_model, save

  from jaxseek import load_pretrained

  words = ["</s>", "[UNK]"] + [f"w{i}" for i in range(40)]
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
  tok.save(str(tmp_path / "tokenizer.json"))
  model = hf_model("llama_gqa")
  folder = save(model, tmp_path / "hf")
  argv = ["--checkpoint", str(folder), "--tokenizer", str(tmp_path / "tokenizer.json"), "--max-new-tokens", "6"]
  assert gen.main(argv + ["--prompt", "w3 w4 w5"]) == 0
  out = capsys.readouterr()
  assert len(out.out.splitlines()) == 1
  assert "KV cache: 224 bytes per token per layer" in out.err  # 2 × (2 kv heads × 14) × 4 bytes
  # with EOS forced as the first new token, nothing is generated
  first = gen.generate(load_pretrained(folder), [[5, 6, 7]], 1)[0][0]
  with torch.no_grad():
    model.lm_head.weight[[0, first]] = model.lm_head.weight[[first, 0]].clone()
  save(model, tmp_path / "hf2")
  assert gen.main(["--checkpoint", str(tmp_path / "hf2")] + argv[2:] + ["--prompt", "w3 w4 w5"]) == 0
  assert capsys.readouterr().out == "\n"
