"""Multi-token prediction: the module against the paper's equations, and its loss in training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from conftest import load_config
from jaxseek import model as model_lib
from jaxseek import step as step_lib
from jaxseek.input import global_batches
from jaxseek.sharding.mesh import make_mesh


def rms(x, w, eps):
  x = np.asarray(x, np.float64)
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w)


def test_mtp_logits_follow_the_equations():
  """h'_i = [enorm(Emb(t_{i+k})); hnorm(h_i^{k-1})] · W_eh, h^k = Block(h'), logits = norm(h^k) · Head; depth 1
  reads the main model's normed output, depth 2 the un-normed h^1; each depth's MoE sees only positions that
  have a target (the last k positions have none)."""
  cfg = load_config("tiny-v3", "model.num_nextn_predict_layers=2").model
  model = model_lib.build(cfg, seed=3)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11)), jnp.int32)
  logits, aux = model.forward(tokens)
  table, head, eps = np.asarray(model.embed.table_VD[...]), np.asarray(model.head_DV[...]), cfg.rms_norm_eps
  positions = jnp.broadcast_to(jnp.arange(11), (2, 11))
  h = np.asarray(aux["hidden"], np.float64)
  for k, layer in enumerate(model.mtp_layers, start=1):
    future = np.concatenate([np.asarray(tokens)[:, k:], np.zeros((2, k), np.int64)], axis=1)  # t_{i+k}
    w_eh = np.concatenate([np.asarray(layer.w_e_DD[...]), np.asarray(layer.w_h_DD[...])], axis=0)  # [2D, D]
    fused = np.concatenate([rms(table[future], layer.enorm.scale_D[...], eps), rms(h, layer.hnorm.scale_D[...], eps)],
                           axis=-1) @ w_eh
    has_target = jnp.asarray(np.arange(11) < 11 - k, jnp.float32)[None].repeat(2, 0)  # t_{i+k+1} exists
    out, block_aux = layer.block(jnp.asarray(fused, jnp.float32), positions, None, has_target)
    np.testing.assert_allclose(aux["mtp_logits"][k - 1], rms(out, layer.norm.scale_D[...], eps) @ head,
                               rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(aux["mtp_load"][k - 1], block_aux["load"], atol=1e-6)
    assert float(aux["mtp_load"][k - 1].sum()) == cfg.num_experts_per_tok * 2 * (11 - k)
    np.testing.assert_allclose(aux["mtp_balance"][k - 1], block_aux["balance"], rtol=1e-5)
    h = np.asarray(out, np.float64)  # the next depth reads h^k before the shared head's norm
  assert aux["mtp_logits"].shape == (2, 2, 11, cfg.vocab_size)


def test_mtp_mask_stays_inside_documents():
  batch = {"loss_mask": jnp.asarray([[1, 1, 1, 0, 1, 1, 1, 0]], jnp.float32),
           "segment_ids": jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 2]])}
  # depth 1 at i predicts t_{i+2} = target at i+1: needs loss_mask[i+1] and the same document.
  np.testing.assert_array_equal(step_lib.mtp_mask(batch, 1), [[1, 1, 0, 0, 1, 1, 0, 0]])
  np.testing.assert_array_equal(step_lib.mtp_mask(batch, 2), [[1, 0, 0, 0, 1, 0, 0, 0]])


def one_step(weight):
  cfg = load_config("tiny-v3", "model.num_nextn_predict_layers=1", f"train.mtp_loss_weight={weight}",
                    "model.aux_loss_alpha=0", "mesh.data=1")
  mesh = make_mesh(cfg, jax.devices()[:1])
  trainer, state = step_lib.init_state(cfg, mesh)
  batch = next(global_batches(cfg, mesh))
  params = jax.tree.map(jnp.copy, state.params)  # the step donates its input state
  with jax.set_mesh(mesh):
    new_state, metrics = step_lib.compile_step(trainer, cfg, mesh)(state, batch)
  return cfg, trainer, params, batch, metrics, new_state


def test_mtp_loss_enters_training_with_its_weight():
  _, trainer, params, batch, metrics, _ = one_step(0.5)

  def objective(p):  # written out: main CE + 0.5 · CE of depth 1 on targets shifted by one
    model = nnx.merge(trainer.graphdef, p, jax.tree.map(jnp.zeros_like, trainer.abstract_state.biases))
    logits, aux = model.forward(batch["inputs"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    t = batch["targets"].shape[1]
    mtp = optax.softmax_cross_entropy_with_integer_labels(aux["mtp_logits"][0][:, :t - 1], batch["targets"][:, 1:])
    return ce + 0.5 * mtp.mean(), (ce, mtp.mean())

  (_, (ce, mtp)), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(params)
  np.testing.assert_allclose(metrics["loss"], ce, rtol=1e-5)
  np.testing.assert_allclose(metrics["mtp_loss"], mtp, rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(grads), rtol=1e-5)
  mtp_grads = jax.tree.leaves(grads["mtp_layers"])
  assert all(np.isfinite(g).all() for g in mtp_grads) and max(np.abs(g).max() for g in mtp_grads) > 0


def test_zero_weight_leaves_mtp_untrained_by_gradients():
  _, _, params, _, _, new_state = one_step(0.0)
  # Only weight decay moves MTP parameters when λ = 0: norms (no decay) stay exactly the same.
  old = params["mtp_layers"][0]["enorm"]["scale_D"][...]
  new = new_state.params["mtp_layers"][0]["enorm"]["scale_D"][...]
  np.testing.assert_array_equal(np.asarray(old), np.asarray(new))
