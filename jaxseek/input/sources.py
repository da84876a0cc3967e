"""Token sources: `synthetic` (seeded random tokens) and `python-stdlib` (this Python's own sources, bytes)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from jaxseek.errors import UserError


class SyntheticSource:
  """Record i is `length` tokens drawn uniformly from [0, vocab) with seed (seed, i): reproducible anywhere."""

  def __init__(self, vocab: int, length: int, seed: int, size: int = 1 << 30):
    self.vocab, self.length, self.seed, self.size = vocab, length, seed, size

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, i: int) -> np.ndarray:
    rng = np.random.default_rng((self.seed, int(i)))
    return rng.integers(0, self.vocab, self.length, dtype=np.int32)


class WindowSource:
  """Consecutive windows of `length` tokens (stride length − 1, so each target follows its input) of a 1-D array."""

  def __init__(self, tokens: np.ndarray, length: int):
    if tokens.size < length:
      raise UserError(f"the corpus holds {tokens.size} tokens, fewer than one sequence of {length}; "
                      f"lower train.seq_len or add data")
    self.tokens, self.length = tokens, length
    self.count = (tokens.size - 1) // (length - 1)

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, i: int) -> np.ndarray:
    start = int(i) * (self.length - 1)
    return self.tokens[start:start + self.length].astype(np.int32)


def python_stdlib_bytes(max_bytes: int) -> np.ndarray:
  """The `.py` files of this Python's standard library, sorted by path, concatenated as bytes (a real corpus
  that exists wherever jaxseek runs)."""
  root = Path(sysconfig.get_paths()["stdlib"])
  chunks, total = [], 0
  for path in sorted(root.rglob("*.py")):
    if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
      continue
    try:
      data = path.read_bytes()
    except OSError:
      continue
    chunks.append(data + b"\n\n")
    total += len(data) + 2
    if total >= max_bytes:
      break
  if not chunks:
    raise UserError(f"no Python sources found under {root}; use data.source=synthetic")
  return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
