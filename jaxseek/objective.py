"""The objective of a microbatch and its gradient over the whole batch: accumulated over microbatches by a scan,
or through a pipeline table schedule (1F1B, interleaved 1F1B, DualPipeV) with the whole model run per
microbatch inside it.

objective = CE + λ/depth · Σ_k CE_k (multi-token prediction) + aux_loss_alpha · Σ_layers balance loss, each CE a
sum over the microbatch divided by the whole batch's token count, so the microbatches' gradients add up to the
full batch's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxseek import config as config_lib
from jaxseek.model import loss as loss_lib
from jaxseek.model import remat as remat_lib
from jaxseek.model.transformer import STACKS
from jaxseek.pipeline import executor, tables
from jaxseek.pipeline import stages as pipeline_lib
from jaxseek.sharding import rules
from jaxseek.sharding.rules import shard
from jaxseek.state import Trainer, TrainState


def token_count(mask: jax.Array) -> jax.Array:
  return jnp.maximum(mask.sum(), 1.0)


@dataclasses.dataclass(frozen=True)
class LossNorms:
  """What turns one microbatch's sums into its share of the objective: the whole batch's token counts (main and
  per MTP depth), the balance divisor (microbatches × data shards: the balance terms are means over a
  microbatch's rows) and the loss scale."""

  tokens: jax.Array
  mtp_tokens: list
  balance_divisor: int
  loss_scale: jax.Array


def loss_norms(cfg: config_lib.Config, state: TrainState, batch: dict[str, jax.Array], n_micro: int,
               groups: int = 1) -> LossNorms:
  """The norms of the whole `batch`, whose gradient `groups` device groups compute on their own rows and sum
  (sharding/gradsum.py; with compressed gradient sums, one group per data shard)."""
  depth = cfg.model.num_nextn_predict_layers
  if jax.tree.leaves(state.grad_residual):
    groups = jax.tree.leaves(state.grad_residual)[0].shape[0]
  return LossNorms(token_count(batch["loss_mask"]), [token_count(batch[f"mtp_mask_{k}"]) for k in range(1, depth + 1)],
                   n_micro * groups, state.loss_scale)


def loss_terms(cfg: config_lib.Config, model: nnx.Module, h_BTD: jax.Array | None, aux: dict, mb: dict,
               norms: LossNorms):
  """(objective · loss scale, (ce_sum, mtp_sums, balance, loads)) of a microbatch from the final hidden state
  (None: the part of the model before it, with no loss of its own) and the aux entries of the layers it ran."""
  depth = cfg.model.num_nextn_predict_layers
  alpha, mtp_weight = cfg.model.aux_loss_alpha, cfg.train.mtp_loss_weight
  balance = sum(aux[name].mean(-1).sum() for name in ("balance", "mtp_balance") if name in aux)
  loads = {name: aux[name] for name in ("load", "mtp_load", "dropped", "extra") if name in aux}
  value = alpha * balance / norms.balance_divisor  # balance: a mean over rows
  ce_sum, mtp_sums = jnp.zeros((), jnp.float32), jnp.zeros((depth if h_BTD is not None else 0,), jnp.float32)
  if h_BTD is not None:
    head_DV = model.head()
    ce = lambda h, targets, mask: loss_lib.cross_entropy_sum(h, head_DV, targets, mask, cfg.train.loss_impl)
    ce_sum = ce(h_BTD, mb["targets"], mb["loss_mask"])
    if depth:
      mtp_sums = jnp.stack([ce(aux["mtp_hidden"][k - 1], mb[f"mtp_targets_{k}"], mb[f"mtp_mask_{k}"])
                            for k in range(1, depth + 1)])
      value += mtp_weight / depth * sum(mtp_sums[k] / norms.mtp_tokens[k] for k in range(depth))
    value += ce_sum / norms.tokens
  return value * norms.loss_scale, (ce_sum, mtp_sums, jnp.asarray(balance, jnp.float32), loads)


def mtp_arrays(cfg: config_lib.Config, mb: dict[str, jax.Array]) -> tuple[list, list]:
  """What the multi-token-prediction depths read: their input tokens and where they have a target."""
  depth = cfg.model.num_nextn_predict_layers
  return [mb[f"mtp_inputs_{k}"] for k in range(1, depth + 1)], [mb[f"mtp_valid_{k}"] for k in range(1, depth + 1)]


def objective_fn(trainer: Trainer, cfg: config_lib.Config, state: TrainState, batch: dict[str, jax.Array],
                 n_micro: int, groups: int = 1) -> Callable:
  """(params, microbatch) → (objective · loss scale, (ce_sum, mtp_sums, balance, loads)); the token counts that
  normalise the losses are the whole batch's (`groups`: see loss_norms)."""
  norms = loss_norms(cfg, state, batch, n_micro, groups)

  def objective(params, mb):
    model = nnx.merge(trainer.graphdef, params, state.biases)
    h_BTD, aux = model.forward(mb["inputs"], mb.get("positions"), mb.get("segment_ids"), *mtp_arrays(cfg, mb),
                               logits=False)
    return loss_terms(cfg, model, h_BTD, aux, mb, norms)

  return objective


def pipelined_gradients(trainer: Trainer, cfg: config_lib.Config, state: TrainState, params,
                        batch: dict[str, jax.Array], norms: LossNorms):
  """(grads, ce_sum, mtp_sums, balance, loads) of `batch` with a table schedule (pipeline/tables.py: 1F1B,
  interleaved 1F1B, DualPipeV). All of the model runs per microbatch inside it: the embedding and the layers
  before the pipelined stack with its first virtual stage, the stack chunk by chunk, the layers after it, the
  head and the loss after its last virtual stage. `norms` are the whole batch's (`batch` may be one device
  group's rows: sharding/gradsum.py)."""
  S, M = pipeline_lib.stages(), cfg.train.microbatches
  name = pipeline_lib.pipelined_stack(cfg.model, S, cfg.train.pipeline_repeats)
  n_layers = pipeline_lib.stack_sizes(cfg.model)[name]
  table = tables.for_config(cfg, S, pipeline_lib.stack_repeats(n_layers, S, cfg.train.pipeline_repeats))
  model = nnx.merge(trainer.graphdef, params, state.biases)
  stack = getattr(model, name)
  setattr(model, name, None)  # the rest of the model: what runs outside the stack
  rest_graphdef, rest_params, rest_other = nnx.split(model, nnx.Param, ...)
  blocks_graphdef, stack_params, stack_consts = nnx.split(stack.blocks, nnx.Param, ...)
  before, after = STACKS[:STACKS.index(name)], STACKS[STACKS.index(name) + 1:]
  rest = lambda p: nnx.merge(rest_graphdef, p, rest_other)

  def first(p, mb):
    m = rest(p)
    x_bTD, positions_bT, valid_bT = m.begin(mb["inputs"], mb["positions"], mb["segment_ids"])
    x_bTD, aux = m.run_stacks(x_bTD, positions_bT, mb["segment_ids"], valid_bT, before)
    if aux:  # the stack before the larger one is the dense stack (STACKS order)
      raise NotImplementedError(f"layers with auxiliary outputs before the pipelined stack: {sorted(aux)}")
    return x_bTD

  def post(p, y_bTD, mb):
    m = rest(p)
    valid_bT = (mb["segment_ids"] > 0).astype(jnp.float32)
    y_bTD, aux = m.run_stacks(y_bTD, mb["positions"], mb["segment_ids"], valid_bT, after)
    h_bTD, aux = m.finish(y_bTD, aux, mb["inputs"], mb["positions"], mb["segment_ids"], valid_bT,
                          *mtp_arrays(cfg, mb), logits=False)
    return loss_terms(cfg, m, h_bTD, aux, mb, norms)

  body = remat_lib.wrap(lambda x, layer_p, layer_c, side: nnx.merge(blocks_graphdef, layer_p, layer_c)(x, *side),
                        cfg.train.remat)
  pair = tables.pairs(cfg)

  stage, layers = chunk_runner(cfg, body, n_layers, S, table.repeats)

  B, T = batch["inputs"].shape
  batch = dict(batch, positions=batch.get("positions", jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))))
  split = lambda tree: jax.tree.map(lambda a: pipeline_lib.split_microbatches(a, M), tree)
  valid = (batch["segment_ids"] > 0).astype(jnp.float32)
  side_M = split((batch["positions"], batch["segment_ids"], valid))
  alpha = cfg.model.aux_loss_alpha * state.loss_scale / (B * norms.balance_divisor // M)
  g_stack, g_rest, (ce_sum, mtp_sums, post_balance, post_loads), stage_aux = executor.run(
      table, executor.Parts(first, stage, post), stack_params, stack_consts,
      as_computed(rest_params, cfg.train.compute_dtype), split(batch), side_M, aux_cotangent={"balance": alpha},
      per_row=("balance",), unsplit=unsplit_leaves(rest_params), pair=pair, layers=layers)
  g_rest = jax.tree.map(lambda g, p: g.astype(p.dtype), g_rest, rest_params)
  grads = nnx.merge_state(g_rest, nnx.State({name: nnx.State({"blocks": g_stack})}))
  stage_aux = pipeline_lib.zero_padding_rows(stage_aux, stored=jax.tree.leaves(stack_params)[0].shape[0],
                                             num_layers=n_layers)
  balance = post_balance / M + (stage_aux["balance"].sum() / B if "balance" in stage_aux else 0.0)
  loads = {**post_loads, **{k: v for k, v in stage_aux.items() if k != "balance"}}
  return grads, ce_sum, mtp_sums, jnp.asarray(balance, jnp.float32), loads


def chunk_runner(cfg: config_lib.Config, body: Callable, n_layers: int, S: int, R: int):
  """(stage_fn, layers): one chunk of the pipelined stack as the executor runs it (`executor.Parts`), its layers
  scanned (unrolled in paired ticks, so two chunks interleave), and [S, R] how many of each chunk's layers run
  where chunks skip their identity padding (the last storage rows, all zeros: `stages.skips_padding`), else None.
  stage_fn(..., layers=k) runs the chunk's first k layers (k a Python int: the executor picks the program of the
  count its chunk holds) and gives the padding's aux rows as zeros."""
  chunk_size = pipeline_lib.stored_layers(n_layers, S, cfg.train.pipeline_repeats) // (S * R)
  real = pipeline_lib.chunk_layers(n_layers, S, cfg.train.pipeline_repeats)
  layers = real if pipeline_lib.skips_padding(cfg) and (real < chunk_size).any() else None

  def stage(x_bTD, chunk_p, chunk_c, side, unroll=False, layers=None):
    run = lambda n: jax.lax.scan(lambda x, layer: body(x, *layer, side), x_bTD,
                                 jax.tree.map(lambda a: a[:n], (chunk_p, chunk_c)), unroll=unroll)
    if layers is None or layers == chunk_size:
      return run(chunk_size)
    aux_shape = jax.eval_shape(lambda: run(chunk_size))[1]
    y_bTD, aux = run(layers) if layers else (x_bTD, None)
    pad = lambda f, a=None: jnp.concatenate(
        ([a] if a is not None else []) + [jnp.zeros((chunk_size - layers, *f.shape[1:]), f.dtype)])
    return y_bTD, jax.tree.map(pad, aux_shape, *([aux] if aux is not None else []))

  return stage, layers

def unsplit_leaves(params) -> tuple[bool, ...]:
  """For each leaf of an nnx State, whether its placement splits it over no mesh axis but `pipeline` and those
  an enclosing shard_map handles by hand: a stage holds it (or its block) whole, so its gradient can be laid
  into a flat buffer without moving data (restgrads.RestGrads)."""
  mesh = jax.sharding.get_abstract_mesh()
  skip = {"pipeline", *mesh.manual_axes}
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))

  def unsplit(v):
    entries = rules.param_spec(v.get_metadata()["logical_axes"], v.shape, mesh)
    axes = [a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e)]
    return all(sizes[a] == 1 for a in axes if a not in skip)

  return tuple(jax.tree.leaves(jax.tree.map(unsplit, params, is_leaf=rules.is_variable)))


def as_computed(params, dtype: str):
  """The weights the model casts to the compute dtype where it uses them (every matrix but the router's), cast
  once here: the schedule gathers them over the stages in that dtype (half the bytes and the gathered copy's
  memory for bfloat16). The gradients are the same: the cast's cotangent is the compute-dtype cotangent."""
  def cast(path, p):
    keys = [str(getattr(k, "key", k)) for k in path]
    matrix = p.ndim - (keys[0] in STACKS) >= 2  # a layer stack's leaves lead with its layers
    return p.astype(dtype) if matrix and "router" not in "/".join(keys) and jnp.issubdtype(p.dtype, jnp.floating) \
        else p

  return jax.tree_util.tree_map_with_path(cast, params)


def sum_over_microbatches(fn: Callable, batch: dict[str, jax.Array], n_micro: int):
  """fn(microbatch) (a tree of sums) summed over `n_micro` microbatches of `batch` by a scan: one microbatch's
  activations live at a time."""
  if n_micro == 1:
    return fn(batch)

  def accumulate(carry, mb):
    mb = {k: shard(v, ("batch", None)) for k, v in mb.items()}
    return jax.tree.map(jnp.add, carry, fn(mb)), None

  first = jax.tree.map(lambda v: v[:v.shape[0] // n_micro], batch)
  init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, first))
  microbatches = jax.tree.map(lambda v: pipeline_lib.split_microbatches(v, n_micro), batch)
  return jax.lax.scan(accumulate, init, microbatches)[0]


def accumulated_gradients(grad_fn: Callable, params, batch: dict[str, jax.Array], n_micro: int):
  """(grads, ce_sum, mtp_sums, balance, loads) of `batch`, summed over `n_micro` microbatches (the balance term
  averaged)."""
  def one(mb):
    (_, aux), grads = grad_fn(params, mb)
    return (grads, *aux)

  grads, ce_sum, mtp_sums, balance, loads = sum_over_microbatches(one, batch, n_micro)
  return grads, ce_sum, mtp_sums, balance / n_micro, loads
