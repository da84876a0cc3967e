"""Text, JSONL, Parquet or Arrow files → token shards + manifest.json (the format of jaxseek/input/shards.py).

python scripts/prepare_data.py --input FILES_OR_GLOBS --tokenizer byte|PATH/tokenizer.json --out DIR [--shards N]
                               [--format text|chat] [--chat-template FILE|default]

A `.jsonl` file (optionally `.gz`) holds one JSON object per line whose `text` field is a document; any other
file is one document, except `.parquet` and `.arrow` files (and `datasets` `save_to_disk` folders, read as their
`*.arrow` files): every row's `text` column is a document, read in record batches (input/tables.py). With
--format chat every line (row) is a conversation (input/chat.py), rendered with the chat
template, and a per-token loss mask is stored beside the tokens: only assistant tokens are trained on. Document i
(in the order of the sorted file list) goes to shard i mod N. Tokenisation runs in worker processes; the output
does not depend on their number.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import glob
import gzip
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from jaxseek.errors import UserError, cli
from jaxseek.input import chat
from jaxseek.input import shards as shards_lib
from jaxseek.input import tables
from jaxseek.input import tokenize

CHUNK_BYTES = 1 << 22  # text handed to a worker at a time


def expand(patterns: Sequence[str]) -> list[Path]:
  """Files named or matched (recursive `**` globs), each once, sorted; a pattern matching nothing is an error. A
  folder stands for its Parquet and Arrow files (a `datasets` `save_to_disk` folder)."""
  files: set[Path] = set()
  for pattern in patterns:
    if Path(pattern).is_dir():
      matched = tables.folder_files(Path(pattern))
      if not matched:
        raise UserError(f"--input {pattern} is a folder without .arrow or .parquet files; give the files, or a "
                        f"folder written by datasets' save_to_disk (of a DatasetDict: its split, e.g. "
                        f"{Path(pattern) / 'train'})")
      files.update(matched)
      continue
    matched = [Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()]
    if not matched:
      raise UserError(f"--input {pattern} matches no file; check the path or quote the glob")
    files.update(matched)
  return sorted(files)


def _is_jsonl(path: Path) -> bool:
  return path.name.endswith((".jsonl", ".jsonl.gz", ".ndjson"))


def read_chunks(files: list[Path], text_field: str, conversation=None) -> Iterator[tuple[list, int]]:
  """Yields (documents, input bytes they came from) in groups of about CHUNK_BYTES; empty documents are skipped.
  A document is a text, or with `conversation` (a ChatRenderer) a rendered conversation (text, spans)."""
  texts, size = [], 0
  for path in files:
    for record_size, text in _records(path, text_field, conversation):
      size += record_size
      if text:
        texts.append(text)
      if size >= CHUNK_BYTES:
        yield texts, size
        texts, size = [], 0
  if texts or size:
    yield texts, size


def _records(path: Path, text_field: str, conversation) -> Iterator[tuple[int, object]]:
  """(input bytes, document) of one file: a table's rows, a JSONL file's lines, or the whole file."""
  if tables.is_table(path):
    if conversation is None:
      yield from tables.documents(path, text_field)
    else:
      for n, (record_size, record) in enumerate(tables.conversations(path), 1):
        yield record_size, conversation.checked(record, f"{path} row {n}")
    return
  opener = gzip.open if path.suffix == ".gz" else open
  with opener(path, "rb") as f:
    if conversation is not None:
      yield from _jsonl_conversations(f, path, conversation)
    elif _is_jsonl(path):
      yield from _jsonl_documents(f, path, text_field)
    else:
      data = f.read()
      yield len(data), _decode(data, path, 0)


def _decode(data: bytes, path: Path, offset: int) -> str:
  """UTF-8 text, or a UserError naming the file and the byte offset (in the uncompressed stream) that is not."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise UserError(f"{path} is not UTF-8 text: byte offset {offset + e.start} (0x{data[e.start]:02x}) cannot be "
                    f"decoded; convert the file to UTF-8 or leave it out of --input") from None


def _jsonl_documents(f, path: Path, text_field: str) -> Iterator[tuple[int, str]]:
  offset = 0
  for number, raw in enumerate(f, 1):
    yield len(raw), _document(_decode(raw, path, offset), path, number, text_field)
    offset += len(raw)


class ChatRenderer:
  """JSONL record → (rendered text, assistant spans) with one chat template (see input/chat.py)."""

  def __init__(self, tokenizer: tokenize.Tokenizer, template: str | None):
    try:
      self.source, self.origin = chat.template_source(tokenizer.path, template)
      chat.compile_template(self.source)
    except chat.ChatError as e:
      raise UserError(f"{e}") from None
    self.variables = tokenize.chat_variables(tokenizer)
    self.byte = tokenizer.kind == "byte"

  def __call__(self, record: object) -> tuple[str, list[tuple[int, int]]]:
    conversation = [{**m, "content": _clean(m["content"])} for m in chat.messages(record)]
    return chat.render(self.source, conversation, self.variables)

  def checked(self, record: object, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered record, or one line naming `where` it is and what is wrong with it."""
    try:
      return self(record)
    except chat.ChatError as e:
      raise UserError(f"{where} {e}") from None


def _clean(text: str) -> str:
  """Encodable text: lone surrogates (which JSON escapes can hold) become "?"; NUL, the byte-level EOS, is
  dropped."""
  if not text.isascii():
    text = text.encode("utf-8", "replace").decode("utf-8")
  return text.replace("\x00", "")


def _jsonl_conversations(f, path: Path, render: ChatRenderer) -> Iterator[tuple[int, tuple | None]]:
  offset = 0
  for number, raw in enumerate(f, 1):
    line = _decode(raw, path, offset)
    offset += len(raw)
    if not line.strip():
      yield len(raw), None
      continue
    try:
      record = json.loads(line)
    except ValueError:
      raise UserError(f"{path}:{number} is not valid JSON; each line of a .jsonl file must be one JSON object") from None
    yield len(raw), render.checked(record, f"{path}:{number}")


def _document(raw: str, path: Path, number: int, text_field: str) -> str:
  if not raw.strip():
    return ""
  try:
    record = json.loads(raw)
  except ValueError:
    raise UserError(f"{path}:{number} is not valid JSON; each line of a .jsonl file must be one JSON object") from None
  text = record.get(text_field) if isinstance(record, dict) else None
  if not isinstance(text, str):
    raise UserError(f"{path}:{number} has no string field {text_field!r}; pass --text-field NAME to read another")
  if not text.isascii():  # JSON escapes can hold lone surrogates, which UTF-8 cannot encode: they become "?"
    text = text.encode("utf-8", "replace").decode("utf-8")
  return text


def _init_worker() -> None:
  os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one tokenizer thread per worker process


def _encode(tokenizer: tokenize.Tokenizer, documents: list) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
  """(tokens, lengths, mask or None) of texts, or of rendered conversations."""
  if documents and isinstance(documents[0], tuple):
    return tokenize.encode_chat(tokenizer, documents)
  return *tokenize.encode(tokenizer, documents), None


def encoded_chunks(tokenizer: tokenize.Tokenizer, chunks: Iterator[tuple[list, int]],
                   workers: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None, int]]:
  """(tokens, lengths, mask or None, input bytes) per chunk, in input order; with workers > 1, 2·workers chunks
  in flight."""
  if workers <= 1:
    for texts, size in chunks:
      yield *_encode(tokenizer, texts), size
    return
  context = multiprocessing.get_context("spawn")  # never fork a process that may hold JAX or tokenizer threads
  with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker) as pool:
    pending: collections.deque = collections.deque()
    for texts, size in chunks:
      pending.append((pool.submit(_encode, tokenizer, texts), size))
      if len(pending) >= 2 * workers:
        future, done_size = pending.popleft()
        yield *future.result(), done_size
    while pending:
      future, done_size = pending.popleft()
      yield *future.result(), done_size


def _check_out(out: Path, overwrite: bool) -> None:
  if out.exists() and not out.is_dir():
    raise UserError(f"--out {out} is a file; choose a folder")
  if (out / shards_lib.MANIFEST).exists() and not overwrite:
    raise UserError(f"{out} already holds prepared data; pass --overwrite or choose another --out")


def _publish(staging: Path, out: Path, manifest: dict) -> None:
  """Puts the finished folder `staging` (its manifest written there last) in place of `out`. What `out` held
  stays whole until the new folder is in place: it is renamed aside, the new one renamed in (one rename each),
  then whatever else the user kept in `out` moves over and the old shards go. An interruption at any point
  leaves either the old prepared data or the new, never a mix and never neither."""
  shards_lib.write_manifest(staging, manifest)
  if not out.exists():
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staging, out)
    return
  old = out.parent / f".{out.name}.old-{os.getpid()}"
  os.replace(out, old)
  os.replace(staging, out)
  shard = lambda p: p.name == shards_lib.MANIFEST or p.name.startswith("shard-")
  for path in old.iterdir():
    if not shard(path) and not (out / path.name).exists():
      os.replace(path, out / path.name)
  shutil.rmtree(old, ignore_errors=True)


def prepare(inputs: Sequence[str], tokenizer: str, out: str | Path, *, shards: int = 1, workers: int = 1,
            text_field: str = "text", eos: str | None = None, overwrite: bool = False,
            progress: bool = True, format: str = "text", chat_template: str | None = None) -> dict:
  """Tokenises `inputs` into `shards` shards under `out`; returns the manifest (also written as manifest.json).
  `format` "chat": JSONL conversations with a loss mask on the assistant tokens, rendered with `chat_template`
  (a jinja file, "default", or None for the tokenizer's own)."""
  files = _checked_inputs(inputs, shards, format, chat_template)
  tok = tokenize.resolve(tokenizer, eos)
  renderer = ChatRenderer(tok, chat_template) if format == "chat" else None
  out = Path(out)
  _check_out(out, overwrite)
  # written beside --out first: bad input found halfway leaves what --out held untouched
  staging = out.parent / f".{out.name}.partial-{os.getpid()}"
  shutil.rmtree(staging, ignore_errors=True)
  staging.mkdir(parents=True)
  try:
    total_bytes = sum(p.stat().st_size for p in files)
    start = time.perf_counter()
    encoded = _in_vocab(encoded_chunks(tok, read_chunks(files, text_field, renderer), workers), tokenizer,
                        tok.vocab_size)
    with _Progress(total_bytes, progress) as bar:
      entries, documents, trained = _write_shards(staging, encoded, shards, renderer is not None, bar)
    if documents == 0:
      raise UserError(f"--input {' '.join(inputs)} holds no document (the files are empty"
                      f"{' or their records have no text' if any(map(_is_jsonl, files)) else ''}); nothing written")
    if renderer is not None and trained == 0:
      raise UserError(f"--input {' '.join(inputs)}: no assistant token survives the chat template "
                      f"({renderer.origin}); nothing written")
    seconds = time.perf_counter() - start
    manifest = {"format": shards_lib.FORMAT, "tokenizer": tok.manifest(), "vocab_size": tok.vocab_size,
                "eos_id": tok.eos_id, "documents": documents, "tokens": sum(e["tokens"] for e in entries),
                "input_bytes": total_bytes, "inputs": [str(p) for p in files], "shards": entries}
    if renderer is not None:
      manifest["chat"] = {"template": renderer.origin, "template_sha256": hashlib.sha256(
          renderer.source.encode()).hexdigest(), "trained_tokens": trained}
    _publish(staging, out, manifest)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  if progress:
    _summary(manifest, renderer, total_bytes, seconds, out)
  return manifest


def _checked_inputs(inputs: Sequence[str], shards: int, format: str, chat_template: str | None) -> list[Path]:
  """The files `inputs` name, once the options are checked against each other and the files against `format`."""
  if shards < 1:
    raise UserError(f"--shards {shards} must be ≥ 1")
  if format not in ("text", "chat"):
    raise UserError(f"--format {format} must be text or chat")
  if chat_template is not None and format != "chat":
    raise UserError("--chat-template applies to --format chat only")
  files = expand(inputs)
  readable = lambda p: _is_jsonl(p) or tables.is_table(p)
  if format == "chat" and not all(map(readable, files)):
    raise UserError(f"--format chat reads .jsonl, .parquet or .arrow files of conversations, not "
                    f"{next(p for p in files if not readable(p))}; convert it to JSONL with a 'messages' list (or "
                    f"'prompt' and 'response') per line")
  return files


def _in_vocab(encoded: Iterator[tuple], tokenizer: str, vocab_size: int) -> Iterator[tuple]:
  """The chunks of `encoded`, refusing one with an id outside the vocabulary."""
  for tokens, lengths, mask, size in encoded:
    if tokens.size and int(tokens.max()) >= vocab_size:
      raise UserError(f"--tokenizer {tokenizer} produced id {int(tokens.max())} ≥ its vocab size {vocab_size}")
    yield tokens, lengths, mask, size


def _write_shards(staging: Path, encoded: Iterator[tuple], shards: int, mask: bool,
                  bar: _Progress) -> tuple[list[dict], int, int]:
  """Writes the encoded chunks into `shards` shards under `staging`, document i to shard i mod `shards`;
  returns the shards' manifest entries, the documents and the tokens trained on (the loss mask's ones)."""
  writers = [shards_lib.ShardWriter(staging, s, mask=mask) for s in range(shards)]
  documents, trained = 0, 0
  for tokens, lengths, mask_chunk, size in encoded:
    shard_of_doc = (documents + np.arange(len(lengths))) % shards
    shard_of_token = np.repeat(shard_of_doc, lengths)
    for s, writer in enumerate(writers):
      on = shard_of_token == s
      writer.add(tokens[on], lengths[shard_of_doc == s], None if mask_chunk is None else mask_chunk[on])
    documents += len(lengths)
    trained += 0 if mask_chunk is None else int(mask_chunk.sum())
    bar.advance(size)
  return [w.close() for w in writers], documents, trained


def _summary(manifest: dict, renderer: ChatRenderer | None, total_bytes: int, seconds: float, out: Path) -> None:
  """What was prepared and how fast, on stderr."""
  if renderer is not None:
    print(f"chat template: {renderer.origin}; {manifest['chat']['trained_tokens']:,} of {manifest['tokens']:,} "
          f"tokens are trained on (assistant turns)", file=sys.stderr)
  print(f"prepared {manifest['documents']:,} documents, {manifest['tokens']:,} tokens from {total_bytes / 1e6:,.1f} "
        f"MB in {seconds:.1f} s ({total_bytes / 1e6 / seconds:,.1f} MB/s, {manifest['tokens'] / seconds:,.0f} "
        f"tokens/s) → {out}", file=sys.stderr)


class _Progress:
  """A rich progress bar over input bytes (MB/s) on a terminal, or nothing (so that an error written to a log
  or a pipe stays one line)."""

  def __init__(self, total: int, enabled: bool):
    self.bar = None
    if enabled and sys.stderr.isatty():
      from rich import progress

      self.bar = progress.Progress(progress.TextColumn("tokenising"), progress.BarColumn(),
                                   progress.DownloadColumn(), progress.TransferSpeedColumn(),
                                   progress.TimeRemainingColumn(), console=_stderr_console())
      self.task = self.bar.add_task("tokenising", total=total)

  def __enter__(self):
    if self.bar:
      self.bar.start()
    return self

  def advance(self, size: int) -> None:
    if self.bar:
      self.bar.advance(self.task, size)

  def __exit__(self, *exc):
    if self.bar:
      self.bar.stop()


def _stderr_console():
  from rich.console import Console

  return Console(stderr=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python scripts/prepare_data.py", description=__doc__.splitlines()[0])
  parser.add_argument("--input", nargs="+", action="extend", required=True, metavar="FILE_OR_GLOB",
                      help="text, .jsonl, .parquet or .arrow files, or a datasets save_to_disk folder (globs "
                           "allowed, ** recursive)")
  parser.add_argument("--tokenizer", required=True, help="byte, or the path of a Hugging Face tokenizer.json")
  parser.add_argument("--out", required=True, help="output folder (data.source=DIR in a config)")
  parser.add_argument("--shards", type=int, default=1, help="number of shards (default 1)")
  parser.add_argument("--workers", type=int, help="tokenising processes (default: 1 for byte, else one per CPU)")
  parser.add_argument("--text-field", default="text",
                      help="JSONL field or Parquet / Arrow column holding the document (default text)")
  parser.add_argument("--format", default="text", choices=("text", "chat"),
                      help="text: documents; chat: JSONL conversations ('messages', or 'prompt' and 'response'), "
                           "trained on the assistant tokens only")
  parser.add_argument("--chat-template", metavar="FILE|default",
                      help="jinja chat template (default: the tokenizer's chat_template.jinja or tokenizer_config.json "
                           "chat_template, else jaxseek's User:/Assistant: template)")
  parser.add_argument("--eos", help="end-of-document token (default: from tokenizer_config.json or the vocabulary)")
  parser.add_argument("--overwrite", action="store_true", help="replace prepared data already in --out")
  parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")
  return parser.parse_args(argv)


@cli
def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if args.workers is not None and args.workers < 1:
    raise UserError(f"--workers {args.workers} must be ≥ 1 (leave it out for the default)")
  workers = args.workers or (1 if args.tokenizer == "byte" else os.cpu_count() or 1)
  prepare(args.input, args.tokenizer, args.out, shards=args.shards, workers=workers, text_field=args.text_field,
          eos=args.eos, overwrite=args.overwrite, progress=not args.quiet, format=args.format,
          chat_template=args.chat_template)
  return 0
