"""Rematerialisation policies for one decoder layer (`train.remat`).

What a layer keeps for its backward, from most memory to least:

  none       everything its forward computed (no remat)
  save_dots  the outputs of matmuls without batch dimensions (every projection; attention scores and the
             softmax are recomputed): XLA's `dots_with_no_batch_dims_saveable`
  minimal    its input and the named tensors below that are costly to recompute (the attention output and the
             MLA latents); the MLP / MoE and the projections are recomputed
  offload    as minimal plus the MLP / MoE input, but those tensors go to host memory (`pinned_host`) and come back
             for the backward; needs a backend with host memory spaces (GPU, TPU)
  full       only its input; the whole layer is recomputed during the backward

Names (`jax.ad_checkpoint.checkpoint_name`) set in the model: "attn_context" (attention output before the
output projection), "q_latent" and "kv_latent" (MLA's compressed query and key/value), "mlp_input" (the
normalised MLP / MoE input).
"""

from __future__ import annotations

from typing import Callable

import jax

POLICIES = ("none", "save_dots", "minimal", "offload", "full")
MINIMAL = ("attn_context", "q_latent", "kv_latent")
OFFLOADED = MINIMAL + ("mlp_input",)


def policy(name: str):
  cp = jax.checkpoint_policies
  if name == "save_dots":
    return cp.dots_with_no_batch_dims_saveable
  if name == "minimal":
    return cp.save_only_these_names(*MINIMAL)
  if name == "offload":
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(OFFLOADED), offload_src="device",
        offload_dst="pinned_host")
  return cp.nothing_saveable


def wrap(body: Callable, name: str) -> Callable:
  """`body` under the named policy (unchanged for "none")."""
  return body if name == "none" else jax.checkpoint(body, policy=policy(name))


def check_backend(name: str, platform: str) -> str | None:
  """Why `name` cannot run on `platform`, or None."""
  if name == "offload" and platform == "cpu":
    return ("config key train.remat: offload moves saved activations to host memory, which the cpu backend does "
            "not have; use minimal or full on cpu")
  return None
