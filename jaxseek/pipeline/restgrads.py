"""Where a pipeline stage accumulates the gradients of the weights outside the pipelined stack (pipeline/executor.py
runs them): the first virtual stage's part and the last one's, each on the stage that runs it."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def used_leaves(fn: Callable, params, *args) -> tuple[bool, ...]:
  """For each leaf of `params`, whether fn(params, *args) reads it (traced once, abstractly)."""
  leaves, treedef = jax.tree.flatten(params)
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), (leaves, args))
  jaxpr = jax.make_jaxpr(lambda ls, rest: fn(jax.tree.unflatten(treedef, ls), *rest))(*abstract).jaxpr
  read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
  return tuple(id(v) in read for v in jaxpr.invars[:len(leaves)])


class RestGrads:
  """Where a stage accumulates the float32 gradients of the weights outside the pipelined stack (the rest).

  The first virtual stage's part (the embedding, the layers before the stack) runs on one stage and the last
  virtual stage's part (the layers after it, the head, MTP) on another, except in the V of DualPipeV, where
  both run on stage 0. Every stage holds the same buffers (one program), so the accumulator of the leaves only
  one part reads is one flat float32 buffer as long as the larger part: the first part's stage accumulates its
  leaves there and the last part's stage its own (at offsets of their own). Leaves both parts read (the
  embedding, which MTP reads too) keep a whole accumulator, as do leaves an automatic mesh axis splits (tensor,
  fsdp: laying them into the flat buffer would move data); leaves neither reads get none. With both parts on
  one stage every leaf keeps a whole accumulator."""

  def __init__(self, table, rest_params, first_used: tuple[bool, ...], post_used: tuple[bool, ...],
               unsplit: tuple[bool, ...] | None = None):
    leaves, self.treedef = jax.tree.flatten(rest_params)
    unsplit = (True,) * len(leaves) if unsplit is None else unsplit
    self.shapes = [(a.shape, a.dtype) for a in leaves]
    V = table.stages * table.repeats
    self.first_stage = int(np.argwhere(table.virtual == 0)[0][0])
    self.post_stage = int(np.argwhere(table.virtual == V - 1)[0][0])
    self.first_used = [i for i, u in enumerate(first_used) if u]
    self.post_used = [i for i, u in enumerate(post_used) if u]
    split = self.first_stage != self.post_stage
    self.whole = [i for i in range(len(leaves)) if (first_used[i] or post_used[i]) and
                  ((first_used[i] and post_used[i]) or not split or not unsplit[i])]
    self.offset: dict[tuple[str, int], int] = {}  # (part, leaf) → offset in the flat buffer
    self.size = 0
    for part, used in (("first", first_used), ("post", post_used)):
      at = 0
      for i, u in enumerate(used):
        if u and i not in self.whole:
          self.offset[part, i] = at
          at += int(np.prod(self.shapes[i][0]))
      self.size = max(self.size, at)

  def init(self):
    return ([jnp.zeros(self.shapes[i][0], jnp.float32) for i in self.whole], jnp.zeros((self.size,), jnp.float32))

  def add(self, acc, part: str, grads: list[jax.Array]):
    """acc plus the gradients of the leaves `part` ("first" or "post") reads, in the order of `used(part)`."""
    whole, flat = acc
    whole = list(whole)
    for i, g in zip(self.used(part), grads):
      if i in self.whole:
        k = self.whole.index(i)
        whole[k] = whole[k] + g.astype(jnp.float32)
      else:
        at, n = self.offset[part, i], g.size
        flat = jax.lax.dynamic_update_slice(flat, jax.lax.dynamic_slice(flat, (at,), (n,)) +
                                            g.reshape(-1).astype(jnp.float32), (at,))
    return whole, flat

  def used(self, part: str) -> list[int]:
    return self.first_used if part == "first" else self.post_used

  def tree(self, acc, stage):
    """The gradient tree on `stage` (zeros where it ran neither part), float32."""
    whole, flat = acc
    out = []
    for i, (shape, _) in enumerate(self.shapes):
      g = jnp.zeros(shape, jnp.float32)
      if i in self.whole:
        g = whole[self.whole.index(i)]
      for part, on in (("first", self.first_stage), ("post", self.post_stage)):
        if (part, i) in self.offset:
          at = self.offset[part, i]
          g = jnp.where(stage == on, flat[at:at + int(np.prod(shape))].reshape(shape), g)
      out.append(g)
    return jax.tree.unflatten(self.treedef, out)

  def with_leaves(self, rest_params, part: str, values: list[jax.Array]):
    """`rest_params` with the leaves `part` reads replaced by `values` (the ones differentiated)."""
    leaves = list(jax.tree.leaves(rest_params))
    for i, v in zip(self.used(part), values):
      leaves[i] = v
    return jax.tree.unflatten(self.treedef, leaves)

  def read(self, rest_params, part: str) -> list[jax.Array]:
    leaves = jax.tree.leaves(rest_params)
    return [leaves[i] for i in self.used(part)]
