"""The Grain pipeline and the assembly of global batches on the mesh."""

from __future__ import annotations

from typing import Iterator

import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxseek.config import Config
from jaxseek.errors import UserError
from jaxseek.input.sources import SyntheticSource, WindowSource, python_stdlib_bytes
from jaxseek.sharding.rules import activation_spec

BATCH_NAMES = {"inputs": ("batch", None), "targets": ("batch", None), "loss_mask": ("batch", None)}


def _source(cfg: Config):
  length = cfg.train.seq_len + 1
  if cfg.data.source == "synthetic":
    return SyntheticSource(cfg.model.vocab_size, length, cfg.data.seed)
  if cfg.data.source == "python-stdlib":
    if cfg.model.vocab_size < 256:
      raise UserError(f"data.source=python-stdlib is byte-level and needs model.vocab_size ≥ 256, "
                      f"got {cfg.model.vocab_size}")
    return WindowSource(python_stdlib_bytes(cfg.data.max_bytes), length)
  raise UserError(f"config key data.source: {cfg.data.source!r} is not available; use synthetic or python-stdlib")


def _to_example(tokens_BT1: np.ndarray) -> dict[str, np.ndarray]:
  return {"inputs": tokens_BT1[:, :-1], "targets": tokens_BT1[:, 1:],
          "loss_mask": np.ones(tokens_BT1[:, 1:].shape, np.float32)}


def make_dataset(cfg: Config, process_index: int = 0, process_count: int = 1) -> grain.IterDataset:
  """This process's share of the data: records [process_index::process_count], shuffled, batched."""
  if cfg.train.batch_size % process_count:
    raise UserError(f"train.batch_size={cfg.train.batch_size} must be divisible by the {process_count} processes")
  ds = grain.MapDataset.source(_source(cfg))
  if cfg.data.source != "synthetic":
    ds = ds.shuffle(seed=cfg.data.seed).repeat()
  ds = ds[process_index::process_count]
  ds = ds.batch(cfg.train.batch_size // process_count, drop_remainder=True).map(_to_example)
  return ds.to_iter_dataset()


def batch_shardings(mesh: Mesh) -> dict[str, NamedSharding]:
  return {k: NamedSharding(mesh, activation_spec(names)) for k, names in BATCH_NAMES.items()}


def global_batches(cfg: Config, mesh: Mesh) -> Iterator[dict[str, jax.Array]]:
  """Yields global batches: each process contributes its local rows; arrays come out sharded on the batch axes."""
  shardings = batch_shardings(mesh)
  for local in make_dataset(cfg, jax.process_index(), jax.process_count()):
    yield {k: jax.make_array_from_process_local_data(shardings[k], v) for k, v in local.items()}
