"""The prepared-data folder: per shard a uint32 token file and an int64 document index, plus manifest.json.

  manifest.json         format, tokenizer, vocab_size, eos_id, document and token counts, per-shard sha256
  shard-00000.tokens    the shard's documents back to back, little-endian uint32 token ids
  shard-00000.index     little-endian int64 offsets, documents + 1 of them: document d = tokens[o[d]:o[d + 1]]
  shard-00000.mask      (chat data only) uint8 per token: 1 where the token is a training target (an assistant
                        token), 0 where it is only context (system and user turns, the template's markup)

Readers memory-map both files: opening a folder costs only the checksums, and any document is one slice.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from jaxseek.errors import UserError
from jaxseek.input.sources import Documents

FORMAT = "jaxseek-tokens-1"
MANIFEST = "manifest.json"
TOKEN_DTYPE = np.dtype("<u4")
OFFSET_DTYPE = np.dtype("<i8")
MASK_DTYPE = np.dtype("u1")


class ShardWriter:
  """Appends documents to one shard's token and index files (and, with `mask`, its loss-mask file), hashing the
  bytes as it writes them."""

  def __init__(self, folder: Path, shard: int, mask: bool = False):
    self.folder = folder
    self.names = {"tokens": f"shard-{shard:05d}.tokens", "index": f"shard-{shard:05d}.index"}
    if mask:
      self.names["mask"] = f"shard-{shard:05d}.mask"
    self.files = {k: open(folder / n, "wb") for k, n in self.names.items()}
    self.hashes = {k: hashlib.sha256() for k in self.names}
    self.documents = self.num_tokens = 0
    self._write("index", np.zeros(1, OFFSET_DTYPE))

  def _write(self, kind: str, array: np.ndarray) -> None:
    data = array.tobytes()
    self.files[kind].write(data)
    self.hashes[kind].update(data)

  def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
    """Appends documents given back to back in `tokens`, with `lengths` (and per token `mask`)."""
    if ("mask" in self.names) != (mask is not None):
      raise ValueError("a shard holds a mask for every document or for none")
    self._write("tokens", tokens.astype(TOKEN_DTYPE, copy=False))
    if mask is not None:
      self._write("mask", mask.astype(MASK_DTYPE, copy=False))
    self._write("index", (self.num_tokens + np.cumsum(lengths, dtype=np.int64)).astype(OFFSET_DTYPE, copy=False))
    self.documents += len(lengths)
    self.num_tokens += int(np.sum(lengths))

  def close(self) -> dict:
    """Closes the files; returns the shard's manifest entry."""
    for f in self.files.values():
      f.close()
    entry = {"tokens_file": self.names["tokens"], "index_file": self.names["index"], "documents": self.documents,
             "tokens": self.num_tokens, "sha256": {k: h.hexdigest() for k, h in self.hashes.items()}}
    if "mask" in self.names:
      entry["mask_file"] = self.names["mask"]
    return entry


def write_manifest(folder: Path, manifest: dict) -> None:
  """Writes manifest.json last and atomically: a folder without it is never read as data."""
  tmp = folder / (MANIFEST + ".tmp")
  tmp.write_text(json.dumps(manifest, indent=2) + "\n")
  tmp.replace(folder / MANIFEST)


def read_manifest(folder: Path, key: str = "data.source") -> dict:
  """The manifest of a prepared folder, checked; `key` names the setting that points at it in a refusal."""
  if not folder.is_dir():
    other = {"eval.source": ", or use holdout", "data.source": ", or use synthetic or python-stdlib"}.get(key, "")
    raise UserError(f"{key} folder {folder} not found; write it with scripts/prepare_data.py --out {folder} or "
                    f"fix the path{other}")
  path = folder / MANIFEST
  if not path.is_file():
    raise UserError(f"{path} not found: {folder} is not (completely) prepared; run scripts/prepare_data.py "
                    f"--out {folder} again")
  try:
    manifest = json.loads(path.read_text())
  except ValueError:
    raise UserError(f"{path} is not valid JSON; run scripts/prepare_data.py --out {folder} again") from None
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    raise UserError(f"{path} is not a {FORMAT} manifest; prepare {folder} with this jaxseek's "
                    f"scripts/prepare_data.py")
  return manifest


def open_folder(folder: str | Path, vocab_size: int, verify: bool = True, key: str = "data.source") -> Documents:
  """Memory-maps a prepared folder after checking its vocabulary against the model's and its shards."""
  folder = Path(folder)
  manifest = read_manifest(folder, key)
  if manifest["vocab_size"] > vocab_size:
    raise UserError(f"{folder / MANIFEST}: the data was tokenised with a {manifest['vocab_size']}-token vocabulary "
                    f"but model.vocab_size={vocab_size}; raise model.vocab_size or prepare the data with the "
                    f"model's tokenizer")
  tokens, offsets, masks = [], [], []
  for shard in manifest["shards"]:
    tokens.append(_map(folder, shard["tokens_file"], TOKEN_DTYPE, shard["tokens"], shard["sha256"]["tokens"], verify))
    offsets.append(_map(folder, shard["index_file"], OFFSET_DTYPE, shard["documents"] + 1, shard["sha256"]["index"],
                        verify))
    if offsets[-1][0] != 0 or offsets[-1][-1] != shard["tokens"] or np.any(np.diff(offsets[-1]) < 0):
      raise _corrupt(folder / shard["index_file"], "holds offsets that do not match its shard")
    if "mask_file" in shard:
      masks.append(_map(folder, shard["mask_file"], MASK_DTYPE, shard["tokens"], shard["sha256"]["mask"], verify))
  if masks and len(masks) != len(tokens):
    raise _corrupt(folder / MANIFEST, "lists a loss mask for some shards only")
  fingerprint = hashlib.sha256(json.dumps([s["sha256"] for s in manifest["shards"]]).encode()).hexdigest()
  return Documents(str(folder), tuple(tokens), tuple(offsets), manifest["vocab_size"], manifest.get("eos_id"),
                   fingerprint, masks=tuple(masks) if masks else None)


def _map(folder: Path, name: str, dtype: np.dtype, count: int, sha256: str, verify: bool) -> np.ndarray:
  path = folder / name
  if not path.is_file():
    raise UserError(f"shard file {path} is missing; restore it or prepare {folder} again with "
                    f"scripts/prepare_data.py")
  if path.stat().st_size != count * dtype.itemsize:
    raise _corrupt(path, f"has {path.stat().st_size} bytes, manifest.json says {count * dtype.itemsize}")
  if verify and file_sha256(path) != sha256:
    raise _corrupt(path, "does not match its sha256 in manifest.json")
  if count == 0:
    return np.zeros(0, dtype)
  return np.memmap(path, dtype=dtype, mode="r")


def _corrupt(path: Path, what: str) -> UserError:
  return UserError(f"shard file {path} {what} (corrupt or changed); prepare {path.parent} again with "
                   f"scripts/prepare_data.py")


def file_sha256(path: Path, block: int = 1 << 23) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(block):
      digest.update(chunk)
  return digest.hexdigest()
