"""The train step: the train state and its shardings, initialisation already sharded, and one jitted step
(gradients, optionally accumulated, compressed over data, or loss-scaled; the optimiser; MoE bias updates).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxseek import config as config_lib
from jaxseek import input as input_lib
from jaxseek import model as model_lib
from jaxseek import objective
from jaxseek import optim
from jaxseek.errors import UserError
from jaxseek.kernels import choice, fp8_gemm, gpu
from jaxseek.model import loss as loss_lib
from jaxseek.model import remat as remat_lib
from jaxseek.model.transformer import shift_left, target_exists
from jaxseek.pipeline import stages as pipeline_lib
from jaxseek.sharding import compression, experts
from jaxseek.sharding import mesh as mesh_lib
from jaxseek.sharding import gradsum
from jaxseek.sharding import rules
from jaxseek.sharding.rules import param_spec, shard, state_rules
from jaxseek.state import Trainer, TrainState


def state_shardings(abstract_state: Any, mesh: Mesh, zero: int = 3, optimizer_memory: str = "device") -> Any:
  """Each Variable (parameters and the optimiser moments that mirror them) is sharded by its logical axes under
  the rules of its part of the state (`rules.state_rules`: ZeRO-3 or ZeRO-1); everything else (step, counters)
  is replicated."""
  replicated = NamedSharding(mesh, PartitionSpec())

  def part(tree, kind):
    kind_rules = state_rules(kind, zero)
    return jax.tree.map(
        lambda x: NamedSharding(mesh, param_spec(x.get_metadata()["logical_axes"], x.shape, mesh, kind_rules))
        if rules.is_variable(x) else replicated, tree, is_leaf=rules.is_variable)

  out = jax.tree.map(lambda _: replicated, abstract_state, is_leaf=rules.is_variable)
  out = out.replace(**{kind: part(getattr(abstract_state, kind), kind) for kind in ("params", "biases", "opt_state")})
  if optimizer_memory == "host":  # brought to the device for the update, written back after (train_step)
    out = out.replace(opt_state=jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), out.opt_state))
  residual = jax.tree.map(  # one residual per data shard, each placed as its parameter
      lambda x: NamedSharding(mesh, PartitionSpec(compression.AXIS, *param_spec(
          x.get_metadata()["logical_axes"], x.shape[1:], mesh, state_rules("params", zero)))),
      abstract_state.grad_residual, is_leaf=rules.is_variable)
  basis = {}
  if jax.tree.leaves(abstract_state.grad_basis):
    param_specs = jax.tree.map(lambda s: s.spec, out.params)
    rank = jax.tree.leaves(abstract_state.grad_basis)[0].shape[-1]
    basis = jax.tree.map(lambda s: NamedSharding(mesh, s),
                         compression.basis_specs(abstract_state.params, param_specs, rank),
                         is_leaf=lambda x: isinstance(x, PartitionSpec))
  return out.replace(grad_residual=residual, grad_basis=basis)


def compressed(cfg: config_lib.Config, mesh: Mesh) -> bool:
  """Whether the data-axis gradient sum runs compressed (sharding/compression.py)."""
  return cfg.train.grad_compression != "none" and mesh.shape["data"] > 1


def compression_bytes(cfg: config_lib.Config, trainer: Trainer, mesh: Mesh, method: str | None = None) -> float:
  """Bytes one device sends per step for the data-axis gradient sum under `method` (default: the configured
  train.grad_compression), counted from the parameters' shapes and placement (compression.step_bytes)."""
  variables = jax.tree.leaves(trainer.abstract_state.params, is_leaf=rules.is_variable)
  placed = jax.tree.leaves(trainer.state_shardings.params)
  leaves = [(tuple(x.shape), tuple(x.get_metadata()["logical_axes"]), math.prod(s.shard_shape(tuple(x.shape))))
            for x, s in zip(variables, placed)]
  return compression.step_bytes(leaves, mesh.shape["data"], method or cfg.train.grad_compression,
                                cfg.train.powersgd_rank)


def compression_summary(cfg: config_lib.Config, trainer: Trainer, mesh: Mesh) -> str | None:
  """One start-up line: what each train.grad_compression method sends per device per step over `data`, with a
  warning when the chosen one saves nothing; on one data shard only the warning that a chosen one compresses nothing."""
  n = mesh.shape["data"]
  if n <= 1:
    chosen = cfg.train.grad_compression
    return None if chosen == "none" else (
        f"warning: train.grad_compression={chosen} has nothing to compress with mesh.data=1: the gradient sum runs "
        f"uncompressed (only the sum over data shards is compressed)")
  got = {m: compression_bytes(cfg, trainer, mesh, m) for m in compression.METHODS}
  label = lambda m: f"powersgd (rank {cfg.train.powersgd_rank})" if m == "powersgd" else m
  line = (f"gradient sum over data={n}, MB sent per device per step: " +
          " | ".join(f"{label(m)} {b / 1e6:,.1f} ({b / got['none']:.2f}×)" if m != "none" else f"none {b / 1e6:,.1f}"
                     for m, b in got.items()) + f" (train.grad_compression={cfg.train.grad_compression})")
  chosen = cfg.train.grad_compression
  if chosen != "none" and got[chosen] >= got["none"]:
    line += (f"\nwarning: train.grad_compression={chosen} sends no fewer bytes than none on this model (its "
             f"gradients are too small to compress); set train.grad_compression=none")
  return line


def check_setup(cfg: config_lib.Config, mesh: Mesh, backend: bool = True) -> None:
  """Settings that depend on the mesh or the backend (`backend=False`: the mesh only, as the explorer plans for
  other hardware): refused with one line before anything is written."""
  pipeline_lib.check_stacks(cfg, mesh.shape["pipeline"])
  m = cfg.model
  shards = math.prod(mesh.shape[a] for a in experts.expert_axes(m))
  if m.is_moe and m.moe_max_expert_shards is not None and m.moe_max_expert_shards < shards and \
      m.num_experts_per_tok > m.moe_max_expert_shards * (m.n_routed_experts // shards):
    raise UserError(f"config key model.moe_max_expert_shards: {m.moe_max_expert_shards} of the {shards} expert "
                    f"shards ({m.n_routed_experts // shards} experts each) cannot hold model.num_experts_per_tok="
                    f"{m.num_experts_per_tok} experts per token; raise it")
  if cfg.train.grad_compression != "none" and mesh.shape["pipeline"] > 1:
    raise UserError("config key train.grad_compression: not supported together with mesh.pipeline > 1 yet; "
                    "set train.grad_compression=none or mesh.pipeline=1")
  if not backend:
    return
  platform = mesh.devices.flat[0].platform
  where, cc = choice.device_target(mesh.devices.flat[0])
  # kernels that cannot run on these devices are refused now, not while tracing
  kinds = {choice.attention_kind(m.attention_impl, cfg.train.seq_len, where, cfg.train.compute_dtype,
                                  capability=cc, head_dims=m.attention_head_dims)}
  if m.is_moe:
    kinds.add(choice.matmul_kind(m.moe_matmul, where, cfg.train.compute_dtype, capability=cc,
                                 dims=choice.expert_dims(cfg, mesh.shape["tensor"])))
    choice.dispatch_kind(m.moe_dispatch, where)  # ragged needs ragged-all-to-all (not on XLA:CPU)
  if kinds & (set(choice.GPU_ATTENTION) | set(choice.GPU_MATMUL)):
    gpu.tokamax_module()
  why = remat_lib.check_backend(cfg.train.remat, platform)
  if why:
    raise UserError(why)
  if cfg.train.optimizer_memory == "host" and platform == "cpu":
    raise UserError("config key train.optimizer_memory: host keeps the optimiser state in pinned host memory, "
                    "which the cpu backend does not have; use device on cpu")


def make_trainer(cfg: config_lib.Config, mesh: Mesh, backend_checks: bool = True) -> Trainer:
  """eval_shape → shardings → jit(init, out_shardings): nothing is allocated until `trainer.init()`, and then the
  full model never exists unsharded on one device."""

  check_setup(cfg, mesh, backend_checks)
  if mesh.devices.flat[0].platform == "cpu":
    mesh_lib.keep_host_memory()

  exchange = experts.Settings.from_config(cfg.model, experts.node_shards(mesh, cfg.mesh.devices_per_node,
                                                                            experts.expert_axes(cfg.model)))
  fp8 = fp8_gemm.resolve(cfg.train.fp8, *choice.device_target(mesh.devices.flat[0]))

  def create() -> nnx.Module:
    return model_lib.build(cfg.model, seed=cfg.train.seed, param_dtype=cfg.train.param_dtype,
                           dtype=cfg.train.compute_dtype, remat=cfg.train.remat, fp8=fp8,
                           run_stack=pipeline_lib.stack_runner(cfg), exchange=exchange)

  with jax.set_mesh(mesh), rules.layout(cfg):
    graphdef, abstract_params, _ = nnx.split(nnx.eval_shape(create), nnx.Param, ...)
  tx = optim.make(cfg.optim, cfg.train.steps, abstract_params)

  storage = pipeline_lib.layout(cfg, mesh.shape["pipeline"])
  stacks = pipeline_lib.stack_sizes(cfg.model)

  def init() -> TrainState:
    _, params, biases = nnx.split(create(), nnx.Param, ...)
    # the same model as on one device, its layers in the storage order the pipeline schedule reads
    params, biases = pipeline_lib.reorder((params, biases), stacks, (1, 1), storage)
    scale = cfg.train.loss_scale_init if cfg.train.compute_dtype == "float16" else 1.0
    residual = {} if not compressed(cfg, mesh) else jax.tree.map(
        lambda p: jnp.zeros((mesh.shape["data"], *p.shape), jnp.float32), params)
    basis = compression.init_basis(params, cfg.train.powersgd_rank, cfg.train.seed) \
        if compressed(cfg, mesh) and cfg.train.grad_compression == "powersgd" else {}
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, biases=biases, opt_state=tx.init(params),
                      loss_window=jnp.full((cfg.train.spike_window,), jnp.nan, jnp.float32),
                      loss_scale=jnp.asarray(scale, jnp.float32), good_steps=jnp.zeros((), jnp.int32),
                      overflow_budget=jnp.asarray(cfg.train.loss_scale_hysteresis, jnp.int32), grad_residual=residual,
                      grad_basis=basis)

  with jax.set_mesh(mesh), rules.layout(cfg):  # the rules of the layout the step is traced with
    abstract_state = jax.eval_shape(init)
    shardings = state_shardings(abstract_state, mesh, cfg.train.zero, cfg.train.optimizer_memory)
  jitted = jax.jit(init, out_shardings=shardings)

  def init_on_mesh() -> TrainState:
    with jax.set_mesh(mesh), rules.layout(cfg):
      return jitted()

  return Trainer(graphdef, tx, shardings, abstract_state, init_on_mesh)


def init_state(cfg: config_lib.Config, mesh: Mesh) -> tuple[Trainer, TrainState]:
  """The trainer and a freshly initialised, sharded train state."""
  trainer = make_trainer(cfg, mesh)
  return trainer, trainer.init()


def mtp_mask(batch: dict[str, jax.Array], k: int) -> jax.Array:
  """Where depth k's target t_{i+k+1} counts in the loss: the main target at i+k counts and i+k is in i's
  document."""
  return target_exists(batch["loss_mask"], batch.get("segment_ids"), k)


def mtp_valid(batch: dict[str, jax.Array], k: int) -> jax.Array:
  """Where depth k has a target at all (what its MoE block counts): i+k is a token of i's document, whether or not
  the loss trains on it (chat data's prompt tokens are routed and counted, as in the main stack)."""
  segment_ids = batch.get("segment_ids")
  valid = batch["loss_mask"] if segment_ids is None else (segment_ids > 0).astype(jnp.float32)
  return target_exists(valid, segment_ids, k)


def with_mtp_arrays(batch: dict[str, jax.Array], depth: int) -> dict[str, jax.Array]:
  """The batch with what multi-token prediction depth k reads at position i, taken in token order: the input
  t_{i+k} (`mtp_inputs_k`), the target t_{i+k+1} (`mtp_targets_k`), where the loss counts it (`mtp_mask_k`) and
  where it exists (`mtp_valid_k`)."""
  out = dict(batch)
  for k in range(1, depth + 1):
    out.update({f"mtp_inputs_{k}": shift_left(batch["inputs"], k), f"mtp_targets_{k}": shift_left(batch["targets"], k),
                f"mtp_mask_{k}": mtp_mask(batch, k), f"mtp_valid_{k}": mtp_valid(batch, k)})
  return out


def zigzag_order(length: int, shards: int) -> np.ndarray:
  """The storage order of a sequence split over `shards` context devices for balanced causal attention: the
  sequence cut into 2·shards chunks, device i holding chunks i and 2·shards − 1 − i (an early and a late one)."""
  chunks = np.arange(length).reshape(2 * shards, length // (2 * shards))
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def to_zigzag(batch: dict[str, jax.Array], shards: int) -> dict[str, jax.Array]:
  """Every [B, T] array of the batch in zigzag storage order (positions made explicit first: the model reads
  token positions from them, never from the storage index)."""
  B, T = batch["inputs"].shape
  batch = {"positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), **batch}
  order = zigzag_order(T, shards)
  return {k: shard(jnp.take(v, order, axis=1), ("batch", "length")) for k, v in batch.items()}


def train_step(trainer: Trainer, cfg: config_lib.Config, state: TrainState,
               batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimiser step over the global batch, accumulated over `train.microbatches`.

  objective = CE + λ/depth · Σ_k CE_k (multi-token prediction) + aux_loss_alpha · Σ_layers balance loss,
  each CE a sum over the whole batch divided by its token count, so accumulation gives the full-batch gradient.

  With float16 compute the objective is multiplied by the dynamic loss scale before differentiation and the
  gradients divided by it after; a step whose gradients overflow (the loss itself finite) is skipped and the
  scale halved (after `loss_scale_hysteresis` such steps, never below `loss_scale_min`); after
  `loss_scale_window` steps without overflow it doubles.
  """
  # With a pipeline the microbatches flow through the stages inside one forward pass instead.
  n_micro = 1 if pipeline_lib.stages() > 1 else cfg.train.microbatches
  batch = step_batch(cfg, batch)
  sizes = dict(jax.sharding.get_abstract_mesh().shape) if rules.has_mesh() else {}
  summed = gradsum.axes(cfg, sizes)  # batch axes whose gradient sum runs once, after the microbatches
  groups = gradsum.groups(sizes, summed)
  grad_fn = jax.value_and_grad(objective.objective_fn(trainer, cfg, state, batch, n_micro, groups), has_aux=True)
  gradients = lambda params, batch: objective.accumulated_gradients(grad_fn, params, batch, n_micro)
  if pipeline_lib.stages() > 1 and cfg.train.pipeline_schedule in pipeline_lib.ONE_F_ONE_B:
    norms = objective.loss_norms(cfg, state, batch, cfg.train.microbatches, groups)
    gradients = lambda params, batch: objective.pipelined_gradients(trainer, cfg, state, params, batch, norms)
  residual, basis = state.grad_residual, state.grad_basis
  if not jax.tree.leaves(residual):
    specs = jax.tree.map(lambda s: s.spec, trainer.state_shardings.params)
    grads, ce_sum, mtp_sums, balance, loads = gradsum.once_per_step(gradients, summed, specs)(state.params, batch)
    grads = jax.tree.map(lambda g: g / state.loss_scale, grads)
  else:  # unscaled per shard, before the residual is added
    grads, ce_sum, mtp_sums, balance, loads, residual, basis = _compressed_sum(gradients, trainer, cfg, state, batch)
  loss, grad_norm = ce_sum / objective.token_count(batch["loss_mask"]), optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  accept = finite & ~is_spike(loss, state.loss_window, cfg.train.spike_sigma)
  opt_before, params, opt_state, in_cond = _optimizer_step(trainer, cfg, state, grads, accept)
  new = state.replace(params=params, opt_state=opt_state,
                      biases=update_biases(state.biases, loads, cfg.optim.bias_update_rate), grad_residual=residual,
                      grad_basis=basis)
  dynamic = cfg.train.compute_dtype == "float16"
  overflow = dynamic & jnp.isfinite(loss) & ~jnp.isfinite(grad_norm)  # the scale's fault, not the model's
  metrics = {"loss": loss, "loss_tokens": batch["loss_mask"].sum(), "grad_norm": grad_norm,
             "lr": optim.applied_lr(cfg.optim, cfg.train.steps, opt_before),
             "nonfinite": (~finite & ~overflow).astype(jnp.int32), "skipped": (~accept).astype(jnp.int32),
             **_mtp_and_moe_metrics(cfg, batch, mtp_sums, loads, balance, new.biases)}
  if dynamic:
    new = new.replace(**dict(zip(("loss_scale", "good_steps", "overflow_budget"),
                                 _next_loss_scale(state, overflow, cfg.train))))
    metrics.update(loss_scale=state.loss_scale, overflow=overflow.astype(jnp.int32))
  return _accepted_or_kept(state, new, opt_before, accept, loss, in_cond), metrics


def _optimizer_step(trainer: Trainer, cfg: config_lib.Config, state: TrainState, grads, accept: jax.Array):
  """(optimiser state before, parameters and optimiser state after, whether they are the old ones unless the step
  is accepted). On CPU only an accepted step runs the update: XLA:CPU would select every parameter and moment apart
  from it, three more passes over the state (0.974 of the step time, docs/cpu.md); elsewhere the update fuses
  the selection (_accepted_or_kept)."""
  opt_before = state.opt_state
  if cfg.train.optimizer_memory == "host":
    opt_before = jax.device_put(opt_before, jax.tree.map(lambda s: s.with_memory_kind("device"),
                                                         trainer.state_shardings.opt_state))

  def update():
    updates, opt_state = trainer.tx.update(grads, opt_before, state.params)
    return optax.apply_updates(state.params, updates), opt_state

  if choice.platform() != "cpu":
    return opt_before, *update(), False
  return opt_before, *jax.lax.cond(accept, update, lambda: (state.params, opt_before)), True


def step_batch(cfg: config_lib.Config, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The batch as the step reads it: with the multi-token-prediction arrays, in zigzag order under
  model.context_attention=zigzag."""
  batch = with_mtp_arrays(batch, cfg.model.num_nextn_predict_layers)
  shards = zigzag_shards(cfg)
  return to_zigzag(batch, shards) if shards > 1 else batch


def zigzag_shards(cfg: config_lib.Config) -> int:
  """The context shards of the zigzag storage order the step uses (1: token order)."""
  context = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in rules.mesh_axes("length"))
  return context if cfg.model.context_attention == "zigzag" else 1


def token_ahead(cfg: config_lib.Config, x_BT: jax.Array, k: int) -> jax.Array:
  """x of token i+k at the position where `step_batch` stores token i (0 past the end), in token or zigzag order."""
  shards = zigzag_shards(cfg)
  if shards == 1:
    return shift_left(x_BT, k)
  order = zigzag_order(x_BT.shape[1], shards)
  return jnp.take(shift_left(jnp.take(x_BT, np.argsort(order), axis=1), k), order, axis=1)


def _mtp_and_moe_metrics(cfg: config_lib.Config, batch, mtp_sums, loads, balance, biases) -> dict[str, jax.Array]:
  depth = cfg.model.num_nextn_predict_layers
  metrics = {}
  if depth:
    metrics["mtp_loss"] = sum(mtp_sums[k - 1] / objective.token_count(batch[f"mtp_mask_{k}"])
                              for k in range(1, depth + 1)) / depth
  n_moe = cfg.model.num_moe_layers
  order = pipeline_lib.storage_order(n_moe, pipeline_lib.stages(), cfg.train.pipeline_repeats, pipeline_lib.shape(cfg))
  metrics.update(_moe_metrics(loads, balance, biases, np.argsort(order)[:n_moe]))  # padding rows dropped
  return metrics


def _accepted_or_kept(state: TrainState, new: TrainState, opt_before, accept: jax.Array,
                      loss: jax.Array, updated_if_accepted: bool = False) -> TrainState:
  """`new` where the step is accepted; a rejected step (non-finite, or a loss spike) leaves parameters, biases,
  optimiser state and gradient residual as they were (the loss scale still follows the overflow rule). The step
  counter moves on either way."""
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(accept, n, o), new, old)
  window = jnp.where(accept, jnp.roll(state.loss_window, -1).at[-1].set(loss), state.loss_window)
  kept = (lambda new, old: new) if updated_if_accepted else keep  # new.params are state.params unless accepted
  return new.replace(step=state.step + 1, params=kept(new.params, state.params),
                     biases=keep(new.biases, state.biases), opt_state=kept(new.opt_state, opt_before),
                     loss_window=window, grad_residual=keep(new.grad_residual, state.grad_residual),
                     grad_basis=keep(new.grad_basis, state.grad_basis))


def _compressed_sum(gradients: Callable, trainer: Trainer, cfg: config_lib.Config, state: TrainState,
                    batch: dict[str, jax.Array]):
  """`gradients` of each data shard's rows (a vmap over the shards), summed over `data` compressed with error
  feedback (sharding/compression.py). Returns gradients(...)'s values for the whole batch (the gradients divided
  by the loss scale), the new residual and the new PowerSGD basis.

  Each shard's gradient is divided by the float16 loss scale before its residual is added, so the residual is in
  the gradient's own units and means the same after the scale halves or doubles. A step whose gradients overflow
  gives a non-finite sum; such a step is not accepted and keeps the old residual (_accepted_or_kept)."""
  shards = jax.tree.leaves(state.grad_residual)[0].shape[0]
  split = jax.tree.map(lambda v: shard(v.reshape(shards, v.shape[0] // shards, *v.shape[1:]),
                                       ("data_shards", "batch")), batch)
  with rules.reserved(compression.AXIS):  # inside, "batch" no longer names the data axis: the vmap holds it
    grads_S, ce_sum, mtp_sums, balance, loads = jax.vmap(
        gradients, in_axes=(None, 0), spmd_axis_name=compression.AXIS)(state.params, split)
  grads_S = jax.tree.map(lambda g: g / state.loss_scale, grads_S)
  specs = jax.tree.map(lambda s: s.spec, trainer.state_shardings.grad_residual)
  views = compression.matrix_views(trainer.abstract_state.params, cfg.train.powersgd_rank)
  start = cfg.train.powersgd_start_step
  grads, kept = compression.reduce(grads_S, compression.State(state.grad_residual, state.grad_basis),
                                   cfg.train.grad_compression, specs, views=views,
                                   uncompressed=state.step < start if start else None)
  # sums over the shards; the balance term is a mean over rows, each shard's over 1/shards of them
  ce_sum, mtp_sums, loads = jax.tree.map(lambda a: a.sum(0), (ce_sum, mtp_sums, loads))
  return grads, ce_sum, mtp_sums, balance.mean(0), loads, kept.residual, kept.basis


def _next_loss_scale(state: TrainState, overflow: jax.Array, t: config_lib.TrainConfig):
  """float16 (DeepSpeed's and Megatron's rule): an overflow halves the scale, floored at `loss_scale_min`, once
  `loss_scale_hysteresis` overflows have used up the budget; `loss_scale_window` steps without one double it
  and refill the budget. Returns (scale, good_steps, overflow_budget)."""
  halve = overflow & (state.overflow_budget <= 1)
  grow = (state.good_steps + 1 >= t.loss_scale_window) & ~overflow
  scale = jnp.where(halve, jnp.maximum(state.loss_scale / 2, t.loss_scale_min),
                    jnp.where(grow, state.loss_scale * 2, state.loss_scale))
  budget = jnp.where(grow, t.loss_scale_hysteresis,
                     jnp.where(overflow & ~halve, state.overflow_budget - 1, state.overflow_budget))
  return scale, jnp.where(overflow | grow, 0, state.good_steps + 1), budget.astype(jnp.int32)


def is_spike(loss: jax.Array, window: jax.Array, sigma: float | None) -> jax.Array:
  """loss > mean + sigma · std of a full window of recent accepted losses (never while the window fills)."""
  if sigma is None:
    return jnp.zeros((), bool)
  full = ~jnp.isnan(window).any()
  return full & (loss > jnp.nanmean(window) + sigma * jnp.nanstd(window))


def _moe_metrics(loads: dict[str, jax.Array], balance: jax.Array, biases: nnx.State,
                 logical: np.ndarray) -> dict[str, jax.Array]:
  """Expert balance per step: load max/mean (mean, worst, per layer), dropped fraction, the share of copies sent
  in extra exchange rounds, balance loss, bias range.
  Per-layer values come in the MoE stack's storage order; `logical` indexes them into layer order (dropping the
  identity padding of a pipelined stack)."""
  metrics = {}
  if "load" in loads:
    load_LE, dropped_L = loads["load"][logical], loads["dropped"][logical]
    max_over_mean_L = load_LE.max(-1) / jnp.maximum(load_LE.mean(-1), 1e-9)
    metrics["balance_loss"] = balance
    metrics["moe_load_max_over_mean"] = max_over_mean_L.mean()
    metrics["moe_load_max_over_mean_worst"] = max_over_mean_L.max()
    metrics["moe_dropped_fraction"] = dropped_L.sum() / jnp.maximum(load_LE.sum(), 1.0)
    metrics["moe_extra_round_fraction"] = loads["extra"][logical].sum() / jnp.maximum(load_LE.sum(), 1.0)
    # one value per MoE layer (lists in metrics.jsonl)
    metrics["moe_load_max_over_mean_by_layer"] = max_over_mean_L
    metrics["moe_dropped_fraction_by_layer"] = dropped_L / jnp.maximum(load_LE.sum(-1), 1.0)
  if jax.tree.leaves(biases):
    ranges = [b.max(-1) - b.min(-1) for b in jax.tree.leaves(biases)]
    ranges = [r[logical] if r.ndim == 1 else r for r in ranges]
    metrics["moe_bias_range"] = jnp.stack([r.max() for r in ranges]).max()
    by_layer = [r for r in ranges if r.ndim == 1]  # the MoE stack's [layers] (MTP biases give scalars)
    if by_layer:
      metrics["moe_bias_range_by_layer"] = by_layer[0]
  return metrics


def update_biases(biases: nnx.State, loads: dict[str, jax.Array], rate: float) -> nnx.State:
  """Applies `update_bias` to every MoE correction bias with its own layer's global-batch loads."""

  def one(path, bias):
    if path[0].key == "mtp_layers":  # MTP blocks: loads per depth
      return update_bias(bias, loads["mtp_load"][path[1].key], rate)
    return update_bias(bias, loads["load"], rate)

  return jax.tree_util.tree_map_with_path(one, biases)


def update_bias(bias_LE: jax.Array, load_LE: jax.Array, rate: float) -> jax.Array:
  """Aux-loss-free balancing (V3 §2.1.2): b += rate · sign(mean load − load), loads over the global batch."""
  return bias_LE + rate * jnp.sign(load_LE.mean(-1, keepdims=True) - load_LE)


def compile_step(trainer: Trainer, cfg: config_lib.Config, mesh: Mesh) -> Callable:
  """The jitted step: state and batch in their shardings, state donated."""
  def step(state, batch):
    # the activation rules the step is traced with
    with rules.layout(cfg), pipeline_lib.batch_rules(cfg, dict(mesh.shape)):
      return train_step(trainer, cfg, state, batch)

  return jax.jit(step, in_shardings=(trainer.state_shardings, input_lib.batches.batch_shardings(mesh, cfg)),
                 out_shardings=(trainer.state_shardings, None), donate_argnums=0)


# ---------------------------------------------------------------------------------------------- evaluation


def eval_sums(model: nnx.Module, cfg: config_lib.Config, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The forward and loss of training on `batch`, without gradients: the summed cross entropy and its token
  count ("ce_sum", "tokens"), and per multi-token-prediction depth k where the model has it: "mtp_sums",
  "mtp_tokens", "mtp_correct" (the tokens whose top-1 MTP prediction is the target t_{i+k+1}) and "mtp_agree"
  (those whose top-1 MTP prediction is the main model's own top-1 prediction of t_{i+k+1}, made at position i+k:
  what speculative decoding with that depth as the draft accepts). Nothing is updated (no optimiser, no
  correction-bias step)."""
  depth = cfg.model.num_nextn_predict_layers
  batch = step_batch(cfg, batch)
  h_BTD, aux = model.forward(batch["inputs"], batch.get("positions"), batch.get("segment_ids"),
                             *objective.mtp_arrays(cfg, batch), logits=False)
  head_DV = model.head()
  ce = lambda h, targets, mask: loss_lib.cross_entropy_sum(h, head_DV, targets, mask, cfg.train.loss_impl)
  out = {"ce_sum": ce(h_BTD, batch["targets"], batch["loss_mask"]), "tokens": batch["loss_mask"].sum()}
  if depth:
    out["mtp_sums"] = jnp.stack([ce(aux["mtp_hidden"][k - 1], batch[f"mtp_targets_{k}"], batch[f"mtp_mask_{k}"])
                                 for k in range(1, depth + 1)])
    out["mtp_tokens"] = jnp.stack([batch[f"mtp_mask_{k}"].sum() for k in range(1, depth + 1)])
    greedy_BT = loss_lib.greedy_tokens(h_BTD, head_DV)
    draft = [loss_lib.greedy_tokens(aux["mtp_hidden"][k - 1], head_DV) for k in range(1, depth + 1)]
    hits = lambda k, want_BT: ((draft[k - 1] == want_BT) * batch[f"mtp_mask_{k}"]).sum()
    out["mtp_correct"] = jnp.stack([hits(k, batch[f"mtp_targets_{k}"]) for k in range(1, depth + 1)])
    out["mtp_agree"] = jnp.stack([hits(k, token_ahead(cfg, greedy_BT, k)) for k in range(1, depth + 1)])
  return out


def eval_sums_accumulated(model_fn: Callable[[], nnx.Module], cfg: config_lib.Config,
                          batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """`eval_sums` of `batch`, summed over `train.microbatches` by a scan as training accumulates (so evaluation
  holds no more activations than a training microbatch); `model_fn` merges the model inside the scan."""
  n_micro = 1 if pipeline_lib.stages() > 1 else cfg.train.microbatches
  return objective.sum_over_microbatches(lambda mb: eval_sums(model_fn(), cfg, mb), batch, n_micro)


def compile_eval(trainer: Trainer, cfg: config_lib.Config, mesh: Mesh) -> Callable:
  """(params, biases, batch) → eval_sums, jitted once with the train state's and the batch's shardings."""
  def evaluate(params, biases, batch):
    with rules.layout(cfg), pipeline_lib.batch_rules(cfg, dict(mesh.shape)):
      return eval_sums_accumulated(lambda: nnx.merge(trainer.graphdef, params, biases), cfg, batch)

  shardings = trainer.state_shardings
  return jax.jit(evaluate, in_shardings=(shardings.params, shardings.biases,
                                         input_lib.batches.batch_shardings(mesh, cfg)))
