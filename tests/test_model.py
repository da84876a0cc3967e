"""Model math on one device: routing and dispatch against NumPy references, masking, GQA, parameter counts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import CONFIGS, load_config
from jaxseek import config as config_lib
from jaxseek import model as model_lib
from jaxseek.kernels.grouped import experts_local
from jaxseek.model.moe import Routing, route


def numpy_route(logits, bias, r: Routing):
  """The papers' routing, written plainly per token."""
  scores = 1 / (1 + np.exp(-logits)) if r.scoring_func == "sigmoid" else np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  X, E = scores.shape
  ids, weights = [], []
  for x in range(X):
    choice = scores[x] + (bias if bias is not None else 0)
    allowed = np.ones(E, bool)
    if r.topk_method != "greedy" and r.n_group > 1:
      groups = choice.reshape(r.n_group, -1)
      group_score = np.sort(groups, -1)[:, -2:].sum(-1) if r.topk_method == "noaux_tc" else groups.max(-1)
      keep = np.argsort(-group_score, kind="stable")[:r.topk_group]
      allowed = np.isin(np.arange(E) // (E // r.n_group), keep)
    masked = np.where(allowed, choice, -np.inf)
    top = np.argsort(-masked, kind="stable")[:r.num_experts_per_tok]
    w = scores[x, top]
    if r.scale_after_norm:
      w = (w / w.sum() if r.norm_topk_prob else w) * r.routed_scaling_factor
    else:
      w = w / w.sum() if (r.norm_topk_prob and len(top) > 1) else w * r.routed_scaling_factor
    ids.append(top)
    weights.append(w)
  return np.array(ids), np.array(weights)


ROUTINGS = {
    "v3_noaux_tc": (Routing("sigmoid", "noaux_tc", 4, 2, 3, True, 2.5, True), True),
    "v2_group_limited": (Routing("softmax", "group_limited_greedy", 4, 2, 3, False, 16.0, False), False),
    "moe_greedy": (Routing("softmax", "greedy", 1, 1, 6, False, 1.0, False), False),
    "v2_lite_norm": (Routing("softmax", "greedy", 1, 1, 2, True, 1.0, False), False),
}


@pytest.mark.parametrize("name", ROUTINGS)
def test_routing_matches_reference(name):
  routing, with_bias = ROUTINGS[name]
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(37, 16)).astype(np.float32)
  bias = rng.normal(scale=0.3, size=16).astype(np.float32) if with_bias else None
  idx, w, _ = route(jnp.asarray(logits), None if bias is None else jnp.asarray(bias), routing)
  ref_idx, ref_w = numpy_route(logits.astype(np.float64), bias, routing)
  order, ref_order = np.argsort(np.asarray(idx), -1), np.argsort(ref_idx, -1)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, -1), np.take_along_axis(ref_idx, ref_order, -1))
  np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1), np.take_along_axis(ref_w, ref_order, -1),
                             rtol=1e-5)


def test_bias_changes_choice_but_not_gate_weights():
  routing = ROUTINGS["v3_noaux_tc"][0]
  logits = jnp.asarray(np.random.default_rng(1).normal(size=(5, 16)), jnp.float32)
  bias = jnp.zeros(16).at[3].set(10.0)  # expert 3 is chosen by every token
  idx, w, scores = route(logits, bias, routing)
  assert (np.asarray(idx) == 3).any(-1).all()
  chosen = np.take_along_axis(np.asarray(scores), np.asarray(idx), -1)
  np.testing.assert_allclose(np.asarray(w), chosen / chosen.sum(-1, keepdims=True) * 2.5, rtol=1e-6)


def test_dropless_dispatch_matches_per_expert_loop():
  rng = np.random.default_rng(2)
  X, D, M, E, K = 29, 12, 7, 5, 2
  x = rng.normal(size=(X, D)).astype(np.float32)
  idx = np.stack([rng.permutation(E)[:K] for _ in range(X)])
  idx[:10] = [0, 1]  # unbalanced: many tokens on experts 0 and 1, expert 4 may get few
  w = rng.uniform(size=(X, K)).astype(np.float32)
  wg, wu, wd = (rng.normal(size=s).astype(np.float32) for s in [(E, D, M), (E, D, M), (E, M, D)])
  y = experts_local(*map(jnp.asarray, (x, idx, w, wg, wu, wd)))
  silu = lambda a: a / (1 + np.exp(-a))
  ref = np.zeros_like(x)
  for t in range(X):
    for k in range(K):
      e = idx[t, k]
      ref[t] += w[t, k] * ((silu(x[t] @ wg[e]) * (x[t] @ wu[e])) @ wd[e])
  np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["tiny-v3", "tiny-v2", "tiny-dense"])
def test_causal_and_segment_masks(name):
  model = model_lib.build(load_config(name).model)
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 200, (1, 12)), jnp.int32)
  logits = model(tokens)
  changed = tokens.at[0, 7:].set(5)
  np.testing.assert_allclose(model(changed)[0, :7], logits[0, :7], rtol=1e-5, atol=1e-6)
  assert not np.allclose(model(changed)[0, 7:], logits[0, 7:])
  # Two packed documents: the second sees only itself, as if run alone from position 0.
  segments = jnp.asarray([[1] * 5 + [2] * 7])
  positions = jnp.asarray([list(range(5)) + list(range(7))])
  packed = model(tokens, positions, segments)
  alone = model(tokens[:, 5:])
  np.testing.assert_allclose(packed[0, 5:], alone[0], rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_equals_multi_head_with_repeated_kv():
  gqa_cfg = load_config("tiny-dense").model
  assert gqa_cfg.kv_heads < gqa_cfg.num_attention_heads
  mha_cfg = dataclasses.replace(gqa_cfg, num_key_value_heads=gqa_cfg.num_attention_heads)
  gqa, mha = model_lib.build(gqa_cfg), model_lib.build(mha_cfg, seed=1)
  group = gqa_cfg.num_attention_heads // gqa_cfg.kv_heads
  state = nnx.state(gqa)
  mha_state = nnx.state(mha)
  flat, mha_flat = dict(nnx.to_flat_state(state)), dict(nnx.to_flat_state(mha_state))
  for path, var in flat.items():
    value = var[...]
    if path[-1] in ("w_k_DGH", "w_v_DGH"):
      value = jnp.repeat(value, group, axis=-2)  # [L, D, G, H] → [L, D, N, H]; head h uses kv head h // group
    mha_flat[path][...] = value
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 200, (2, 9)), jnp.int32)
  np.testing.assert_allclose(mha(tokens), gqa(tokens), rtol=1e-5, atol=1e-6)


PUBLISHED = {  # total parameters (billions), ../MODELS.md; V3 without its 14B MTP module
    "deepseek-v3-671b": 671.0, "deepseek-v2": 236.0, "deepseek-v2-lite": 15.7, "deepseek-moe-16b": 16.4,
    "deepseek-llm-7b": 6.9, "deepseek-llm-67b": 67.4,
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_count_of_real_configs(name):
  cfg = config_lib.load(CONFIGS / f"{name}.yaml")
  count = model_lib.count_params(dataclasses.replace(cfg.model, num_nextn_predict_layers=0)) / 1e9
  assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.005, count


def test_v3_multi_token_prediction_module_size():
  """The released V3 checkpoint holds 685B: 671B main model + the MTP module, which stores its own copies of the
  0.93B embedding and head (jaxseek shares the main model's)."""
  m = config_lib.load(CONFIGS / "deepseek-v3-671b.yaml").model
  assert m.num_nextn_predict_layers == 1
  mtp = model_lib.count_params(m) - model_lib.count_params(dataclasses.replace(m, num_nextn_predict_layers=0))
  released = model_lib.count_params(m) + 2 * m.vocab_size * m.hidden_size
  assert abs(released / 1e9 - 685.0) < 1.0 and 11 < mtp / 1e9 < 12.5, (released / 1e9, mtp / 1e9)


def test_active_parameters_of_v3():
  """37B active per token: everything but the routed experts, plus 8 of 256 of them."""
  m = dataclasses.replace(config_lib.load(CONFIGS / "deepseek-v3-671b.yaml").model, num_nextn_predict_layers=0)
  total = model_lib.count_params(m)
  routed = m.num_moe_layers * m.n_routed_experts * 3 * m.hidden_size * m.moe_intermediate_size
  active = total - routed * (1 - m.num_experts_per_tok / m.n_routed_experts) - m.vocab_size * m.hidden_size
  assert abs(active / 1e9 - 37.0) < 0.8, active / 1e9
