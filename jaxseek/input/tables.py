"""Parquet files and Arrow files (a `datasets` `save_to_disk` folder's `*.arrow`) read in record batches.

Memory is bounded by a batch of ROWS rows of the columns read, not by a file: Parquet through
`ParquetFile.iter_batches`, Arrow IPC (stream or file format) memory-mapped, one record batch at a time (a
`save_to_disk` batch holds 1,000 rows). A missing column, a column of the wrong type and a file that is not what
its name says end in one line naming the fix.
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
  """(schema, rows, read) of a Parquet or Arrow IPC file; read(columns) iterates its record batches."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  kind = "Parquet" if path.suffix == ".parquet" else "Arrow"
  try:
    if kind == "Parquet":
      # no pre-buffering of whole row groups, no read-ahead threads: memory follows the batch
      f = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
      return f.schema_arrow, f.metadata.num_rows, lambda columns: f.iter_batches(
          batch_size=ROWS, columns=columns, use_threads=False)
    schema, rows = _arrow_batches(path, None)
    return schema, rows, lambda columns: _arrow_batches(path, columns)
  except (pa.ArrowException, OSError) as e:
    raise UserError(f"{path} is not a readable {kind} file ({str(e).splitlines()[0][:120]}); check the file or "
                    f"leave it out of --input") from None


def _arrow_batches(path: Path, columns: Sequence[str] | None):
  """Arrow IPC, stream format (what `save_to_disk` writes) or file format, memory-mapped: with `columns` None
  (schema, rows), else an iterator of record batches of those columns."""
  import pyarrow as pa
  import pyarrow.ipc as ipc

  source = pa.memory_map(str(path))
  try:
    reader = ipc.open_stream(source)
    each = iter(reader)
  except pa.ArrowInvalid:
    reader = ipc.open_file(source)
    each = (reader.get_batch(i) for i in range(reader.num_record_batches))
  if columns is None:
    return reader.schema, sum(b.num_rows for b in each)
  return (b.select(list(columns)) for b in each)


def _check_columns(path: Path, schema, wanted: Sequence[str], kinds: dict[str, str]) -> None:
  import pyarrow as pa

  for name in wanted:
    if name not in schema.names:
      raise UserError(f"{path} has no column {name!r} (its columns: {', '.join(schema.names)}); pass "
                      f"--text-field NAME to read another")
    t = schema.field(name).type
    if kinds[name] == "string" and not (pa.types.is_string(t) or pa.types.is_large_string(t)
                                        or pa.types.is_string_view(t)):
      raise UserError(f"{path} column {name!r} holds {t}, not text; pass --text-field NAME of a string column")


def batches(path: Path, columns: Sequence[str], kinds: dict[str, str]) -> Iterator[tuple[int, list[dict]]]:
  """(approximate input bytes, rows as dicts of `columns`) per record batch; `kinds`: "string" for columns that
  must hold text."""
  import pyarrow as pa

  schema, rows, read = _open(path)
  _check_columns(path, schema, columns, kinds)
  size = path.stat().st_size
  try:
    for batch in read(list(columns)):
      yield (size * batch.num_rows // rows if rows else 0), batch.to_pylist()
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
  schema, _, _ = _open(path)
  present = [c for c in CHAT_COLUMNS if c in schema.names]
  if not present:
    raise UserError(f"{path} has none of the columns {', '.join(CHAT_COLUMNS)} (its columns: "
                    f"{', '.join(schema.names)}); --format chat reads a 'messages' list or 'prompt' and 'response'")
  kinds = {c: ("list" if c == "messages" else "string") for c in present}
  for size, rows in batches(path, present, kinds):
    share = size // max(len(rows), 1)
    for row in rows:
      yield share, {k: v for k, v in row.items() if v is not None}
