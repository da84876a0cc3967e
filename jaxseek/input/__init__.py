"""Input: Grain sources → per-process shard → shuffle → batch → global jax.Array batches on the mesh."""

from jaxseek.input.pipeline import global_batches, make_dataset

__all__ = ["global_batches", "make_dataset"]
