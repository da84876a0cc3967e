"""The optimiser: AdamW (optax) with warm-up schedules, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxseek.config import OptimConfig


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  """Linear warm-up to `lr`, then cosine decay to `lr·min_lr_ratio` (cosine), or constant and a final linear
  decay over `decay_steps` (wsd: warm-up, stable, decay), or constant."""
  warmup = min(cfg.warmup_steps, total_steps)
  low = cfg.lr * cfg.min_lr_ratio
  # Step s < warmup uses lr·(s+1)/warmup: the first step already moves the parameters.
  ramp = optax.linear_schedule(cfg.lr / max(warmup, 1), cfg.lr, max(warmup - 1, 1))
  if cfg.schedule == "constant":
    after = optax.constant_schedule(cfg.lr)
  elif cfg.schedule == "cosine":
    span = cfg.decay_steps or max(total_steps - warmup, 1)
    after = optax.cosine_decay_schedule(cfg.lr, span, alpha=cfg.min_lr_ratio)
  else:
    decay = min(cfg.decay_steps, max(total_steps - warmup, 0))
    stable = max(total_steps - warmup - decay, 0)
    after = optax.join_schedules(
        [optax.constant_schedule(cfg.lr), optax.linear_schedule(cfg.lr, low, max(decay, 1))], [stable])
  return optax.join_schedules([ramp, after], [warmup])


def decay_mask(params: nnx.State, cfg: OptimConfig):
  """True where weight decay applies: matrices, not norm scales or biases (one non-layer axis), and not the
  embedding table unless `decay_embeddings`."""

  def decays(path, var) -> bool:
    names = [n for n in var.get_metadata()["logical_axes"] if n != "layers"]
    is_embedding = any(getattr(k, "key", None) == "table_VD" for k in path)
    return len(names) >= 2 and (cfg.decay_embeddings or not is_embedding)

  return jax.tree_util.tree_map_with_path(decays, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def stored_as(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
  """`inner` with its floating-point state kept in `dtype` between steps and updated in float32 (DeepSeek-V3
  keeps AdamW's moments in bfloat16: half the optimiser memory, the arithmetic unchanged)."""
  if dtype == jnp.float32:
    return inner

  def cast(tree, to):
    return jax.tree.map(lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

  def update(updates, state, params=None):
    updates, state = inner.update(updates, cast(state, jnp.float32), params)
    return updates, cast(state, dtype)

  return optax.GradientTransformation(lambda params: cast(inner.init(params), dtype), update)


def make(cfg: OptimConfig, total_steps: int, abstract_params: nnx.State) -> optax.GradientTransformation:
  """clip_by_global_norm (unless clip_norm is 0) → AdamW(schedule, decay mask), its moments stored in
  `moments_dtype`. `abstract_params` supplies the mask's structure."""
  mask = decay_mask(abstract_params, cfg)
  clip = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
  adamw = optax.adamw(schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                      mask=mask)
  return optax.chain(*clip, stored_as(adamw, jnp.dtype(cfg.moments_dtype)))


def applied_lr(cfg: OptimConfig, total_steps: int, opt_state) -> jax.Array:
  """The rate the optimiser's update from `opt_state` uses: the schedule at the optimiser's own step count, which
  a skipped step does not advance (TrainState.step does)."""
  (_, count), *_ = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
  return schedule(cfg, total_steps)(count)
