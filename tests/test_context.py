"""Context parallelism over the `context` axis (queries split on length) against the single-device run, and
the MLA latent as what crosses the axis."""

import re

import jax
import numpy as np
import pytest

from conftest import load_config
from jaxseek import step as step_lib
from jaxseek.config import MESH_AXES
from jaxseek.input import global_batches
from jaxseek.sharding import explore_compile
from jaxseek.sharding.mesh import make_mesh
from test_pipeline import run

PACKED = ("data.source=python-stdlib", "data.max_bytes=200000", "train.seq_len=64")


@pytest.mark.parametrize("name, context, extra", [
    ("tiny-v3", 2, ()), ("tiny-v3", 8, ()), ("tiny-dense", 4, ()),  # tiny-dense: grouped-query attention
    ("tiny-v3", 4, PACKED),  # packed documents: segment ids split over the axis too
], ids=["v3-c2", "v3-c8", "dense-c4", "v3-c4-packed"])
def test_context_parallel_training_equals_single_device(name, context, extra):
  """Losses and gradient norms over 5 steps (MoE bias ranges and loads too) equal one device's."""
  single = run(name, ("mesh.data=1", *extra), jax.devices()[:1])
  got = run(name, (f"mesh.context={context}", f"mesh.data={8 // context}", *extra))
  np.testing.assert_allclose(got, single, rtol=1e-5)


def test_mla_gathers_the_latent_not_the_heads():
  """With queries split over context, the forward's context all-gathers carry the compressed key/value latent
  [.., T, C] and the shared rope key [.., T, 1, R]: C + R numbers per token, not N heads × (H + R + P)."""
  cfg = load_config("tiny-v3", "mesh.context=4", "mesh.data=2", "train.seq_len=64")
  mesh = make_mesh(cfg)
  trainer = step_lib.make_trainer(cfg, mesh)
  with jax.set_mesh(mesh):
    text = step_lib.compile_step(trainer, cfg, mesh).lower(trainer.abstract_state,
                                                          next(global_batches(cfg, mesh))).compile().as_text()
  sizes = tuple(mesh.shape[a] for a in MESH_AXES)
  shapes = {tuple(int(d) for d in m.group(1).split(",")) for line in text.splitlines()
            if (m := re.search(r"= f32\[([\d,]+)\]\S* all-gather(?:-start)?\(", line))
            and explore_compile.collective_axes(line, sizes) == ("context",)}
  m = cfg.model
  assert shapes == {(8, 64, m.kv_lora_rank), (8, 64, 1, m.qk_rope_head_dim)}, shapes
