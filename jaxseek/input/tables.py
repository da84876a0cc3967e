"""Parquet files and Arrow files (a `datasets` `save_to_disk` folder's `*.arrow`) read in record batches.

Memory is bounded by a batch of ROWS rows of the columns read, not by a file: Parquet through
`ParquetFile.iter_batches`, Arrow IPC (stream or file format) memory-mapped, one record batch at a time (a
`save_to_disk` batch holds 1,000 rows); each file is opened and read once. A missing column, a column of the
wrong type (text columns; chat's `messages`: a list of structs with text `role` and `content`) and a file that is
not what its name says end in one line naming the fix, before a row is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

from jaxseek.errors import UserError

SUFFIXES = (".parquet", ".arrow")
ROWS = 256  # Parquet rows per record batch
CHAT_COLUMNS = ("messages", "prompt", "response")


def is_table(path: Path) -> bool:
  return path.name.endswith(SUFFIXES)


def folder_files(folder: Path) -> list[Path]:
  """The `*.arrow` files of a `save_to_disk` folder (and any `*.parquet` beside them), sorted."""
  return sorted(p for p in folder.iterdir() if p.is_file() and is_table(p))


def _open(path: Path):
  """(schema, read) of a Parquet or Arrow IPC file, opened once: read(columns) iterates, once, (approximate input
  bytes, record batch of `columns`) over the file."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  kind = "Parquet" if path.suffix == ".parquet" else "Arrow"
  try:
    if kind == "Parquet":
      # no pre-buffering of whole row groups, no read-ahead threads: memory follows the batch
      f = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
      rows, size = f.metadata.num_rows, path.stat().st_size
      return f.schema_arrow, lambda columns: ((size * b.num_rows // max(rows, 1), b) for b in f.iter_batches(
          batch_size=ROWS, columns=columns, use_threads=False))
    return _arrow(path)
  except (pa.ArrowException, OSError) as e:
    raise UserError(f"{path} is not a readable {kind} file ({str(e).splitlines()[0][:120]}); check the file or "
                    f"leave it out of --input") from None


def _arrow(path: Path):
  """`_open` for Arrow IPC, stream format (what `save_to_disk` writes) or file format, memory-mapped; a batch's
  input bytes are those of its buffers (all columns: what the file holds for it)."""
  import pyarrow as pa
  import pyarrow.ipc as ipc

  source = pa.memory_map(str(path))
  try:
    reader = ipc.open_stream(source)
    each = lambda: iter(reader)
  except pa.ArrowInvalid:
    reader = ipc.open_file(source)
    each = lambda: (reader.get_batch(i) for i in range(reader.num_record_batches))
  return reader.schema, lambda columns: ((b.nbytes, b.select(list(columns))) for b in each())


def _is_text(t) -> bool:
  import pyarrow as pa

  return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_messages(t) -> bool:
  """A list of structs with text `role` and `content` fields (what `datasets` stores for chat messages)."""
  import pyarrow as pa

  if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t)):
    return False
  item = t.value_type
  names = [item.field(i).name for i in range(item.num_fields)] if pa.types.is_struct(item) else []
  return all(n in names and _is_text(item.field(n).type) for n in ("role", "content"))


def _check_columns(path: Path, schema, wanted: Sequence[str], kinds: dict[str, str]) -> None:
  for name in wanted:
    if name not in schema.names:
      raise UserError(f"{path} has no column {name!r} (its columns: {', '.join(schema.names)}); pass "
                      f"--text-field NAME to read another")
    t = schema.field(name).type
    if kinds[name] == "string" and not _is_text(t):
      raise UserError(f"{path} column {name!r} holds {t}, not text; pass --text-field NAME of a string column")
    if kinds[name] == "messages" and not _is_messages(t):
      raise UserError(f"{path} column {name!r} holds {t}, not a list of {{role, content}} messages with text "
                      f"role and content; store each row's conversation as such a list, or as 'prompt' and "
                      f"'response' text columns")


def batches(path: Path, columns: Sequence[str], kinds: dict[str, str]) -> Iterator[tuple[int, list[dict]]]:
  """(approximate input bytes, rows as dicts of `columns`) per record batch, the file read once; `kinds`:
  "string" for columns that must hold text, "messages" for a column of chat messages."""
  schema, read = _open(path)
  _check_columns(path, schema, columns, kinds)
  return _rows(path, read, columns)


def _rows(path: Path, read, columns: Sequence[str]) -> Iterator[tuple[int, list[dict]]]:
  import pyarrow as pa

  try:
    for size, batch in read(list(columns)):
      yield size, batch.to_pylist()
  except (pa.ArrowException, OSError) as e:
    raise UserError(f"{path} is corrupt ({str(e).splitlines()[0][:120]}); check the file or leave it out of "
                    f"--input") from None


def documents(path: Path, text_field: str) -> Iterator[tuple[int, str]]:
  """(input bytes, text) per row of column `text_field` (a null is an empty document)."""
  for size, rows in batches(path, [text_field], {text_field: "string"}):
    share = size // max(len(rows), 1)
    for row in rows:
      yield share, row[text_field] or ""


def conversations(path: Path) -> Iterator[tuple[int, dict]]:
  """(input bytes, record) per row: `messages`, or `prompt` and `response` (input/chat.py)."""
  schema, read = _open(path)
  present = [c for c in CHAT_COLUMNS if c in schema.names]
  if not present:
    raise UserError(f"{path} has none of the columns {', '.join(CHAT_COLUMNS)} (its columns: "
                    f"{', '.join(schema.names)}); --format chat reads a 'messages' list or 'prompt' and 'response'")
  _check_columns(path, schema, present, {c: ("messages" if c == "messages" else "string") for c in present})
  for size, rows in _rows(path, read, present):
    share = size // max(len(rows), 1)
    for row in rows:
      yield share, {k: v for k, v in row.items() if v is not None}
