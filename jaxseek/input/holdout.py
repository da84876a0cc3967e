"""The held-out share of a corpus (eval.source=holdout): each document is in it or not by a hash of its index.

Document d of a source (its index over the prepared folder's shards in order, or the sorted file order of
python-stdlib) is held out when splitmix64(d + SALT) / 2^64 < eval.holdout. The choice depends on nothing else
(not the seed, the sequence length, the mesh or the process count), so it is the same in every run over the
same data; training never reads a held-out document, evaluation reads only those.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxseek.errors import UserError
from jaxseek.input.sources import Documents

SALT = 0x6A61787365656B31  # fixed: changing it would move documents between the two parts of existing runs


def held_out(num_documents: int, fraction: float) -> np.ndarray:
  """bool [num_documents]: which documents the held-out share holds."""
  x = np.arange(num_documents, dtype=np.uint64) + np.uint64(SALT)
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  x = x ^ (x >> np.uint64(31))
  return (x >> np.uint64(11)).astype(np.float64) / 2.0**53 < fraction


def split(docs: Documents, fraction: float, part: str) -> Documents:
  """The documents of `part` ("train": those not held out, "eval": the held-out ones)."""
  out = held_out(docs.num_documents, fraction)
  keep = out if part == "eval" else ~out
  if part == "eval" and not keep.any():
    raise UserError(f"config key eval.holdout: {fraction} holds out none of the {docs.num_documents} documents of "
                    f"{docs.name}; raise it or use a prepared folder for eval.source")
  return dataclasses.replace(docs, keep=keep, fingerprint=f"{docs.fingerprint}:holdout-{fraction!r}-{part}")
