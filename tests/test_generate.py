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



@pytest.mark.parametrize("name", ["tiny-v3", "tiny-dense"])
def test_cached_decode_equals_full_forward(name):
  """Prefill 5 tokens (row 1 left-padded by 2), then decode 6 one at a time: each step's logits equal the full
  forward pass's at that position."""
  model, cfg = tiny(name)
  rng = np.random.default_rng(0)
  T0, steps = 5, 6
  seqs = [rng.integers(1, cfg.vocab_size, T0 + steps), rng.integers(1, cfg.vocab_size, T0 - 2 + steps)]
  tokens, mask, positions = gen.left_pad([s[:T0].tolist() if i == 0 else s[:T0 - 2].tolist()
                                          for i, s in enumerate(seqs)])
  full = [np.asarray(model(jnp.asarray(s[None], jnp.int32)))[0] for s in seqs]
  cache = decode.init_cache(model, 2, T0 + steps)
  step = nnx.jit(decode.step)
  logits, cache = step(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask), cache, 0)
  np.testing.assert_allclose(logits[0, -1], full[0][T0 - 1], rtol=TOL, atol=TOL)
  np.testing.assert_allclose(logits[1, -1], full[1][T0 - 3], rtol=TOL, atol=TOL)
  np.testing.assert_allclose(logits[0], full[0][:T0], rtol=TOL, atol=TOL)  # every prompt position
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


def test_stops_at_eos():
  model, _ = tiny("tiny-dense")
  greedy = gen.generate(model, [[5, 6, 7]], 8)[0]
  eos = greedy[3]
  assert gen.generate(model, [[5, 6, 7]], 8, eos_id=eos)[0] == greedy[:greedy.index(eos)]
