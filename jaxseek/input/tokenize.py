"""Tokenizers for data preparation: byte-level (UTF-8 bytes 0..255, EOS = NUL) and Hugging Face tokenizer.json."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
from pathlib import Path

import numpy as np

from jaxseek.errors import UserError
from jaxseek.input import chat
from jaxseek.input.sources import BYTE_EOS, byte_documents

# End-of-document tokens tried, in order, when neither --eos nor tokenizer_config.json names one.
EOS_CANDIDATES = ("<｜end▁of▁sentence｜>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>")


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """What prepare_data needs to know of a tokenizer; picklable, so it travels to worker processes."""

  kind: str  # "byte" or "tokenizer.json"
  path: str | None
  vocab_size: int
  eos_id: int | None
  eos_token: str | None

  def manifest(self) -> dict:
    entry = {"type": self.kind, "eos_token": self.eos_token}
    if self.path:
      entry.update(file=self.path, sha256=hashlib.sha256(Path(self.path).read_bytes()).hexdigest())
    return entry


def resolve(name: str, eos: str | None = None) -> Tokenizer:
  """`byte`, or a tokenizer.json file (or a folder holding one); finds the end-of-document token."""
  if name == "byte":
    if eos is not None:
      raise UserError("--eos does not apply to --tokenizer byte, whose end-of-document token is the NUL byte (id 0)")
    return Tokenizer("byte", None, 256, BYTE_EOS, "\\x00")
  path = Path(name)
  if path.is_dir():
    path = path / "tokenizer.json"
  if not path.is_file():
    raise UserError(f"--tokenizer {name}: no such file; pass byte or the path of a tokenizer.json")
  tok = load_tokenizer(str(path.resolve()))
  eos = eos or _configured_eos(path) or next((t for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
  eos_id = None if eos is None else tok.token_to_id(eos)
  if eos is not None and eos_id is None:
    raise UserError(f"--eos {eos!r} is not a token of {path}; pass one of its special tokens")
  return Tokenizer("tokenizer.json", str(path.resolve()), tok.get_vocab_size(with_added_tokens=True), eos_id, eos)


def chat_variables(tokenizer: Tokenizer) -> dict[str, str]:
  """The special-token variables a chat template sees (byte-level: the EOS is the NUL byte)."""
  return chat.special_tokens(tokenizer.path, "\x00" if tokenizer.kind == "byte" else tokenizer.eos_token)


def encode_chat(tokenizer: Tokenizer, rendered: list[tuple[str, list[tuple[int, int]]]]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Rendered conversations (text, assistant character spans; chat.render) → (tokens, lengths, mask uint8 per
  token). The text is tokenised whole and without added special tokens (the template holds its own); mask 1 on
  the tokens that overlap an assistant span. A document the template did not end with the EOS gets one, trained
  when the token before it is."""
  ids, masks = [], []
  for text, spans in rendered:
    edges = np.zeros(len(text) + 1, np.int64)
    for start, end in spans:
      edges[start] += 1
      edges[end] -= 1
    char_mask = np.cumsum(edges)[:-1] > 0
    if tokenizer.kind == "byte":
      codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
      widths = 1 + (codes >= 0x80) + (codes >= 0x800) + (codes >= 0x10000)
      doc = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint32)
      mask = np.repeat(char_mask, widths)
    else:
      encoding = load_tokenizer(tokenizer.path).encode(text, add_special_tokens=False)
      doc = np.asarray(encoding.ids, np.uint32)
      covered = np.concatenate([[0], np.cumsum(char_mask)])  # assistant characters before each offset
      offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
      mask = covered[offsets[:, 1]] > covered[offsets[:, 0]]
    if tokenizer.eos_id is not None and (not doc.size or doc[-1] != tokenizer.eos_id):
      doc = np.append(doc, np.uint32(tokenizer.eos_id))
      mask = np.append(mask, mask[-1] if mask.size else False)
    ids.append(doc)
    masks.append(mask.astype(np.uint8))
  lengths = np.fromiter(map(len, ids), np.int64, len(ids))
  return (np.concatenate(ids or [np.zeros(0, np.uint32)]), lengths,
          np.concatenate(masks or [np.zeros(0, np.uint8)]))


def encode(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """Documents → (tokens uint32 back to back, lengths int64), each document ending with the EOS (if any)."""
  if tokenizer.kind == "byte":
    tokens, offsets = byte_documents([t.encode("utf-8") for t in texts])
    return tokens, np.diff(offsets)
  tok = load_tokenizer(tokenizer.path)
  encode_batch = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips character offsets: ~4× faster
  ids = [e.ids for e in encode_batch(texts, add_special_tokens=True)]
  if tokenizer.eos_id is not None:
    ids = [i + [tokenizer.eos_id] if not i or i[-1] != tokenizer.eos_id else i for i in ids]
  lengths = np.fromiter((len(i) for i in ids), np.int64, len(ids))
  tokens = np.fromiter(itertools.chain.from_iterable(ids), np.uint32, int(lengths.sum()))
  return tokens, lengths


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
  import tokenizers  # only tokenizer.json preparation needs it

  try:
    return tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # the library raises plain Exceptions for malformed files
    raise UserError(f"--tokenizer {path} cannot be read as a tokenizer.json ({str(e).splitlines()[0]}); "
                    f"pass a Hugging Face tokenizer.json file") from None


def _configured_eos(path: Path) -> str | None:
  """`eos_token` of the tokenizer_config.json beside tokenizer.json, if there is one."""
  config = path.parent / "tokenizer_config.json"
  try:
    eos = json.loads(config.read_text()).get("eos_token")
  except (OSError, ValueError, AttributeError):
    return None
  return eos.get("content") if isinstance(eos, dict) else eos
