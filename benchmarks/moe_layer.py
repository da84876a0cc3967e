"""Forward + backward time of one MoE layer against a dense SwiGLU with the same active parameters.

python benchmarks/moe_layer.py [--tokens 4096] [--hidden 256] [--expert-hidden 128] [--experts 16] [--top-k 4]

On the default device (one), after warm-up, --reps runs (taking turns) of value_and_grad with respect to the
input and every parameter, for:
  moe          jaxseek.model.moe.MoE (router, sort by expert, grouped matmul, shared expert)
  moe-ragged   the same routing and sort with `lax.ragged_dot` as the grouped matmul
  dense        a SwiGLU MLP of hidden size K·M + n_shared·M (the MoE's active parameters per token)
  per-expert   the same routing, each expert applied to every token and masked by its gate weight
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxseek.config import ModelConfig
from jaxseek.kernels import grouped
from jaxseek.model import moe as moe_lib
from jaxseek.model.layers import MLP


def moe_config(args: argparse.Namespace) -> ModelConfig:
  """A DeepSeek-V3-style router (sigmoid, noaux_tc over 4 groups) at the benchmark's sizes."""
  return ModelConfig(hidden_size=args.hidden, n_routed_experts=args.experts, moe_intermediate_size=args.expert_hidden,
                     num_experts_per_tok=args.top_k, n_shared_experts=1, scoring_func="sigmoid",
                     topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)


def routed_by_ragged_dot(layer: moe_lib.MoE, x_BTD: jax.Array) -> jax.Array:
  """The MoE layer with `lax.ragged_dot` as the grouped matmul (XLA:CPU lowers it to a dense product per group)."""
  B, T, D = x_BTD.shape
  x_XD = x_BTD.reshape(B * T, D)
  idx_XK, weights_XK, _ = moe_lib.route(x_XD @ layer.w_router_DE[...], layer.bias_E[...], layer.routing)
  K, E = idx_XK.shape[1], layer.w_gate_EDM.shape[0]
  order = jnp.argsort(idx_XK.reshape(-1), stable=True)
  sizes_E = jnp.bincount(idx_XK.reshape(-1), length=E).astype(jnp.int32)
  y_sorted = grouped.ffn_ragged(x_XD[order // K], sizes_E, layer.w_gate_EDM[...], layer.w_up_EDM[...],
                                layer.w_down_EMD[...]) * weights_XK.reshape(-1)[order][:, None]
  y_XD = jnp.zeros_like(x_XD).at[order // K].add(y_sorted)
  return y_XD.reshape(B, T, D) + layer.shared(x_BTD)


def per_expert_loop(layer: moe_lib.MoE, x_BTD: jax.Array) -> jax.Array:
  """The MoE layer written naively: every expert over every token, masked by that expert's gate weight."""
  B, T, D = x_BTD.shape
  x_XD = x_BTD.reshape(B * T, D)
  idx_XK, weights_XK, _ = moe_lib.route(x_XD @ layer.w_router_DE[...], layer.bias_E[...], layer.routing)
  y_XD = jnp.zeros_like(x_XD)
  for e in range(layer.w_gate_EDM.shape[0]):
    gate_X = (weights_XK * (idx_XK == e)).sum(-1)
    h_XM = jax.nn.silu(x_XD @ layer.w_gate_EDM[e]) * (x_XD @ layer.w_up_EDM[e])
    y_XD = y_XD + gate_X[:, None] * (h_XM @ layer.w_down_EMD[e])
  return y_XD.reshape(B, T, D) + layer.shared(x_BTD)


def compiled_step(module: nnx.Module, apply, x_BTD: jax.Array):
  """A jitted, warmed-up forward + backward (gradients for the input and every parameter) with its arguments."""
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  cotangent_BTD = jax.random.normal(jax.random.key(1), x_BTD.shape, x_BTD.dtype)

  def loss(params, x_BTD):
    return (apply(nnx.merge(graphdef, params, rest), x_BTD) * cotangent_BTD).sum()

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  for _ in range(2):
    jax.block_until_ready(step(params, x_BTD))
  return lambda: jax.block_until_ready(step(params, x_BTD))


def interleaved_times(steps: dict, reps: int) -> dict[str, list[float]]:
  """Seconds per run of each step, the steps taking turns so that a busy machine slows them alike."""
  times: dict[str, list[float]] = {name: [] for name in steps}
  for _ in range(reps):
    for name, step in steps.items():
      start = time.perf_counter()
      step()
      times[name].append(time.perf_counter() - start)
  return times


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--hidden", type=int, default=256, help="D")
  parser.add_argument("--expert-hidden", type=int, default=128, help="M")
  parser.add_argument("--experts", type=int, default=16, help="E")
  parser.add_argument("--top-k", type=int, default=4, help="K")
  parser.add_argument("--reps", type=int, default=10)
  args = parser.parse_args()
  cfg = moe_config(args)
  layer = moe_lib.MoE(cfg, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(0))
  dense_hidden = (args.top_k + cfg.n_shared_experts) * args.expert_hidden
  dense = MLP(args.hidden, dense_hidden, 0.02, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(0))
  x_BTD = jnp.asarray(np.random.default_rng(0).normal(size=(1, args.tokens, args.hidden)), jnp.float32)
  valid_BT = jnp.ones(x_BTD.shape[:2], jnp.float32)
  print(f"{jax.devices()[0].platform}, {args.tokens} tokens, D={args.hidden} M={args.expert_hidden} "
        f"E={args.experts} K={args.top_k} + 1 shared expert; dense hidden {dense_hidden}; {args.reps} runs each")
  y_BTD = layer(x_BTD, valid_BT)[0]
  gap = max(float(jnp.abs(jax.jit(f)(layer, x_BTD) - y_BTD).max()) for f in (routed_by_ragged_dot, per_expert_loop))
  print(f"the three MoE forms agree: largest difference {gap:.1e} (outputs of size {float(jnp.abs(y_BTD).max()):.1e})")
  steps = {
      "dense": compiled_step(dense, lambda m, x: m(x), x_BTD),
      "moe": compiled_step(layer, lambda m, x: m(x, valid_BT)[0], x_BTD),
      "moe-ragged": compiled_step(layer, routed_by_ragged_dot, x_BTD),
      "per-expert": compiled_step(layer, per_expert_loop, x_BTD),
  }
  times = interleaved_times(steps, args.reps)
  base = statistics.median(times["dense"])
  print(f"{'':>11}  {'median':>9}  {'min':>9}  median / dense")
  for name, runs in times.items():
    print(f"{name:>11}  {statistics.median(runs) * 1e3:6.1f} ms  {min(runs) * 1e3:6.1f} ms  "
          f"{statistics.median(runs) / base:5.2f}×")


if __name__ == "__main__":
  main()
