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

from conftest import load_config, run_steps
from jaxseek import step as step_lib
from jaxseek.input import global_batches
from jaxseek.errors import UserError
from jaxseek.kernels import choice
from jaxseek.model.moe import MoE, Routing, route
from jaxseek.sharding import experts
from jaxseek.sharding.exchange import capacity, dispatch, kept_sorted, ragged_plan, receive_rows, send_order
from jaxseek.sharding.experts import experts_parallel, experts_parallel_ragged
from jaxseek.sharding.mesh import make_mesh
from jaxseek.sharding.rules import activation_spec

ALL_TO_ALL = re.compile(r"\b(all-to-all)(-start)?\(")
MESHES = {"expert1": ("mesh.expert=1",), "expert2": ("mesh.expert=2",), "expert4": ("mesh.expert=4",),
          "expert8": ("mesh.expert=8",), "e2f2t2": ("mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"),
          # the tensor ranks as expert shards (model.moe_tensor=experts): experts over expert × tensor, tokens' length
          # over tensor, with and without sequence parallelism
          "e2t2-experts": ("mesh.expert=2", "mesh.tensor=2", "model.moe_tensor=experts"),
          "e2f2t2-experts-sp": ("mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2", "model.moe_tensor=experts",
                                "mesh.sequence_parallel=true")}
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


def test_ragged_training_past_its_receive_buffer_equals_single_device(monkeypatch):
  """Three training steps of tiny-v3 on expert=8 through the ragged exchange (emulated) with a receive buffer of
  half the balanced load (model.moe_recv_factor=0.5), so every step needs further rounds: losses, gradient norms
  and correction biases are the single-device run's; none dropped, the extra rounds reported."""
  monkeypatch.setattr(experts.choice, "dispatch_kind", lambda setting, where=None: "ragged")
  monkeypatch.setattr(experts, "experts_parallel_ragged", functools.partial(
      experts.experts_parallel_ragged, exchange=emulated_ragged_all_to_all))
  cfg = load_config("tiny-v3", MOE_ONLY, "mesh.data=-1", "mesh.expert=8", "model.moe_dispatch=ragged",
                    "model.moe_recv_factor=0.5")
  mesh = make_mesh(cfg)
  trainer, state = step_lib.init_state(cfg, mesh)
  state, records = run_steps(cfg, mesh, trainer, state, global_batches(cfg, mesh), 3)
  ref = train_run("single")
  np.testing.assert_allclose(np.asarray(jax.tree.leaves(state.biases)[0]), ref["biases"][2], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose([r["loss"] for r in records], ref["losses"][:3], rtol=1e-5)
  np.testing.assert_allclose([r["grad_norm"] for r in records], ref["norms"][:3], rtol=1e-5)
  assert all(r["moe_dropped_fraction"] == 0 and r["moe_extra_round_fraction"] > 0.2 for r in records), records


def test_overlap_streams_train_as_one_device():
  """tiny-v3 on expert 4 × data 2 with each block's rows in two independent streams (model.overlap_streams=2:
  each device's 2 rows of a batch run as two layers in one program, each with its own exchange): three steps'
  losses, gradient norms and correction biases are the single-device run's, and the step traces twice the
  all-to-alls of one stream."""
  def run(streams):
    cfg = load_config("tiny-v3", MOE_ONLY, "mesh.data=-1", "mesh.expert=4", f"model.overlap_streams={streams}")
    mesh = make_mesh(cfg)
    trainer, state = step_lib.init_state(cfg, mesh)
    batches = global_batches(cfg, mesh)
    with jax.set_mesh(mesh):
      lowered = step_lib.compile_step(trainer, cfg, mesh).lower(state, next(global_batches(cfg, mesh))).as_text()
    return cfg, mesh, trainer, state, batches, lowered.count("all_to_all")

  cfg, mesh, trainer, state, batches, two = run(2)
  one = run(1)[-1]
  assert two == 2 * one > 0, (one, two)
  state, records = run_steps(cfg, mesh, trainer, state, batches, 3)
  ref = train_run("single")
  np.testing.assert_allclose([r["loss"] for r in records], ref["losses"][:3], rtol=1e-5)
  np.testing.assert_allclose([r["grad_norm"] for r in records], ref["norms"][:3], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(jax.tree.leaves(state.biases)[0]), ref["biases"][2], rtol=1e-5, atol=1e-7)


def test_tensor_ranks_as_expert_shards_dispatch_each_token_once(monkeypatch):
  """model.moe_tensor=experts on expert 2 × tensor 2: the routed experts' weights lie whole on expert × tensor
  (P = 4 shards of E/4 experts) and each device dispatches its half of the tokens' length; split (the default)
  dispatches every token from both tensor ranks to P = 2 shards, each expert's hidden width halved."""
  seen = []
  real = experts.routed
  monkeypatch.setattr(experts, "routed", lambda x, idx, *a: seen.append((idx.shape[0], a[-1])) or real(x, idx, *a))
  for mode, tensor_splits_tokens in (("split", False), ("experts", True)):
    seen.clear()
    cfg = load_config("tiny-v3", MOE_ONLY, "mesh.data=-1", "mesh.expert=2", "mesh.tensor=2",
                      f"model.moe_tensor={mode}")
    mesh = make_mesh(cfg)
    trainer = step_lib.make_trainer(cfg, mesh)
    with jax.set_mesh(mesh):
      step_lib.compile_step(trainer, cfg, mesh).lower(trainer.abstract_state, next(global_batches(cfg, mesh)))
    sizes = dict(mesh.shape)
    tokens = cfg.train.batch_size * cfg.train.seq_len // (sizes["data"] * sizes["fsdp"] * sizes["expert"])
    want = (tokens // 2, 4) if tensor_splits_tokens else (tokens, 2)
    assert seen and set(seen) == {want}, (mode, set(seen), want)
    gate = next(s.spec for p, s in jax.tree_util.tree_flatten_with_path(trainer.state_shardings.params)[0]
                if "w_gate_EDM" in jax.tree_util.keystr(p))
    want_spec = (("expert", "tensor"), "fsdp", None) if tensor_splits_tokens else ("expert", "fsdp", "tensor")
    assert tuple(gate[1:]) == want_spec, (mode, gate)


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


@pytest.mark.parametrize("factor, chunks", [(2.0, 1), (0.5, 1), (2.0, 3)])
def test_ragged_dispatch_with_every_token_on_one_expert_is_dropless_on_expert8(factor, chunks, monkeypatch):
  """Every token routed to expert 0 on expert=8 (one expert per device): device 0 receives 48 copies into
  R = ⌈factor · K·x⌉ rows (24, or 6), so the exchange takes 2 (or 8) rounds. Outputs, loads and the gradients of
  the tokens and every weight equal the single-device layer's; nothing is dropped, and the copies past one
  buffer are counted as extra. With model.moe_overlap_chunks=3 each device's 6 tokens go through 3 independent
  exchanges of 2 tokens (receive buffers of ⌈factor · K · 2⌉ rows each), with the same results."""
  monkeypatch.setattr(experts.choice, "dispatch_kind", lambda setting, where=None: "ragged")
  monkeypatch.setattr(experts, "experts_parallel_ragged", functools.partial(
      experts.experts_parallel_ragged, exchange=emulated_ragged_all_to_all))
  layer, x_BTD = moe_layer("model.moe_dispatch=ragged", f"model.moe_recv_factor={factor}",
                           f"model.moe_overlap_chunks={chunks}")
  idx, _ = routing_of(layer, x_BTD)
  assert (idx == 0).any(-1).all()
  cotangent = np.random.default_rng(7).normal(size=x_BTD.shape).astype(np.float32)
  graphdef, state = nnx.split(layer)

  def objective(params, x):
    y, aux = nnx.merge(graphdef, params)(x, jnp.ones((B, T), jnp.float32))
    return (y * cotangent).sum(), (y, aux)

  grad = jax.jit(jax.grad(objective, argnums=(0, 1), has_aux=True))
  (dparams_ref, dx_ref), (y_ref, aux_ref) = grad(state, x_BTD)
  mesh = make_mesh(load_config("tiny-v3", "mesh.data=-1", "mesh.expert=8"))
  with jax.set_mesh(mesh):
    x = jax.device_put(x_BTD, NamedSharding(mesh, activation_spec(("batch", "length", None))))
    (dparams, dx), (y, aux) = grad(state, x)
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_ref), rtol=1e-5, atol=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(dparams), jax.tree.leaves(dparams_ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6, err_msg=str(path))
  load = np.asarray(aux["load"])
  np.testing.assert_array_equal(load, np.asarray(aux_ref["load"]))
  assert float(aux["dropped"]) == 0.0
  # each chunk of each device's row of T tokens: its copies per destination (= expert) past its R rows
  ends = np.linspace(0, T, chunks + 1).astype(int)
  idx_BTK = idx.reshape(B, T, -1)
  past = sum(np.maximum(np.bincount(idx_BTK[:, a:b].ravel(), minlength=8) - int(np.ceil(factor * 2 * (b - a))), 0)
             for a, b in zip(ends[:-1], ends[1:]))
  assert load[0] == B * T and float(aux["extra"]) == past.sum() > 0


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


@pytest.mark.parametrize("expert, chunks", [(2, 1), (4, 1), (4, 2)])
def test_dropless_dispatch_drops_nothing_and_equals_no_mesh(expert, chunks):
  """The fixed dispatch (CPU), also with each device's tokens split into 2 chunks with their own exchanges
  (model.moe_overlap_chunks=2; one chunk's dispatch can run beside the other's GEMMs on GPUs)."""
  layer, x_BTD = moe_layer(f"model.moe_overlap_chunks={chunks}")
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


# ------------------------------------------------------------------- exact-size (ragged) dispatch, FP8 dispatch

SHARDS, X, D, M, E, K = 4, 12, 24, 16, 8, 2  # per shard: X tokens; e = E / SHARDS = 2 local experts
EXPERT_AXES = ("expert",)


def skewed_routing(seed: int = 11, d: int = D) -> tuple[np.ndarray, ...]:
  """Tokens [P·X, d], K distinct experts per token drawn with expert 0 hot, gate weights, expert weights."""
  rng = np.random.default_rng(seed)
  p_E = np.array([6.0] + [1.0] * (E - 1))
  idx = np.stack([rng.choice(E, K, replace=False, p=p_E / p_E.sum()) for _ in range(SHARDS * X)]).astype(np.int32)
  x = rng.normal(size=(SHARDS * X, d)).astype(np.float32)
  weights = rng.uniform(0.2, 1.0, size=(SHARDS * X, K)).astype(np.float32)
  w_gate, w_up = (rng.normal(size=(E, d, M)).astype(np.float32) / np.sqrt(d) for _ in range(2))
  w_down = rng.normal(size=(E, M, d)).astype(np.float32) / np.sqrt(M)
  return x, idx, weights, w_gate, w_up, w_down


def numpy_swiglu(x_ND: np.ndarray, expert_N: np.ndarray, w_gate, w_up, w_down) -> np.ndarray:
  """SwiGLU of each row with its own expert's weights (float64)."""
  wg, wu, wd = (np.asarray(w, np.float64) for w in (w_gate, w_up, w_down))
  h = np.asarray(x_ND, np.float64)
  gate = np.einsum("ND,NDM->NM", h, wg[expert_N])
  return np.einsum("NM,NMD->ND", gate / (1 + np.exp(-gate)) * np.einsum("ND,NDM->NM", h, wu[expert_N]), wd[expert_N])


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
  """jax.lax.ragged_all_to_all's semantics from all_gathers and one scatter (XLA:CPU has no ragged-all-to-all):
  row n of source s's slice i lands at output_offsets[i] + n − input_offsets[i] on device i // (slices / P)."""
  del recv_sizes  # what the receivers expect; the NumPy model checks that it matches what is sent
  N, R = operand.shape[0], output.shape[0]
  every_PN = jax.lax.all_gather(operand, axis_name)
  lo_PS, size_PS, at_PS = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
  per = lo_PS.shape[1] // lo_PS.shape[0]
  mine = lambda a: jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index(axis_name) * per, per, axis=1)[:, None, :]
  lo, size, at = mine(lo_PS), mine(size_PS), mine(at_PS)
  n = jnp.arange(N)[None, :, None]
  inside_PNj = (n >= lo) & (n < lo + size)
  target_PN = jnp.where(inside_PNj.any(-1), jnp.where(inside_PNj, at + n - lo, 0).sum(-1), R)
  return output.at[target_PN.reshape(-1)].set(every_PN.reshape(-1, *operand.shape[1:]), mode="drop")


def numpy_ragged_all_to_all(operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes):
  """jax.lax.ragged_all_to_all as its documentation states it, over lists of every device's arguments."""
  P, S = len(operands), len(input_offsets[0])
  per = S // P
  results = [np.array(o, copy=True) for o in outputs]
  for src in range(P):
    for i in range(S):
      dst, n, lo, at = i // per, send_sizes[src][i], input_offsets[src][i], output_offsets[src][i]
      assert recv_sizes[dst][src * per + i % per] == n  # send_sizes == all_to_all(recv_sizes)
      assert 0 <= at and at + n <= len(results[dst]) and lo + n <= len(operands[src])
      results[dst][at:at + n] = operands[src][lo:lo + n]
  return results


def on_expert_mesh(fn, x, idx, weights, w_gate, w_up, w_down, cotangent=None):
  """fn(x, idx, weights, w_gate, w_up, w_down) inside shard_map over SHARDS devices (tokens and experts split):
  (y [P·X, D], kept [K, P·X]), or with `cotangent` the gradients of Σ y · cotangent for x, weights and experts."""
  mesh = jax.make_mesh((SHARDS,), EXPERT_AXES, axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:SHARDS])
  split = jax.P("expert")
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=(split,) * 6, out_specs=(split, jax.P(None, "expert")))
  args = (x, idx, weights, w_gate, w_up, w_down)
  if cotangent is None:
    return jax.device_get(jax.jit(mapped)(*args))
  loss = lambda x, w, *ws: (mapped(x, idx, w, *ws)[0] * cotangent).sum()
  return jax.device_get(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(x, weights, w_gate, w_up, w_down))


def fixed_fn(fp8_dispatch=False):
  cap = capacity(X, K, SHARDS, E // SHARDS, None)
  return lambda *a: experts_parallel(*a, EXPERT_AXES, SHARDS, cap, matmul="blocked",
                                     fp8_dispatch=fp8_dispatch)[:2]


def ragged_fn(factor, fp8_dispatch=False):
  cap = capacity(X, K, SHARDS, E // SHARDS, None)
  rows = receive_rows(X, K, SHARDS, cap, factor)
  return lambda *a: experts_parallel_ragged(*a, EXPERT_AXES, SHARDS, cap, rows, matmul="blocked", fp8_dispatch=fp8_dispatch,
                                            exchange=emulated_ragged_all_to_all)[:2]


def numpy_ragged_layer(x, idx, weights, w_gate, w_up, w_down, rows):
  """Every shard's plan (send_order, ragged_plan) run through the NumPy ragged_all_to_all, the experts in NumPy on
  each receive buffer as grouped: (y [P·X, D], kept [K, P·X], the global expert of every received row)."""
  e = E // SHARDS
  cap = capacity(X, K, SHARDS, e, None)
  shard = lambda a, s: a[s * X:(s + 1) * X]
  sends = [jax.device_get(jax.jit(send_order, static_argnums=(1, 2, 3))(shard(idx, s), SHARDS, e, cap))
           for s in range(SHARDS)]
  count_PE = np.stack([count for _, _, count in sends])
  plans = [jax.device_get(jax.jit(ragged_plan, static_argnums=2)(count_PE, s, rows)) for s in range(SHARDS)]
  for q in range(SHARDS):  # each receiver's view agrees with what its sources send
    for s in range(SHARDS):
      for l in range(e):
        assert plans[q].recv_offsets_E[s * e + l] == plans[s].out_offsets_E[q * e + l]
        assert plans[q].back_offsets_E[s * e + l] == plans[s].send_offsets_E[q * e + l]
  zeros = lambda n, *rest: [np.zeros((n, *rest), np.float64)] * SHARDS
  fwd = lambda ops, outs: numpy_ragged_all_to_all(ops, outs, *([p[i] for p in plans] for i in range(4)))
  back = lambda ops, outs: numpy_ragged_all_to_all(ops, outs, *([getattr(p, f) for p in plans] for f in (
      "recv_offsets_E", "recv_sizes_E", "back_offsets_E", "send_sizes_E")))
  received = fwd([shard(x, s)[order % X] for s, (order, _, _) in enumerate(sends)], zeros(rows, D))
  experts = fwd([key[:, None].astype(np.float64) for _, key, _ in sends], [np.full((rows, 1), -1.0)] * SHARDS)
  results = []
  for q in range(SHARDS):
    expert_R = np.repeat(q * e + np.arange(e), plans[q].group_sizes_e)
    used = len(expert_R)
    np.testing.assert_array_equal(experts[q][:used, 0], expert_R)  # expert-major, exactly the group sizes
    assert (experts[q][used:] == -1).all()
    results.append(np.zeros((rows, D)))
    results[q][:used] = numpy_swiglu(received[q][:used], expert_R, w_gate, w_up, w_down)
  returned = back(results, zeros(K * X, D))
  y, kept = [], []
  for s, (order, key, _) in enumerate(sends):
    position = np.argsort(order)
    y.append(np.einsum("KXD,XK->XD", returned[s][position].reshape(K, X, D), shard(weights, s)))
    kept.append(np.asarray(kept_sorted(jnp.asarray(key), plans[s]))[position].reshape(K, X))
  return np.concatenate(y), np.concatenate(kept, axis=1)


def test_the_further_rounds_are_marked_in_the_compiled_program():
  """explore/overlap.py tells what runs every step from the dropless exchange's further rounds by the attribute
  the exchange puts on their ops: compiled with half a balanced buffer, the first round's all-gathers (the
  emulated exchange) carry no mark and the further rounds' carry jaxseek_round="further"."""
  x, idx, weights, *w = skewed_routing()
  mesh = jax.make_mesh((SHARDS,), EXPERT_AXES, axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:SHARDS])
  split = jax.P("expert")
  mapped = jax.shard_map(ragged_fn(0.5), mesh=mesh, in_specs=(split,) * 6, out_specs=(split, jax.P(None, "expert")))
  text = jax.jit(mapped).lower(x, idx, weights, *w).compile().as_text()
  gathers = [line for line in text.splitlines() if re.search(r"= \S+ all-gather(-start)?\(", line)]
  marked = [line for line in gathers if 'jaxseek_round="further"' in line]
  assert 0 < len(marked) < len(gathers), (len(marked), len(gathers))


def expected_receiver_drops(idx: np.ndarray, rows: int) -> np.ndarray:
  """The documented rule [P·X, K]: each receiver fills R rows expert-major (local expert, then source, then the
  source's copies k-major); copies past R are dropped."""
  e = E // SHARDS
  dropped = np.zeros(idx.shape, bool)
  for q in range(SHARDS):
    used = 0
    for g in range(q * e, (q + 1) * e):
      for s in range(SHARDS):
        for k in range(K):
          for t in range(s * X, (s + 1) * X):
            if idx[t, k] == g:
              dropped[t, k] = used >= rows
              used += 1
  return dropped


@pytest.mark.parametrize("factor", [4.0, 0.75])
def test_ragged_plan_in_numpy_reproduces_fixed_dispatch_and_drops_past_r(factor):
  """Fed to a NumPy ragged_all_to_all, the plan fills expert-major receive buffers; dropless (f = min(P, E/K) = 4)
  every row equals the fixed-slot path's, and with f = 0.75 exactly the copies past R drop."""
  x, idx, weights, *w = skewed_routing()
  rows = receive_rows(X, K, SHARDS, capacity(X, K, SHARDS, E // SHARDS, None), factor)
  y, kept = numpy_ragged_layer(x, idx, weights, *w, rows)
  dropped = expected_receiver_drops(idx, rows)
  np.testing.assert_array_equal(~kept.T, dropped)
  if factor >= 4:
    assert not dropped.any()
    y_fixed, kept_fixed = on_expert_mesh(fixed_fn(), x, idx, weights, *w)
    assert kept_fixed.all()
    np.testing.assert_allclose(y, y_fixed, rtol=1e-5, atol=1e-6)
  else:
    assert dropped.sum() > 0
  y_ref = sum(np.where(dropped[:, k, None], 0, weights[:, k, None]) * numpy_swiglu(x, idx[:, k], *w)
              for k in range(K))
  np.testing.assert_allclose(y, y_ref, rtol=1e-10, atol=1e-12)


def test_ragged_dispatch_equals_fixed_in_values_and_gradients():
  """experts_parallel_ragged on 4 CPU devices with the exchange emulated, dropless: the fixed path's output, kept
  copies and gradients (tokens, gate weights, every expert weight)."""
  x, idx, weights, *w = skewed_routing()
  y_fixed, kept_fixed = on_expert_mesh(fixed_fn(), x, idx, weights, *w)
  y, kept = on_expert_mesh(ragged_fn(4.0), x, idx, weights, *w)
  np.testing.assert_array_equal(kept, kept_fixed)
  np.testing.assert_allclose(y, y_fixed, rtol=1e-6, atol=1e-7)
  cotangent = np.random.default_rng(2).normal(size=y.shape).astype(np.float32)
  for a, b in zip(on_expert_mesh(ragged_fn(4.0), x, idx, weights, *w, cotangent=cotangent),
                  on_expert_mesh(fixed_fn(), x, idx, weights, *w, cotangent=cotangent)):
    assert np.abs(b).max() > 0
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_ragged_dispatch_with_a_small_receive_buffer_sends_the_rest_in_further_rounds():
  """R = 0.75 · K·x rows on a skewed router: the copies the first round's plan leaves out (exactly the NumPy
  model's, past R in each receiver's expert-major order) go in further rounds, reported as extra; output and
  gradients equal the fixed path's, nothing is dropped."""
  x, idx, weights, *w = skewed_routing()
  cap = capacity(X, K, SHARDS, E // SHARDS, None)
  rows = receive_rows(X, K, SHARDS, cap, 0.75)
  ragged = lambda *a: experts_parallel_ragged(*a, EXPERT_AXES, SHARDS, cap, rows, matmul="blocked",
                                              exchange=emulated_ragged_all_to_all)
  mesh = jax.make_mesh((SHARDS,), EXPERT_AXES, axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:SHARDS])
  split = jax.P("expert")
  y, kept, extra = jax.device_get(jax.jit(jax.shard_map(ragged, mesh=mesh, in_specs=(split,) * 6, out_specs=(
      split, jax.P(None, "expert"), jax.P(None, "expert"))))(x, idx, weights, *w))
  late = expected_receiver_drops(idx, rows)
  assert late.sum() > 0 and kept.all()
  np.testing.assert_array_equal(extra.T, late)
  y_ref = sum(weights[:, k, None] * numpy_swiglu(x, idx[:, k], *w) for k in range(K))
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
  cotangent = np.random.default_rng(3).normal(size=y.shape).astype(np.float32)
  for a, b in zip(on_expert_mesh(ragged_fn(0.75), x, idx, weights, *w, cotangent=cotangent),
                  on_expert_mesh(fixed_fn(), x, idx, weights, *w, cotangent=cotangent)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def grouped_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                              axis_name, axis_index_groups=None):
  """emulated_ragged_all_to_all inside groups of devices (axis_index_groups; None: all of them): row n of a
  source's slice i lands at output_offsets[i] + n − input_offsets[i] on the group's i // (slices / group size)."""
  del recv_sizes
  groups = axis_index_groups or [list(range(jax.lax.axis_size(axis_name)))]
  size = len(groups[0])
  rank = np.zeros(sum(map(len, groups)), np.int32)
  for group in groups:
    rank[list(group)] = np.arange(size)
  me = jnp.asarray(rank)[jax.lax.axis_index(axis_name)]
  N, R = operand.shape[0], output.shape[0]
  gather = lambda a: jax.lax.all_gather(a, axis_name, axis_index_groups=axis_index_groups)
  every_PN = gather(operand)
  lo_PS, size_PS, at_PS = (gather(a) for a in (input_offsets, send_sizes, output_offsets))
  per = lo_PS.shape[1] // size
  mine = lambda a: jax.lax.dynamic_slice_in_dim(a, me * per, per, axis=1)[:, None, :]
  lo, size_, at = mine(lo_PS), mine(size_PS), mine(at_PS)
  n = jnp.arange(N)[None, :, None]
  inside_PNj = (n >= lo) & (n < lo + size_)
  target_PN = jnp.where(inside_PNj.any(-1), jnp.where(inside_PNj, at + n - lo, 0).sum(-1), R)
  return output.at[target_PN.reshape(-1)].set(every_PN.reshape(-1, *operand.shape[1:]), mode="drop")


NODE_SHARDS, NODE = 8, 4  # the expert axis as 2 nodes of 4 devices


def two_stage_inputs(seed=5):
  """8 shards of X tokens, E = 16 experts (2 per device, 8 per node), K = 3 experts per token, every token on
  expert 0 (node 0) and two others."""
  rng = np.random.default_rng(seed)
  E2, K2 = 16, 3
  rest = np.stack([rng.choice(np.arange(1, E2), K2 - 1, replace=False) for _ in range(NODE_SHARDS * X)])
  idx = np.concatenate([np.zeros((NODE_SHARDS * X, 1), np.int64), rest], 1).astype(np.int32)
  x = rng.normal(size=(NODE_SHARDS * X, D)).astype(np.float32)
  weights = rng.uniform(0.2, 1.0, size=(NODE_SHARDS * X, K2)).astype(np.float32)
  w_gate, w_up = (rng.normal(size=(E2, D, M)).astype(np.float32) / np.sqrt(D) for _ in range(2))
  w_down = rng.normal(size=(E2, M, D)).astype(np.float32) / np.sqrt(M)
  return x, idx, weights, w_gate, w_up, w_down


def on_node_mesh(fn, args, cotangent=None):
  """fn(x, idx, weights, w_gate, w_up, w_down) → (y, extra) in a shard_map over the 8-device expert axis."""
  mesh = jax.make_mesh((NODE_SHARDS,), EXPERT_AXES, axis_types=(jax.sharding.AxisType.Auto,))
  split = jax.P("expert")
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=(split,) * 6, out_specs=(split, jax.P()), check_vma=False)
  if cotangent is None:
    return jax.device_get(jax.jit(mapped)(*args))
  x, idx, weights, *w = args
  loss = lambda x, weights, *w: (mapped(x, idx, weights, *w)[0] * cotangent).sum()
  return jax.device_get(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(x, weights, *w))


def two_stage_fn(rows, fp8=False, node_rows=None, exchange=grouped_ragged_all_to_all):
  return lambda x, idx, w, *ws: (lambda y, extra: (y, jax.lax.psum(extra, EXPERT_AXES)))(*experts.experts_two_stage(
      x, idx, w, tuple(ws), EXPERT_AXES, NODE_SHARDS, NODE, rows, matmul="blocked", fp8_dispatch=fp8,
      exchange=exchange, node_rows=node_rows))


def one_stage_fn(fp8=False):
  cap = capacity(X, 3, NODE_SHARDS, 2, None)
  rows = receive_rows(X, 3, NODE_SHARDS, cap, 2.0)
  return lambda *a: (lambda y, kept, extra: (y, jax.lax.psum(extra.sum(), EXPERT_AXES)))(*experts_parallel_ragged(
      *a, EXPERT_AXES, NODE_SHARDS, cap, rows, matmul="blocked", fp8_dispatch=fp8,
      exchange=grouped_ragged_all_to_all))


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_two_stage_dispatch_equals_the_per_copy_reference_in_values_and_gradients(factor):
  """2 nodes × 4 devices, every token on expert 0: each token's hidden state crosses to a node once, the node
  sums its experts' weighted outputs and sends one row back. Output equals Σ_k w·SwiGLU_k(x) per copy (float64
  NumPy), gradients equal the one-stage dispatch's; expert 0's device receives more than one buffer, so the
  second stage takes further rounds and says so."""
  x, idx, weights, *w = args = two_stage_inputs()
  rows = receive_rows(X, 3, NODE_SHARDS, capacity(X, 3, NODE_SHARDS, 2, None), factor)
  y, extra = on_node_mesh(two_stage_fn(rows), args)
  y_ref = sum(weights[:, k, None] * numpy_swiglu(x, idx[:, k], *w) for k in range(3))
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  assert float(extra) > 0, extra  # 96 copies for expert 0's device against R = 72 (or 18) rows
  cotangent = np.random.default_rng(2).normal(size=y.shape).astype(np.float32)
  for a, b in zip(on_node_mesh(two_stage_fn(rows), args, cotangent), on_node_mesh(one_stage_fn(), args, cotangent)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("node_rows", [5, 12])
def test_two_stage_first_stage_receives_in_rounds_of_its_buffer(node_rows):
  """Stage 1 with a receive buffer of `node_rows` rows instead of N·X = 24: every token reaches node 0, so each
  device there receives 24 rows and takes ⌈24 / node_rows⌉ rounds (5 or 2), each fanned out within the node.
  The exchange across nodes receives into `node_rows` rows (and returns into the 24 sent); the output equals
  Σ_k w·SwiGLU_k(x) per copy (float64 NumPy), the gradients the one-stage dispatch's, and the copies of the
  further rounds count as sent after the first."""
  x, idx, weights, *w = args = two_stage_inputs()
  rows = receive_rows(X, 3, NODE_SHARDS, capacity(X, 3, NODE_SHARDS, 2, None), 2.0)
  sizes = set()

  def recorded(operand, output, *rest, **kw):
    if len(kw["axis_index_groups"][0]) == NODE_SHARDS // NODE:  # the groups that span the nodes
      sizes.add((operand.shape[0], output.shape[0]))
    return grouped_ragged_all_to_all(operand, output, *rest, **kw)

  y, extra = on_node_mesh(two_stage_fn(rows, node_rows=node_rows, exchange=recorded), args)
  assert {min(a, b) for a, b in sizes} == {node_rows} and {max(a, b) for a, b in sizes} == {2 * X}, sizes
  y_ref = sum(weights[:, k, None] * numpy_swiglu(x, idx[:, k], *w) for k in range(3))
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  _, extra_one_round = on_node_mesh(two_stage_fn(rows), args)
  assert float(extra) > float(extra_one_round), (extra, extra_one_round)
  cotangent = np.random.default_rng(3).normal(size=y.shape).astype(np.float32)
  for a, b in zip(on_node_mesh(two_stage_fn(rows, node_rows=node_rows), args, cotangent),
                  on_node_mesh(one_stage_fn(), args, cotangent)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_two_stage_float8_dispatch_equals_the_one_stage_float8_dispatch():
  """The second stage re-rounds rows that are already e4m3 with the same tile scales: exact, so the output is the
  one-stage float8 dispatch's (to summation order), and so are the gradients."""
  args = two_stage_inputs(seed=8)
  rows = receive_rows(X, 3, NODE_SHARDS, capacity(X, 3, NODE_SHARDS, 2, None), 2.0)
  y2, _ = on_node_mesh(two_stage_fn(rows, fp8=True), args)
  y1, _ = on_node_mesh(one_stage_fn(fp8=True), args)
  y_bf, _ = on_node_mesh(one_stage_fn(), args)
  np.testing.assert_allclose(y2, y1, rtol=1e-5, atol=1e-6)
  assert np.abs(y1 - y_bf).max() > 1e-3  # the float8 rounding shows
  cotangent = np.random.default_rng(4).normal(size=y1.shape).astype(np.float32)
  for a, b in zip(on_node_mesh(two_stage_fn(rows, fp8=True), args, cotangent),
                  on_node_mesh(one_stage_fn(fp8=True), args, cotangent)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_two_stage_sends_at_most_the_nodes_a_token_reaches():
  """4 nodes of 2 devices, 16 experts (4 a node), every token's 3 experts on at most 2 nodes, as group-limited
  routing guarantees: with reach = 2 each device sends and gets back 2·X rows across nodes (not 4·X, one per
  node), and the output is still Σ_k w·SwiGLU_k(x) per copy (float64 NumPy), its gradients the one-stage
  dispatch's."""
  rng = np.random.default_rng(7)
  E2, K2, node = 16, 3, 2
  nodes = np.stack([rng.choice(4, 2, replace=False) for _ in range(NODE_SHARDS * X)])
  idx = np.stack([rng.choice(np.concatenate([n * 4 + np.arange(4) for n in pair]), K2, replace=False)
                  for pair in nodes]).astype(np.int32)
  x, _, weights, *w = two_stage_inputs()
  args = (x, idx, weights, *w)
  sizes = set()

  def recorded(operand, output, *rest, **kw):
    if kw.get("axis_index_groups") and len(kw["axis_index_groups"][0]) == 4:  # the groups that span the nodes
      sizes.add((operand.shape[0], output.shape[0]))
    return grouped_ragged_all_to_all(operand, output, *rest, **kw)

  rows = receive_rows(X, K2, NODE_SHARDS, capacity(X, K2, NODE_SHARDS, 2, None), 2.0)
  fn = lambda x, idx, w, *ws: (lambda y, extra: (y, jax.lax.psum(extra, EXPERT_AXES)))(*experts.experts_two_stage(
      x, idx, w, tuple(ws), EXPERT_AXES, NODE_SHARDS, node, rows, matmul="blocked", exchange=recorded, reach=2))
  y, _ = on_node_mesh(fn, args)
  assert {min(a, b) for a, b in sizes} == {2 * X} and {max(a, b) for a, b in sizes} == {4 * X}, sizes
  y_ref = sum(weights[:, k, None] * numpy_swiglu(x, idx[:, k], *w) for k in range(K2))
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  cotangent = np.random.default_rng(8).normal(size=y.shape).astype(np.float32)
  cap = capacity(X, K2, NODE_SHARDS, 2, None)
  one = lambda *a: (lambda y, kept, extra: (y, jax.lax.psum(extra.sum(), EXPERT_AXES)))(*experts_parallel_ragged(
      *a, EXPERT_AXES, NODE_SHARDS, cap, receive_rows(X, K2, NODE_SHARDS, cap, 2.0), matmul="blocked",
      exchange=grouped_ragged_all_to_all))
  for a, b in zip(on_node_mesh(fn, args, cotangent), on_node_mesh(one, args, cotangent)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunks, factor, shards", [(1, 2.0, "expert8"), (2, 2.0, "expert8"), (1, 0.5, "expert8"),
                                                  (2, 2.0, "e4t2-experts")])
def test_two_stage_training_on_two_nodes_of_four_equals_single_device(monkeypatch, chunks, factor, shards):
  """Five training steps of tiny-v3 (group-limited routing: a token's experts lie in at most 2 of the 4 groups) on
  expert=8 as 2 nodes × 4 (mesh.devices_per_node=4), model.moe_dispatch=two_stage with the exchanges emulated,
  also with each device's tokens in 2 chunks (model.moe_overlap_chunks=2, how DeepSeek-V3's layout fits), and
  with receive buffers of half the average rows (model.moe_recv_factor=0.5: both stages take further rounds), and
  on expert 4 × tensor 2 with the tensor ranks as expert shards (model.moe_tensor=experts: 8 shards over expert ×
  tensor, each device dispatching half of its tokens' length, in 2 chunks): losses, gradient norms and correction biases are
  the single-device run's; the start-up line names it."""
  monkeypatch.setattr(experts.choice, "dispatch_kind", lambda setting, where=None: setting)
  monkeypatch.setattr(experts, "experts_two_stage", functools.partial(
      experts.experts_two_stage, exchange=grouped_ragged_all_to_all))
  calls = []
  real = experts.experts_two_stage
  monkeypatch.setattr(experts, "experts_two_stage", lambda *a, **k: calls.append((*a[5:7], a[0].shape[0])) or
                      real(*a, **k))
  layout = ("mesh.expert=8",) if shards == "expert8" else ("mesh.expert=4", "mesh.tensor=2", "model.moe_tensor=experts")
  cfg = load_config("tiny-v3", MOE_ONLY, "mesh.data=-1", *layout, "mesh.devices_per_node=4",
                    "model.moe_dispatch=two_stage", f"model.moe_overlap_chunks={chunks}",
                    f"model.moe_recv_factor={factor}")
  mesh = make_mesh(cfg)
  assert experts.node_shards(mesh, 4, experts.expert_axes(cfg.model)) == 4
  over = "expert=8" if shards == "expert8" else "expert × tensor = 8 (model.moe_tensor=experts)"
  assert f"two-stage (node-limited) over {over} as 2 nodes × 4" in experts.dispatch_summary(
      cfg, dict(mesh.shape), "gpu", node=4)
  trainer, state = step_lib.init_state(cfg, mesh)
  state, records = run_steps(cfg, mesh, trainer, state, global_batches(cfg, mesh), STEPS)
  # the two-stage exchange ran: 8 expert shards, 4 a node, a device's 48 tokens in `chunks` exchanges
  assert set(calls) == {(8, 4, 48 // chunks)}, set(calls)
  ref = train_run("single")
  np.testing.assert_allclose([r["loss"] for r in records], ref["losses"], rtol=1e-5)
  np.testing.assert_allclose([r["grad_norm"] for r in records], ref["norms"], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(jax.tree.leaves(state.biases)[0]), ref["biases"][-1], rtol=1e-5, atol=1e-7)
  assert all(r["moe_dropped_fraction"] == 0 for r in records)


def numpy_e4m3_tiles(x: np.ndarray) -> np.ndarray:
  """x [N, D] rounded to e4m3 per 1×128 tile, scale = amax · (1/448) (float32 arithmetic)."""
  import ml_dtypes

  N, D = x.shape
  tiles = np.pad(x.astype(np.float32), ((0, 0), (0, -D % 128))).reshape(N, -1, 128)
  amax = np.abs(tiles).max(-1, keepdims=True)
  scale = np.where(amax > 0, amax * np.float32(1 / 448), np.float32(1)).astype(np.float32)
  return ((tiles / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale).reshape(N, -1)[:, :D]


def test_fp8_dispatch_sends_the_numpy_rounded_rows():
  """Through an all_to_all, FP8 dispatch delivers exactly the NumPy quantise-dequantise of the rows (D = 160: a
  full and a partial 128-channel tile; a row of zeros), within e4m3's rounding bound of the rows themselves."""
  x = skewed_routing(d=160)[0]
  x[3] = 0
  x_rounded = numpy_e4m3_tiles(x)
  scale = np.repeat(np.abs(np.pad(x, ((0, 0), (0, 96)))).reshape(len(x), -1, 128).max(-1) / 448, 128, 1)[:, :160]
  assert (np.abs(x_rounded - x) <= np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * scale)).all()
  assert (x_rounded != x).mean() > 0.9
  mesh = jax.make_mesh((SHARDS,), EXPERT_AXES, axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:SHARDS])
  a2a = lambda a, plan: jax.lax.all_to_all(a.reshape(SHARDS, -1, *a.shape[1:]), EXPERT_AXES, 0, 0).reshape(a.shape)
  run = lambda fp8, rows: jax.device_get(jax.jit(jax.shard_map(
      lambda a: dispatch(a2a, a2a, a, (), fp8), mesh=mesh, in_specs=jax.P("expert"), out_specs=jax.P("expert")))(
          rows))
  np.testing.assert_array_equal(run(True, x), run(False, x_rounded))
  # fp8_back: the forward exchange as it is, the backward's carries the NumPy-rounded cotangent rows
  grad = lambda fp8, c: jax.device_get(jax.jit(jax.shard_map(
      lambda a, c: jax.vjp(lambda a: dispatch(a2a, a2a, a, (), fp8_back=fp8), a)[1](c)[0], mesh=mesh,
      in_specs=jax.P("expert"), out_specs=jax.P("expert")))(x, c))
  np.testing.assert_array_equal(grad(True, x), grad(False, x_rounded))


@pytest.mark.parametrize("path", ["fixed", "ragged"])
def test_fp8_dispatch_computes_on_rounded_tokens_and_passes_gradients_straight_through(path):
  """moe_dispatch_dtype=float8_e4m3fn: the output is the unrounded dispatch's at the rounded tokens; the gradient
  passes straight through the tokens' rounding, the expert-bound cotangents of the backward travel rounded too:
  within FP8's rounding of the gradient at the rounded tokens, and not equal to it."""
  x, idx, weights, *w = skewed_routing(d=160)
  x_rounded = numpy_e4m3_tiles(x)
  make = (lambda fp8: fixed_fn(fp8)) if path == "fixed" else (lambda fp8: ragged_fn(4.0, fp8))
  y_fp8, _ = on_expert_mesh(make(True), x, idx, weights, *w)
  y_ref, _ = on_expert_mesh(make(False), x_rounded, idx, weights, *w)
  y_plain, _ = on_expert_mesh(make(False), x, idx, weights, *w)
  np.testing.assert_allclose(y_fp8, y_ref, rtol=1e-5, atol=1e-5)
  assert 1e-3 < np.abs(y_fp8 - y_plain).max() <= 0.1 * np.abs(y_plain).max()
  cotangent = np.random.default_rng(2).normal(size=y_fp8.shape).astype(np.float32)
  got = on_expert_mesh(make(True), x, idx, weights, *w, cotangent=cotangent)
  want = on_expert_mesh(make(False), x_rounded, idx, weights, *w, cotangent=cotangent)
  for name, a, b in zip(("x", "weights", "w_gate", "w_up", "w_down"), got, want):
    a, b = np.asarray(a), np.asarray(b)
    if name == "weights":  # the gate weights' gradient reads the results, which come back unrounded
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    else:
      assert 0 < np.abs(a - b).max() <= 0.1 * np.abs(b).max(), name


def test_dispatch_kind_is_ragged_on_accelerators_and_refused_on_cpu():
  assert [choice.dispatch_kind("auto", where) for where in ("gpu", "tpu", "cpu")] == ["ragged", "ragged", "fixed"]
  assert choice.dispatch_kind("fixed", "gpu") == "fixed"
  with pytest.raises(UserError, match="model.moe_dispatch: ragged needs ragged-all-to-all.*cpu; use auto or fixed"):
    choice.dispatch_kind("ragged", "cpu")
  layer, x_BTD = moe_layer("model.moe_dispatch=ragged")  # built anywhere (the explorer plans on CPU), run: refused
  with pytest.raises(UserError, match="model.moe_dispatch: ragged"):
    call(layer, x_BTD, None)


def test_dispatch_summary_gives_the_rows_one_layer_moves_per_device():
  cfg = load_config("tiny-v3", "mesh.data=2", "mesh.expert=4")  # 16 sequences of 24 over 8 shards: x = 48
  sizes = cfg.mesh.sizes() | {"data": 2}
  assert "fixed all_to_all over expert=4, 4 × 96 = 384 rows per device for K·x = 96" in \
      experts.dispatch_summary(cfg, sizes, "cpu")
  line = experts.dispatch_summary(load_config("tiny-v3", "mesh.data=2", "mesh.expert=4",
                                              "model.moe_dispatch_dtype=float8_e4m3fn"), sizes, "gpu")
  assert "ragged_all_to_all over expert=4" in line and "receive buffer of 192 rows" in line, line
  assert "one round from 4, further rounds past it, none dropped" in line and "float8_e4m3fn rows with float32 scales" in line, line
  # two_stage asked for where the expert axis has no second level: the one-stage exchange runs, and the line says so
  staged = load_config("tiny-v3", "mesh.data=2", "mesh.expert=4", "model.moe_dispatch=two_stage")
  for node, why in ((None, "the expert axis's 4 shards lie within one node"),
                    (3, "3 devices a node do not split the expert axis's 4 shards into whole nodes")):
    line = experts.dispatch_summary(staged, sizes, "gpu", node=node)
    assert line.startswith("MoE dispatch: ragged_all_to_all over expert=4") and line.endswith(
        f"(model.moe_dispatch=two_stage runs as this one-stage exchange: {why})"), line
  assert "two-stage (node-limited) over expert=4 as 2 nodes × 2" in experts.dispatch_summary(staged, sizes, "gpu", node=2)
  # auto across nodes, dropless: the two-stage exchange, and the line says why; within a node one stage
  auto = load_config("tiny-v3", "mesh.data=2", "mesh.expert=4")
  line = experts.dispatch_summary(auto, sizes, "gpu", node=2)
  assert line.startswith("MoE dispatch: two-stage (node-limited) over expert=4 as 2 nodes × 2") and line.endswith(
      "(model.moe_dispatch=auto: the expert axis spans 2 nodes and the exchange is dropless; ragged keeps one "
      "stage)"), line
  assert experts.dispatch_summary(auto, sizes, "gpu", node=None).startswith("MoE dispatch: ragged_all_to_all")
  # ragged asked for across nodes: one stage, nothing to explain
  ragged = load_config("tiny-v3", "mesh.data=2", "mesh.expert=4", "model.moe_dispatch=ragged")
  assert experts.dispatch_summary(ragged, sizes, "gpu", node=2).endswith("results back in float32"), line
  # auto with a capacity factor keeps one stage across nodes (two_stage with one is refused), and says why
  capped = load_config("tiny-v3", "mesh.data=2", "mesh.expert=4", "model.moe_capacity_factor=1.5")
  line = experts.dispatch_summary(capped, sizes, "gpu", node=2)
  assert line.startswith("MoE dispatch: ragged_all_to_all") and line.endswith(
      "applies per pair of devices: model.moe_dispatch=auto runs as this one-stage exchange; null for two "
      "stages)"), line


@pytest.mark.parametrize("path", ["fixed", "ragged"])
def test_padding_tokens_take_no_expert_capacity(path):
  """Left-padded generation batches: padding copies are never sent and take no capacity, so what real tokens get
  does not depend on where padding routes (first in every shard here, so it would fill the buffers first)."""
  x, idx, weights, w_gate, w_up, w_down = skewed_routing(seed=5)
  e, pad = E // SHARDS, 4
  valid_X = jnp.asarray(np.arange(X) >= pad)
  cap = capacity(X, K, SHARDS, e, 1.0)
  rows = receive_rows(X, K, SHARDS, cap, 1.0)

  def layer(valid):
    if path == "fixed":
      return lambda *a: experts_parallel(*a, EXPERT_AXES, SHARDS, cap, matmul="blocked", valid_X=valid)[:2]
    return lambda *a: experts_parallel_ragged(*a, EXPERT_AXES, SHARDS, cap, rows, matmul="blocked",
                                              exchange=emulated_ragged_all_to_all, valid_X=valid)[:2]

  padding = np.tile(np.arange(X) < pad, SHARDS)
  hot = idx.copy()
  hot[padding] = [0, 1]  # every padding token on the hot experts
  spread = idx.copy()
  spread[padding] = [E - 2, E - 1]
  runs = {name: on_expert_mesh(layer(valid_X), x, r, weights, w_gate, w_up, w_down)
          for name, r in (("hot", hot), ("spread", spread))}
  for y, kept in runs.values():
    assert not kept[:, padding].any() and np.abs(y[padding]).max() == 0
  np.testing.assert_array_equal(runs["hot"][0][~padding], runs["spread"][0][~padding])
  np.testing.assert_array_equal(runs["hot"][1][:, ~padding], runs["spread"][1][:, ~padding])
  # the setup is tight: counting padding as tokens, the real tokens' drops depend on where padding routes
  old = {name: on_expert_mesh(layer(None), x, r, weights, w_gate, w_up, w_down)[1] for name, r in
         (("hot", hot), ("spread", spread))}
  assert (old["hot"][:, ~padding] != old["spread"][:, ~padding]).any()
  assert runs["hot"][1][:, ~padding].sum() >= old["hot"][:, ~padding].sum()
