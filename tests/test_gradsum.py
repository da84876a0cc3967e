"""The gradient the optimiser receives, leaf by leaf, on a mesh against one device: the once-per-step sums over the
batch axes (sharding/gradsum.py: a shard_map run without JAX's varying-axes check) add up the groups' gradients
once, no more, no less. The helpers here record that gradient; test_compression.py and test_precision.py use them
for the compressed sums."""

import jax
import numpy as np
import optax
import pytest

from conftest import load_config
from jaxseek import input as input_lib
from jaxseek import step as step_lib
from jaxseek.input import global_batches
from jaxseek.sharding import gradsum
from jaxseek.pipeline import stages as pipeline_lib
from jaxseek.sharding import rules
from jaxseek.sharding.mesh import make_mesh


def host(tree) -> dict[str, np.ndarray]:
  """A tree's leaves on the host in float64, named as compression.matrix_views names parameters ("a/b/c")."""
  name = lambda path: "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
  return {name(path): np.asarray(jax.device_get(x), np.float64)
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def recording(trainer, seen: list):
  """`trainer` whose optimiser appends the gradient it is given to `seen` (while tracing) and then updates as
  before."""
  inner = trainer.tx

  def update(grads, opt_state, params=None):
    seen.append(grads)
    return inner.update(grads, opt_state, params)

  return trainer.replace(tx=optax.GradientTransformation(inner.init, update))


def recorded_steps(name: str, overrides, steps: int = 1, devices=None, state_fn=None, batches=None):
  """`steps` train steps of config `name` (jaxseek's step, jitted with the shardings compile_step gives it): per
  step the gradient its optimiser received ("grads"), the residual and basis after it and the basis before it,
  and the metrics, on the host by leaf name, and the state before it ("state"); and the last state and the
  trainer. `state_fn(i, trainer, state)`
  may change the state before step i; `batches` (default: the config's) feeds the steps."""
  cfg = load_config(name, *overrides)
  mesh = make_mesh(cfg, devices)
  trainer, state = step_lib.init_state(cfg, mesh)
  seen = []
  traced = recording(trainer, seen)

  def step(state, batch):
    seen.clear()
    with rules.sequence_parallel(cfg.mesh.sequence_parallel), pipeline_lib.batch_rules(cfg, dict(mesh.shape)):
      new, metrics = step_lib.train_step(traced, cfg, state, batch)
    return new, metrics, seen[0]

  step_fn = jax.jit(step, in_shardings=(trainer.state_shardings, input_lib.batches.batch_shardings(mesh, cfg)),
                    out_shardings=(trainer.state_shardings, None, None))
  batches = global_batches(cfg, mesh) if batches is None else batches
  out = []
  with jax.set_mesh(mesh):
    for i in range(steps):
      if state_fn is not None:
        state = state_fn(i, trainer, state)
      before = state
      state, metrics, grads = step_fn(state, next(batches))
      out.append({"grads": host(grads), "residual": host(state.grad_residual), "basis": host(state.grad_basis),
                  "basis_before": host(before.grad_basis), "state": before, "metrics": jax.device_get(metrics)})
  return out, state, trainer


def one_device(name: str, *overrides: str, steps: int = 1):
  """recorded_steps of the same model and batches on one device."""
  return recorded_steps(name, ("mesh.data=1", *overrides), steps, jax.devices()[:1])[0]


def assert_leaves_close(got: dict, want: dict, rel: float) -> dict[str, float]:
  """Each leaf of `got` within `rel` × the leaf's largest |value| of `want`, elementwise; returns each leaf's
  worst error in those units."""
  assert got.keys() == want.keys()
  worst = {}
  for key, w in want.items():
    scale = np.abs(w).max()
    assert scale > 0, key  # every leaf gets a gradient: a zero leaf would pass any relative check
    worst[key] = float(np.abs(got[key] - w).max() / scale)
  assert max(worst.values()) <= rel, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
  return worst


# float32 reassociation: a sum of n terms added in another order moves by up to ~n·2⁻²⁴ of Σ|terms|, and the
# devices split each leaf's sums (over the 384 tokens, the experts, the tensor shards) differently from one device.
# Measured worst leaf, data 2 × expert 2 × tensor 2 against one device: 1.2e-6 of the leaf's max. A gradient
# counted twice, halved or missing one group's rows is off by 0.5 or more.
REASSOCIATION = 2e-5


@pytest.mark.parametrize("mesh, summed", [
    (("mesh.data=2", "mesh.expert=2", "mesh.tensor=2", "train.microbatches=2"), ("data", "expert")),
    (("mesh.data=2", "mesh.fsdp=2", "mesh.expert=2", "train.zero=1", "train.microbatches=2"),
     ("data", "fsdp", "expert"))], ids=["d2e2t2-m2", "d2f2e2-zero1-m2"])
def test_gradients_summed_once_per_step_equal_one_device(mesh, summed):
  """tiny-v3 (MoE) with two microbatches on data × expert × tensor, and on data × fsdp × expert under ZeRO-1:
  each leaf of the gradient the optimiser receives equals the one-device gradient to float32 reassociation (the
  expert weights summed over the other axes only, the rest over all of them, once after the microbatch scan),
  and the step's grad_norm is its norm."""
  cfg = load_config("tiny-v3", *mesh)
  assert gradsum.axes(cfg, dict(make_mesh(cfg).shape)) == summed  # the once-per-step path
  got = recorded_steps("tiny-v3", mesh)[0][0]
  want = one_device("tiny-v3")[0]
  worst = assert_leaves_close(got["grads"], want["grads"], REASSOCIATION)
  print(f"{mesh}: worst leaf {max(worst.values()):.2e} of its max")
  norm = np.sqrt(sum((g ** 2).sum() for g in got["grads"].values()))
  np.testing.assert_allclose(float(got["metrics"]["grad_norm"]), norm, rtol=1e-5)
