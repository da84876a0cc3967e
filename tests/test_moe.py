"""Expert parallelism: exactness on every expert mesh, capacity dropping, device-limited routing, bias update."""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from conftest import load_config
from jaxseek import step as step_lib
from jaxseek.input import global_batches
from jaxseek.model.moe import MoE, Routing, route
from jaxseek.sharding.mesh import make_mesh
from jaxseek.sharding.rules import activation_spec

ALL_TO_ALL = re.compile(r"\b(all-to-all)(-start)?\(")
MESHES = {"expert1": ("mesh.expert=1",), "expert2": ("mesh.expert=2",), "expert4": ("mesh.expert=4",),
          "expert8": ("mesh.expert=8",), "e2f2t2": ("mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2")}
STEPS = 5
MOE_ONLY = "model.first_k_dense_replace=0"  # every layer MoE: the dense stack would add compile time, not coverage


@functools.cache
def train_run(name: str) -> dict:
  """Losses, gradient norms and biases after every step of tiny-v3 on a mesh; `single` is one device."""
  mesh_overrides = ("mesh.data=1",) if name == "single" else ("mesh.data=-1", *MESHES[name])
  cfg = load_config("tiny-v3", MOE_ONLY, *mesh_overrides)
  mesh = make_mesh(cfg, jax.devices()[:1] if name == "single" else jax.devices())
  trainer, state = step_lib.init_state(cfg, mesh)
  batches = global_batches(cfg, mesh)
  first = next(batches)
  out = {"cfg": cfg, "trainer": trainer, "losses": [], "norms": [], "biases": [],
         "initial": jax.device_get((state.params, state.biases)), "batch": jax.device_get(first)}
  with jax.set_mesh(mesh):
    compiled = step_lib.compile_step(trainer, cfg, mesh).lower(state, first).compile()
    out["hlo"] = compiled.as_text()
    batch = first
    for _ in range(STEPS):
      state, metrics = compiled(state, batch)
      out["losses"].append(float(metrics["loss"]))
      out["norms"].append(float(metrics["grad_norm"]))
      out["biases"].append(np.asarray(jax.tree.leaves(state.biases)[0]))
      batch = next(batches)
  return out


@pytest.mark.parametrize("name", MESHES)
def test_expert_parallel_training_equals_single_device(name):
  run, ref = train_run(name), train_run("single")
  np.testing.assert_allclose(run["losses"], ref["losses"], rtol=1e-5)
  np.testing.assert_allclose(run["norms"], ref["norms"], rtol=1e-5)
  np.testing.assert_allclose(np.stack(run["biases"]), np.stack(ref["biases"]), rtol=1e-5, atol=1e-7)
  assert np.abs(ref["biases"][-1]).max() > 0  # the correction bias did move


@pytest.mark.parametrize("name", ["expert1", "expert2", "expert8"])
def test_all_to_all_only_with_expert_parallelism(name):
  count = len(ALL_TO_ALL.findall(train_run(name)["hlo"]))
  assert (count > 0) == (name != "expert1"), count


def test_bias_update_equals_numpy_reference_on_global_loads():
  """One step on expert=4: b = b0 + rate · sign(mean load − load), loads of the single-device forward."""
  ref = train_run("single")
  params, biases = ref["initial"]
  model = nnx.merge(ref["trainer"].graphdef, params, biases)
  batch = ref["batch"]
  _, aux = model.forward(batch["inputs"], batch.get("positions"), batch.get("segment_ids"))
  load_LE = np.asarray(aux["load"], np.float64)
  tokens = (batch["segment_ids"] > 0).sum() if "segment_ids" in batch else batch["inputs"].size
  np.testing.assert_array_equal(load_LE.sum(-1), 2.0 * tokens)  # K=2 copies of every token
  rate = ref["cfg"].optim.bias_update_rate
  expected_LE = np.asarray(jax.tree.leaves(biases)[0]) + rate * np.sign(load_LE.mean(-1, keepdims=True) - load_LE)
  np.testing.assert_allclose(train_run("expert4")["biases"][0], expected_LE, rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------------ one MoE layer, unbalanced router

B, T = 8, 6


def moe_layer(*overrides: str, hot_expert: int | None = 0) -> tuple[MoE, np.ndarray]:
  """The tiny-v3 MoE layer (D=40, E=8, K=2); `hot_expert` gets a large bias, so every token chooses it."""
  cfg = load_config("tiny-v3", *overrides).model
  layer = MoE(cfg, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(3))
  if hot_expert is not None:
    layer.bias_E[...] = jnp.zeros((cfg.n_routed_experts,)).at[hot_expert].set(10.0)
  x_BTD = np.random.default_rng(5).normal(size=(B, T, cfg.hidden_size)).astype(np.float32)
  return layer, x_BTD


def call(layer: MoE, x_BTD: np.ndarray, expert: int | None):
  """The layer's (y, aux) without a mesh (expert=None) or on data × expert = 8 devices."""
  valid_BT = jnp.ones((B, T), jnp.float32)
  graphdef, state = nnx.split(layer)
  apply = jax.jit(lambda s, x, v: nnx.merge(graphdef, s)(x, v))
  if expert is None:
    return apply(state, x_BTD, valid_BT)
  mesh = make_mesh(load_config("tiny-v3", "mesh.data=-1", f"mesh.expert={expert}"))
  with jax.set_mesh(mesh):
    return apply(state, jax.device_put(x_BTD, NamedSharding(mesh, activation_spec(("batch", "length", None)))),
                 valid_BT)


def routing_of(layer: MoE, x_BTD: np.ndarray, shards: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """Expert ids and gate weights [B·T, K] of the no-mesh router."""
  logits = jnp.asarray(x_BTD.reshape(B * T, -1)) @ layer.w_router_DE[...]
  idx, weights, _ = jax.jit(route, static_argnums=(2, 3))(logits, layer.bias_E[...], layer.routing, shards)
  return np.asarray(idx), np.asarray(weights)


def numpy_experts(layer: MoE, x_XD: np.ndarray, idx_XK: np.ndarray, weights_XK: np.ndarray) -> np.ndarray:
  """Σ_k w · SwiGLU_expert(x), written per token copy."""
  wg, wu, wd = (np.asarray(w[...], np.float64) for w in (layer.w_gate_EDM, layer.w_up_EDM, layer.w_down_EMD))
  y = np.zeros(x_XD.shape)
  for x in range(x_XD.shape[0]):
    for k in range(idx_XK.shape[1]):
      e, h = idx_XK[x, k], x_XD[x].astype(np.float64)
      gate = h @ wg[e]
      y[x] += weights_XK[x, k] * ((gate / (1 + np.exp(-gate)) * (h @ wu[e])) @ wd[e])
  return y


def test_unbalanced_router_sends_every_token_to_the_hot_expert():
  layer, x_BTD = moe_layer()
  idx, _ = routing_of(layer, x_BTD)
  assert (idx == 0).any(-1).all()
  _, aux = call(layer, x_BTD, None)
  np.testing.assert_array_equal(np.asarray(aux["load"]), np.bincount(idx.ravel(), minlength=8))


@pytest.mark.parametrize("expert", [2, 4])
def test_dropless_dispatch_drops_nothing_and_equals_no_mesh(expert):
  layer, x_BTD = moe_layer()
  y_ref, aux_ref = call(layer, x_BTD, None)
  y, aux = call(layer, x_BTD, expert)
  assert float(aux["dropped"]) == 0.0
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(aux["load"]), np.asarray(aux_ref["load"]))


def expected_drops(idx_XK: np.ndarray, sources: int, shards: int, experts: int, factor: float) -> np.ndarray:
  """Which copies the documented capacity rule drops [X, K]: each source's copies to one destination fill
  C = ⌈factor · x·K / P⌉ slots (at most x·min(K, e)) in k-major order; the rest are dropped."""
  X, K = idx_XK.shape
  x, e = X // sources, experts // shards
  cap = min(x * min(K, e), math.ceil(factor * x * K / shards))
  dropped = np.zeros((X, K), bool)
  for s in range(sources):
    used = np.zeros(shards, int)
    for k in range(K):
      for t in range(s * x, (s + 1) * x):
        dest = idx_XK[t, k] // e
        dropped[t, k] = used[dest] >= cap
        used[dest] += 1
  return dropped


@pytest.mark.parametrize("factor", [1.0, 1.6])
def test_capacity_factor_drops_exactly_what_it_reports(factor):
  layer, x_BTD = moe_layer(f"model.moe_capacity_factor={factor}")
  idx, weights = routing_of(layer, x_BTD)
  dropped = expected_drops(idx, sources=8, shards=4, experts=8, factor=factor)  # B=8 rows over 8 devices
  assert dropped.sum() > 0
  y, aux = call(layer, x_BTD, 4)
  assert float(aux["dropped"]) == dropped.sum()
  x_XD = x_BTD.reshape(B * T, -1)
  shared = np.asarray(layer.shared(jnp.asarray(x_BTD))).reshape(B * T, -1)
  y_ref = numpy_experts(layer, x_XD, idx, np.where(dropped, 0.0, weights)) + shared
  np.testing.assert_allclose(np.asarray(y).reshape(B * T, -1), y_ref, rtol=1e-4, atol=1e-5)


def test_capacity_without_mesh_applies_to_the_one_shard():
  layer, x_BTD = moe_layer("model.moe_capacity_factor=0.75")
  idx, _ = routing_of(layer, x_BTD)
  _, aux = call(layer, x_BTD, None)
  assert float(aux["dropped"]) == expected_drops(idx, sources=1, shards=1, experts=8, factor=0.75).sum() > 0


# ------------------------------------------------------------------------------- device-limited routing


def numpy_device_limited(choice: np.ndarray, shards: int, max_shards: int, k: int) -> np.ndarray:
  """Per token: keep the max_shards shards with the largest sum of their top-⌈k/max⌉ scores, then top-k."""
  X, E = choice.shape
  ids = []
  for t in range(X):
    per_shard = choice[t].reshape(shards, E // shards)
    score = np.sort(per_shard, -1)[:, ::-1][:, :-(-k // max_shards)].sum(-1)
    keep = np.argsort(-score, kind="stable")[:max_shards]
    masked = np.where(np.isin(np.arange(E) // (E // shards), keep), choice[t], -np.inf)
    ids.append(np.sort(np.argsort(-masked, kind="stable")[:k]))
  return np.array(ids)


@pytest.mark.parametrize("max_shards", [1, 2, 3])
def test_device_limited_routing_matches_reference(max_shards):
  routing = Routing("softmax", "greedy", 1, 1, 6, False, 1.0, False, max_expert_shards=max_shards)
  logits = np.random.default_rng(7).normal(size=(41, 24)).astype(np.float32)
  idx, _, scores = route(jnp.asarray(logits), None, routing, expert_shards=4)
  ref = numpy_device_limited(np.asarray(scores), 4, max_shards, 6)
  np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), ref)
  shards_used = [len(set(row // 6)) for row in np.asarray(idx)]
  assert max(shards_used) == max_shards


def test_device_limited_layer_on_expert_mesh_equals_no_mesh_with_the_same_ranges():
  overrides = ("model.n_group=1", "model.topk_group=1", "model.moe_max_expert_shards=1")
  layer, x_BTD = moe_layer(*overrides, hot_expert=None)
  y, _ = call(layer, x_BTD, 4)
  unlimited, _ = call(layer, x_BTD, None)  # one shard without a mesh: the limit does not bind
  assert not np.allclose(np.asarray(y), np.asarray(unlimited), atol=1e-4)
  layer.routing = dataclasses.replace(layer.routing, expert_shards=4)
  y_ref, _ = call(layer, x_BTD, None)
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-6)
  idx, _ = routing_of(layer, x_BTD)
  assert (idx // 2 == idx[:, :1] // 2).all()  # both experts of every token on one of the 4 shards


def test_grouped_matmuls_agree_with_reference_and_each_other_in_gradients():
  """model.moe_matmul: blocked (the CPU and GPU default) and ragged_dot give the per-copy reference's output and
  the same gradients for the input and every expert weight."""
  results = {}
  for matmul in ("blocked", "ragged_dot"):
    layer, x_BTD = moe_layer(f"model.moe_matmul={matmul}", hot_expert=None)
    graphdef, state = nnx.split(layer)
    valid_BT = jnp.ones((B, T), jnp.float32)
    cotangent = np.random.default_rng(7).normal(size=x_BTD.shape).astype(np.float32)
    loss = lambda s, x: (nnx.merge(graphdef, s)(x, valid_BT)[0] * cotangent).sum()
    y, _ = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, valid_BT))(state, x_BTD)
    results[matmul] = (y, jax.jit(jax.grad(loss, argnums=(0, 1)))(state, x_BTD))
  idx, weights = routing_of(layer, x_BTD)
  x_XD = x_BTD.reshape(B * T, -1)
  y_ref = numpy_experts(layer, x_XD, idx, weights) + np.asarray(layer.shared(jnp.asarray(x_BTD))).reshape(B * T, -1)
  for y, _ in results.values():
    np.testing.assert_allclose(np.asarray(y).reshape(B * T, -1), y_ref, rtol=1e-4, atol=1e-5)
  grads_blocked, grads_ragged = (jax.tree.leaves(results[m][1]) for m in ("blocked", "ragged_dot"))
  assert len(grads_blocked) == len(grads_ragged) > 4
  for a, b in zip(grads_blocked, grads_ragged):
    assert a.ndim < 2 or float(np.abs(np.asarray(a)).max()) > 0  # the router bias has none: it is not trained
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
