"""Parquet and Arrow input to scripts/prepare_data.py (input/tables.py): the same token stream as the same
documents in JSONL, read in record batches, and bad tables refused in one line with nothing published."""

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from conftest import ROOT
from jaxseek.errors import UserError
from jaxseek.input import prepare, tables

DOCS = [f"document {i}: " + "abc é " * (i % 13) + "\n" * (i % 3) for i in range(500)]


def jsonl(path, docs):
  path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs)))


def shard_digests(manifest):
  return [(s["documents"], s["tokens"], s["sha256"]) for s in manifest["shards"]]


def test_parquet_and_arrow_prepare_to_the_jsonl_token_stream(tmp_path):
  """Parquet in 3 files of several row groups (an unrelated column beside `text`, a null row), and a
  save_to_disk-style folder of Arrow IPC stream files: the same shards, byte for byte, as the JSONL."""
  jsonl(tmp_path / "docs.jsonl", DOCS)
  for k, part in enumerate(np.array_split(np.arange(len(DOCS)), 3)):
    pq.write_table(pa.table({"id": part.tolist(), "text": [DOCS[i] for i in part]}),
                   tmp_path / f"part-{k}.parquet", row_group_size=37)
  folder = tmp_path / "saved"
  folder.mkdir()
  (folder / "dataset_info.json").write_text("{}")
  table = pa.table({"text": DOCS + [None], "score": list(range(len(DOCS) + 1))})
  with ipc.new_stream(folder / "data-00000-of-00001.arrow", table.schema) as writer:
    for batch in table.to_batches(max_chunksize=100):
      writer.write_batch(batch)
  want = prepare.prepare([str(tmp_path / "docs.jsonl")], "byte", tmp_path / "a", shards=2, progress=False)
  parquet = prepare.prepare([str(tmp_path / "part-*.parquet")], "byte", tmp_path / "b", shards=2, progress=False)
  arrow = prepare.prepare([str(folder)], "byte", tmp_path / "c", shards=2, progress=False)
  assert want["documents"] == len(DOCS)
  assert shard_digests(parquet) == shard_digests(want) == shard_digests(arrow)


def test_tables_are_read_in_record_batches(tmp_path, monkeypatch):
  """A file of 1,000 rows with batches of 64: 16 batches, none larger; and preparing a Parquet file of about 60 MB
  of text holds no more Arrow memory at once than preparing one of 30 MB (the file is never read whole)."""
  pq.write_table(pa.table({"text": [f"row {i}" for i in range(1000)]}), tmp_path / "t.parquet", row_group_size=500)
  monkeypatch.setattr(tables, "ROWS", 64)
  sizes = [len(rows) for _, rows in tables.batches(tmp_path / "t.parquet", ["text"], {"text": "string"})]
  assert len(sizes) == 16 and max(sizes) == 64 and sum(sizes) == 1000

  def peak_arrow_memory(rows, name):
    """Preparing a Parquet file of `rows` rows of ≈ 11 KB of text in a fresh process: the most memory Arrow held
    at once (its pool's peak, the buffers a read makes), and the file's text bytes."""
    rng = np.random.default_rng(0)
    words = np.array([f"w{i}" for i in range(2000)])
    text = [" ".join(rng.choice(words, 2000)) for _ in range(rows)]
    pq.write_table(pa.table({"text": text}), tmp_path / f"{name}.parquet", row_group_size=256)
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import pyarrow as pa; from jaxseek.input import prepare; "
            f"prepare.prepare([{str(tmp_path / name)!r} + '.parquet'], 'byte', {str(tmp_path / name)!r} + '-out', "
            f"progress=False); print(pa.default_memory_pool().max_memory())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1]), sum(map(len, text))

  half, half_bytes = peak_arrow_memory(2750, "half")
  whole, whole_bytes = peak_arrow_memory(5500, "whole")
  assert whole_bytes > 55e6
  # a file read whole would hold its whole text in Arrow: 60 MB, twice the half file's
  assert whole < 0.5 * whole_bytes and whole < 1.1 * half, (half, whole, whole_bytes)


@pytest.mark.parametrize("case, match", [
    ("missing", "has no column 'text' .*pass --text-field NAME"),
    ("integer", "column 'text' holds int64, not text"),
    ("corrupt", "is not a readable Parquet file"),
    ("empty-folder", "is a folder without .arrow or .parquet files"),
])
def test_bad_tables_end_in_one_line_and_publish_nothing(tmp_path, case, match):
  source = tmp_path / "in.parquet"
  if case == "missing":
    pq.write_table(pa.table({"body": ["a", "b"]}), source)
  elif case == "integer":
    pq.write_table(pa.table({"text": [1, 2]}), source)
  elif case == "corrupt":
    source.write_bytes(b"PAR1 this is not parquet" * 10)
  else:
    source = tmp_path / "folder"
    source.mkdir()
  out = tmp_path / "out"
  with pytest.raises(UserError, match=match) as e:
    prepare.prepare([str(source)], "byte", out, progress=False)
  assert "\n" not in str(e.value)
  assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_chat_rows_from_parquet_match_jsonl(tmp_path):
  """--format chat over a Parquet file of `messages` rows: the same tokens and loss mask as the JSONL."""
  rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i} " * i}]}
          for i in range(1, 40)]
  (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet", row_group_size=10)
  want = prepare.prepare([str(tmp_path / "c.jsonl")], "byte", tmp_path / "a", format="chat", progress=False)
  got = prepare.prepare([str(tmp_path / "c.parquet")], "byte", tmp_path / "b", format="chat", progress=False)
  assert shard_digests(got) == shard_digests(want) and got["chat"]["trained_tokens"] == want["chat"]["trained_tokens"]


def _saved(folder, table, batch_rows):
  """A save_to_disk-style folder: `table` in one Arrow IPC stream file of record batches of `batch_rows` rows."""
  folder.mkdir()
  (folder / "dataset_info.json").write_text("{}")
  with ipc.new_stream(folder / "data-00000-of-00001.arrow", table.schema) as writer:
    for batch in table.to_batches(max_chunksize=batch_rows):
      writer.write_batch(batch)
  return folder


@pytest.mark.parametrize("format", ["text", "chat"])
def test_a_save_to_disk_shard_is_read_once(tmp_path, monkeypatch, format):
  """Preparing a save_to_disk folder (one Arrow stream file of 5 record batches) opens the file's stream once and
  reads each record batch once, for text and for chat rows."""
  if format == "text":
    table = pa.table({"text": DOCS, "score": list(range(len(DOCS)))})
  else:
    table = pa.Table.from_pylist([{"messages": [{"role": "user", "content": f"q{i}"},
                                                {"role": "assistant", "content": f"a{i}"}]} for i in range(500)])
  folder = _saved(tmp_path / "saved", table, 100)
  opened, read = [], []
  open_stream = ipc.open_stream

  class Counted:
    def __init__(self, reader):
      self.reader, self.schema = reader, reader.schema

    def __iter__(self):
      for batch in self.reader:
        read.append(batch.num_rows)
        yield batch

  monkeypatch.setattr(ipc, "open_stream", lambda source: opened.append(1) or Counted(open_stream(source)))
  manifest = prepare.prepare([str(folder)], "byte", tmp_path / "out", format=format, progress=False)
  assert manifest["documents"] == 500
  assert (len(opened), read) == (1, [100] * 5)


@pytest.mark.parametrize("messages, held", [
    (["hello", "there"], "string"),
    ([[1, 2], [3]], "list<element: int64>"),
    ([[{"role": "user", "text": "q"}]], "list<element: struct<role: string, text: string>>"),
    ([[{"role": "user", "content": [{"type": "text", "text": "q"}]}]], "list<element: struct<role: string, content: list"),
])
def test_a_messages_column_that_is_not_chat_messages_is_refused_in_one_line(tmp_path, messages, held):
  """A Parquet `messages` column that is not a list of {role, content} text structs: one line naming the file, the
  column and what it holds, before any row is read."""
  pq.write_table(pa.table({"messages": messages}), tmp_path / "c.parquet")
  with pytest.raises(UserError) as e:
    prepare.prepare([str(tmp_path / "c.parquet")], "byte", tmp_path / "out", format="chat", progress=False)
  assert str(e.value).startswith(f"{tmp_path / 'c.parquet'} column 'messages' holds {held}"), str(e.value)
  assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_prepare_data_refuses_a_saved_messages_column_of_text_with_exit_2(tmp_path, run_env):
  folder = _saved(tmp_path / "saved", pa.table({"messages": ["User: hi\nAssistant: hello"] * 3}), 2)
  out = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--input", str(folder),
                        "--tokenizer", "byte", "--out", str(tmp_path / "out"), "--format", "chat"],
                       capture_output=True, text=True, env=run_env)
  shard = folder / "data-00000-of-00001.arrow"
  assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
  assert out.stderr.startswith(f"error: {shard} column 'messages' holds string, not a list of {{role, content}}")
  assert not (tmp_path / "out").exists()
