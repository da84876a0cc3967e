"""Input: prepared token shards (or synthetic / python-stdlib) → per-process Grain pipeline → packed rows →
global jax.Array batches. Modules load on first use, so data preparation never imports JAX."""

import importlib

__all__ = ["GlobalBatches", "global_batches", "make_dataset"]


def __getattr__(name: str):
  if name in __all__:
    return getattr(importlib.import_module("jaxseek.input.batches"), name)
  if name in ("batches", "holdout", "prepare", "shards", "sources", "state", "tokenize"):
    return importlib.import_module(f"jaxseek.input.{name}")
  raise AttributeError(f"module 'jaxseek.input' has no attribute {name!r}")
