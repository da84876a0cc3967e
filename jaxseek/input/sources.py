"""Token sources: `synthetic` (seeded random tokens), documents (prepared folders, or this Python's own sources
byte-level) and their split into training chunks of at most `seq_len` (input, target) pairs."""

from __future__ import annotations

import dataclasses
import hashlib
import sysconfig
from pathlib import Path

import numpy as np

from jaxseek.errors import UserError

BYTE_EOS = 0  # byte-level data ends each document with a NUL byte (NULs inside the text are dropped)


class SyntheticSource:
  """Record i is `length` tokens drawn uniformly from [0, vocab) with seed (seed, i): reproducible anywhere."""

  def __init__(self, vocab: int, length: int, seed: int, size: int = 1 << 30):
    self.vocab, self.length, self.seed, self.size = vocab, length, seed, size

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, i: int) -> np.ndarray:
    rng = np.random.default_rng((self.seed, int(i)))
    return rng.integers(0, self.vocab, self.length, dtype=np.int32)


@dataclasses.dataclass(frozen=True)
class Documents:
  """Documents in shards: document d of shard s is tokens[s][offsets[s][d]:offsets[s][d + 1]] (the arrays are
  memory-mapped files or in memory). `fingerprint` identifies the data in saved iterator states."""

  name: str
  tokens: tuple[np.ndarray, ...]
  offsets: tuple[np.ndarray, ...]
  vocab_size: int
  eos_id: int | None
  fingerprint: str
  keep: np.ndarray | None = None  # bool per document (over all shards): only these are read (input/holdout.py)
  masks: tuple[np.ndarray, ...] | None = None  # per shard, uint8 per token: 1 = a training target (chat data)

  @property
  def num_documents(self) -> int:
    return sum(len(o) - 1 for o in self.offsets)


class DocumentChunks:
  """Grain source: record i is one chunk, an [n, 3] int32 array of consecutive (input, target, weight) triples
  of one document, 1 ≤ n ≤ seq_len; weight is 1 where the loss counts the target (always, unless the documents
  carry a loss mask: then the target token's mask). A document of m tokens has m − 1 pairs, split into
  ⌈(m − 1) / seq_len⌉ chunks, so no pair ever crosses two documents."""

  def __init__(self, docs: Documents, seq_len: int):
    self.docs, self.seq_len = docs, seq_len
    pairs = np.concatenate([np.maximum(np.diff(np.asarray(o)) - 1, 0) for o in docs.offsets])
    if docs.keep is not None:  # a document left out has no chunks
      pairs = np.where(docs.keep, pairs, 0)
    self.chunk_end = np.cumsum(-(-pairs // seq_len))  # chunks of documents [0, d], over all shards
    self.doc_base = np.cumsum([0] + [len(o) - 1 for o in docs.offsets])  # first document of each shard
    if len(self) == 0:
      raise UserError(f"data.source {docs.name} holds no document of 2 or more tokens; prepare it from real text")

  def __len__(self) -> int:
    return int(self.chunk_end[-1]) if self.chunk_end.size else 0

  def __getstate__(self) -> dict:
    """Grain worker processes receive memory-mapped shards as file names, not as copies of the data."""
    portable = lambda a: (a.filename, a.dtype.str) if isinstance(a, np.memmap) else a
    docs = dataclasses.replace(self.docs, tokens=tuple(map(portable, self.docs.tokens)),
                               offsets=tuple(map(portable, self.docs.offsets)),
                               masks=self.docs.masks and tuple(map(portable, self.docs.masks)))
    return {**self.__dict__, "docs": docs}

  def __setstate__(self, state: dict) -> None:
    mapped = lambda a: np.memmap(a[0], dtype=np.dtype(a[1]), mode="r") if isinstance(a, tuple) else a
    docs = state["docs"]
    state["docs"] = dataclasses.replace(docs, tokens=tuple(map(mapped, docs.tokens)),
                                        offsets=tuple(map(mapped, docs.offsets)),
                                        masks=docs.masks and tuple(map(mapped, docs.masks)))
    self.__dict__.update(state)

  def __getitem__(self, i: int) -> np.ndarray:
    i = int(i) % len(self)
    d = int(np.searchsorted(self.chunk_end, i, side="right"))
    c = i - (int(self.chunk_end[d - 1]) if d else 0)
    s = int(np.searchsorted(self.doc_base, d, side="right")) - 1
    offsets = self.docs.offsets[s]
    begin, end = int(offsets[d - self.doc_base[s]]), int(offsets[d - self.doc_base[s] + 1])
    start = begin + c * self.seq_len
    stop = min(start + self.seq_len + 1, end)
    tokens = np.asarray(self.docs.tokens[s][start:stop], dtype=np.int32)
    if self.docs.masks is None:
      weight = np.ones(len(tokens) - 1, np.int32)
    else:
      weight = np.asarray(self.docs.masks[s][start + 1:stop], dtype=np.int32)
    return np.stack([tokens[:-1], tokens[1:], weight], axis=1)


def byte_documents(texts: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
  """UTF-8 documents → (tokens uint32, offsets int64): bytes with NULs removed, each followed by BYTE_EOS."""
  docs = [t.replace(b"\0", b"") for t in texts]
  tokens = np.frombuffer(b"\0".join(docs) + b"\0", dtype=np.uint8).astype(np.uint32)
  offsets = np.zeros(len(docs) + 1, np.int64)
  np.cumsum([len(d) + 1 for d in docs], out=offsets[1:])
  return tokens, offsets


def python_stdlib_documents(max_bytes: int) -> Documents:
  """The `.py` files of this Python's standard library, sorted by path, one document per file, byte-level,
  up to about `max_bytes` (a real corpus that exists wherever jaxseek runs; it differs between Python builds)."""
  root = Path(sysconfig.get_paths()["stdlib"])
  return _source_documents(root, max_bytes, "python-stdlib", f"no Python sources found under {root}; use "
                                                            f"data.source=synthetic")


PACKAGE_PREFIX = "python-package:"


def python_package_documents(name: str, max_bytes: int) -> Documents:
  """The `.py` files of the installed package `name` (`data.source=python-package:NAME`), as
  `python_stdlib_documents` reads the standard library's: the same bytes wherever the same version is installed
  (constraints.txt pins every dependency's), so curves on it compare across machines. The fingerprint names the
  version and the bytes' sha256."""
  import importlib.metadata
  import importlib.util

  try:
    spec = importlib.util.find_spec(name)
  except (ImportError, ValueError):
    spec = None
  roots = list(spec.submodule_search_locations or []) if spec is not None else []
  if not roots:
    raise UserError(f"data.source={PACKAGE_PREFIX}{name}: no installed package named {name!r}; name one that is "
                    f"installed, e.g. {PACKAGE_PREFIX}jax")
  try:
    version = importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    version = "unknown"
  return _source_documents(Path(roots[0]), max_bytes, f"{PACKAGE_PREFIX}{name}=={version}",
                           f"data.source={PACKAGE_PREFIX}{name}: {roots[0]} holds no .py files; name another package")


def _source_documents(root: Path, max_bytes: int, name: str, missing: str) -> Documents:
  """Every `.py` file under `root` but tests, sorted by path, one document each, up to about `max_bytes`."""
  texts, total = [], 0
  for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
    if {"site-packages", "test", "tests"} & set(path.relative_to(root).parts):
      continue
    try:
      data = path.read_bytes()
    except OSError:
      continue
    texts.append(data[:max_bytes - total])
    total += len(texts[-1])
    if total >= max_bytes:
      break
  if not texts:
    raise UserError(missing)
  tokens, offsets = byte_documents(texts)
  fingerprint = hashlib.sha256(tokens.astype(np.uint8).tobytes()).hexdigest()
  return Documents(name, (tokens,), (offsets,), 256, BYTE_EOS, f"{name}:{fingerprint}")
