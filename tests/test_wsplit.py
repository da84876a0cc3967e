"""The backward of a pipeline chunk split into b and W (pipeline/wsplit.py): the same values as the whole vjp, and
every matmul computed once."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jcore

from conftest import load_config
from jaxseek import step as step_lib
from jaxseek.errors import UserError
from jaxseek.model import remat as remat_lib
from jaxseek.pipeline import wsplit
from jaxseek.sharding.mesh import make_mesh


def chunk_backward(name, *overrides):
  """(flat backward fn, its arguments, the number of weight leaves) of a tiny model's layer stack run as one
  pipeline chunk (a scan over its layers, as objective.pipelined_gradients runs it)."""
  cfg = load_config(name, "mesh.data=1", *overrides)
  mesh = make_mesh(cfg, jax.devices()[:1])
  trainer, state = step_lib.init_state(cfg, mesh)
  model = nnx.merge(trainer.graphdef, state.params, state.biases)
  stack = model.moe_layers if cfg.model.is_moe else model.dense_layers
  graphdef, params, consts = nnx.split(stack.blocks, nnx.Param, ...)
  body = remat_lib.wrap(lambda x, lp, lc, side: nnx.merge(graphdef, lp, lc)(x, *side), cfg.train.remat)
  B, T, D = 2, 16, cfg.model.hidden_size
  side = (jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.ones((B, T), jnp.int32), jnp.ones((B, T), jnp.float32))
  leaves, treedef = jax.tree.flatten(params)

  def backward(x, *rest):
    chunk = lambda x, p: jax.lax.scan(lambda x, layer: body(x, *layer, side), x, (p, consts))[0]
    _, pull = jax.vjp(chunk, x, jax.tree.unflatten(treedef, rest[:-1]))
    dx, dp = pull(rest[-1])
    return [dx, *jax.tree.leaves(dp)]

  x = jax.random.normal(jax.random.key(0), (B, T, D))
  g = jax.random.normal(jax.random.key(1), (B, T, D))
  return mesh, backward, (x, *leaves, g), len(leaves)


def count_dots(fn, *args) -> int:
  def walk(jaxpr):
    n = 0
    for eqn in jaxpr.eqns:
      n += eqn.primitive.name == "dot_general"
      for value in eqn.params.values():
        for inner in value if isinstance(value, (list, tuple)) else [value]:
          inner = getattr(inner, "jaxpr", inner)
          if hasattr(inner, "eqns"):
            n += walk(inner)
    return n

  return walk(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("name, overrides, w_dots", [
    ("tiny-dense", (), 7),  # q, k, v, o, gate, up, down: every weight gradient in W
    ("tiny-dense", ("train.remat=full",), 7),  # through the remat of each layer
    ("tiny-v3", (), 15),  # MLA's, the shared expert's, the router's and the routed experts' (inside their shard_map)
], ids=["dense", "dense-remat", "v3"])
def test_b_and_w_equal_the_whole_backward_and_compute_each_matmul_once(name, overrides, w_dots):
  """b returns the input's cotangent (and the weight gradients an unsplit equation computes anyway), W the
  other weight gradients from b's stash and the weights: the whole vjp's, to float32 rounding (the same
  operations, fused otherwise by XLA). The dot products of b and
  W add up to the whole backward's (none recomputed), W's are the weight gradients of the layer's matmuls, and
  the stash holds activations (leading with the layers), never a copy of the weights."""
  mesh, backward, args, n = chunk_backward(name, *overrides)
  with jax.set_mesh(mesh):
    closed = jax.make_jaxpr(backward)(*args)
    split = wsplit.split(closed, [True] + [False] * n, w_args=tuple(range(1, 1 + n)))
    b_out, stash = jax.jit(split.b)(*args)
    w_out = jax.jit(split.w)(stash, *args[1:1 + n])
    whole = jax.jit(backward)(*args)
    assert split.b_outputs[0] == 0 and sorted(split.b_outputs + split.w_outputs) == list(range(1 + n))
    got = {**dict(zip(split.b_outputs, b_out)), **dict(zip(split.w_outputs, w_out))}
    for i, want in enumerate(whole):
      np.testing.assert_allclose(np.asarray(got[i]), np.asarray(want), rtol=1e-5, atol=1e-6)
    total, b_dots = count_dots(backward, *args), count_dots(split.b, *args)
    assert count_dots(split.w, stash, *args[1:1 + n]) == w_dots == total - b_dots
  layers = args[1].shape[0]
  weights = {a.shape[1:] for a in args[1:1 + n]}
  for a in jax.tree.leaves(stash):
    per_layer = a.shape[1:]
    if a.ndim > 2 and a.shape[1] == 1:  # a residual of the experts' shard_map: one block per device
      per_layer = a.shape[2:]
    assert a.shape[0] == layers and per_layer not in weights, a.shape


@pytest.mark.parametrize("name, arrays, left", [("tiny-dense", 15, 0), ("tiny-v3", 39, 1)], ids=["dense", "v3"])
def test_the_stash_holds_each_value_once(name, arrays, left):
  """The forward reshapes a layer's normed input once per projection (q, k and v; gate and up), each reshape an
  output of the forward's loop of its own: the stash keeps one of equal values and W reads the others as it, so
  no two of the stash's arrays are equal (random inputs: equal arrays are the same value). Dense: 15 arrays,
  not 18 (3 fewer slice reads in W and writes in b, a chunk each); V3: 39, not 44, one pair equal (6 pairs and
  more before): a forward residual the backward's loop computes again from other values, which value numbering
  does not see."""
  mesh, backward, args, n = chunk_backward(name)
  with jax.set_mesh(mesh):
    split = wsplit.split(jax.make_jaxpr(backward)(*args), [True] + [False] * n, w_args=tuple(range(1, 1 + n)))
    _, stash = jax.jit(split.b)(*args)
    w_out = jax.jit(split.w)(stash, *args[1:1 + n])
    whole = jax.jit(backward)(*args)
  leaves = [np.asarray(a) for a in jax.tree.leaves(stash)]
  equal = [(i, j) for i in range(len(leaves)) for j in range(i) if leaves[i].shape == leaves[j].shape
           and np.array_equal(leaves[i], leaves[j])]
  assert len(equal) == left and len(leaves) == arrays, (equal, [a.shape for a in leaves])
  for i, got in zip(split.w_outputs, w_out):
    np.testing.assert_allclose(np.asarray(got), np.asarray(whole[i]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_shard_map_splits_into_a_b_and_a_w_shard_map(check_vma):
  """A backward through a shard_map (two matmuls, the second's output summed over "y", as a tensor-parallel MLP
  runs): b's shard_map gives the input's cotangent, W's the two weight gradients from the per-device stash,
  equal to the whole vjp's, with and without JAX's varying-axes types (tokamax's kernels run without)."""
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def body(x, w1, w2):
    return jax.lax.psum(jnp.tanh(x @ w1) @ w2, "y")

  def backward(x, w1, w2, g):
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(None, "y"), P("y", None)), out_specs=P("x"),
                      check_vma=check_vma)
    _, pull = jax.vjp(f, x, w1, w2)
    return list(pull(g))

  keys = jax.random.split(jax.random.key(2), 4)
  args = [jax.random.normal(k, s) for k, s in zip(keys, [(8, 6), (6, 4), (4, 6), (8, 6)])]
  with jax.set_mesh(mesh):
    closed = jax.make_jaxpr(backward)(*args)
    split = wsplit.split(closed, [True, False, False], w_args=(1, 2))
    assert split.b_outputs == [0] and split.w_outputs == [1, 2]
    b_out, stash = jax.jit(split.b)(*args)
    w_out = jax.jit(split.w)(stash, *args[1:3])
    whole = jax.jit(backward)(*args)
    for got, want in zip(b_out + w_out, whole):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # the forward's output product, which nothing reads, runs in neither
    assert count_dots(split.w, stash, *args[1:3]) == 2 and count_dots(split.b, *args) == count_dots(
        backward, *args) - 2 - 1


def test_split_schedules_are_refused_where_jax_changed_what_the_split_reads(monkeypatch):
  """The split checks at import what it reads from JAX: nothing is missing on the tested JAX; a JAX whose
  JaxprEqn lost `ctx` is found out, and then zb_h1, zbv and dualpipev are refused before anything runs, in one
  line naming the JAX that works, while 1f1b still runs."""
  assert wsplit.MISSING == ()

  class Eqn:
    __slots__ = ("invars", "outvars", "primitive", "params", "source_info")

  core = types.SimpleNamespace(JaxprEqn=Eqn, **{n: getattr(jcore, n) for n in ("Literal", "Jaxpr", "ClosedJaxpr",
                                                                                 "Primitive")})
  assert wsplit.missing(core=core) == ("JaxprEqn.ctx",)
  monkeypatch.setattr(wsplit, "MISSING", wsplit.missing(core=core))
  layers = ("mesh.pipeline=4", "mesh.data=2", "model.num_hidden_layers=8")
  for schedule in ("zb_h1", "zbv", "dualpipev"):
    cfg = load_config("tiny-dense", *layers, f"train.pipeline_schedule={schedule}",
                      f"train.pipeline_repeats={1 if schedule == 'zb_h1' else 2}")
    with pytest.raises(UserError) as refused:
      step_lib.check_setup(cfg, make_mesh(cfg))
    assert str(refused.value) == (
        f"config key train.pipeline_schedule: {schedule} needs the backward split, which reads JAX internals that "
        f"jax {jax.__version__} changed (JaxprEqn.ctx); install jax==0.10.2 (make install pins it) or use 1f1b")
  cfg = load_config("tiny-dense", *layers, "train.pipeline_schedule=1f1b")
  step_lib.check_setup(cfg, make_mesh(cfg))
