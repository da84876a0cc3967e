"""The train state and the static parts of training, below both the objective and the step that use them."""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import optax
from flax import nnx


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: nnx.State  # trained by the optimiser
  biases: nnx.State  # MoE correction biases: updated from expert loads, never by the optimiser
  opt_state: Any
  loss_window: jax.Array  # the last train.spike_window accepted losses (NaN until filled), for spike skipping
  loss_scale: jax.Array  # float16 compute: the dynamic loss scale (1 otherwise)
  good_steps: jax.Array  # float16 compute: steps since the scale last changed without an overflow
  overflow_budget: jax.Array  # float16 compute: overflows left before the scale halves (train.loss_scale_hysteresis)
  grad_residual: Any  # train.grad_compression: each data shard's error-feedback residual [data, ...] (else {})
  grad_basis: Any = flax.struct.field(default_factory=dict)  # powersgd: each matrix's basis Q, warm start (else {})


@flax.struct.dataclass
class Trainer:
  """The static parts of training: the model's graph, the optimiser, the shardings of state and batch."""

  graphdef: Any = flax.struct.field(pytree_node=False)
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
  state_shardings: Any = flax.struct.field(pytree_node=False)
  abstract_state: Any = flax.struct.field(pytree_node=False)
  init: Callable[[], TrainState] = flax.struct.field(pytree_node=False)  # jitted, returns the sharded state
