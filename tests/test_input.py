"""The input pipeline: data preparation, per-process shards, packing, resume, mixtures, errors."""

import dataclasses
import json
import pickle
import subprocess
import sys
from pathlib import Path

import grain
import jax
import numpy as np
import pytest
from conftest import ROOT, load_config
from flax import nnx

from jaxseek import model as model_lib
from jaxseek.errors import UserError
from jaxseek.input import batches, prepare, shards, sources
from jaxseek.input.batches import Layout
from jaxseek.sharding import mesh as mesh_lib

TEXTS = ["Première ligne: café, 中文.\n", "second file\x00 with a NUL\n"]
RECORDS = ["alpha beta", "", "gamma delta epsilon", "zeta eta theta iota", "kappa", "lambda mu nu", "xi omicron"]


def _corpus(tmp_path):
  """Two text files (one document each) and a JSONL file (one empty record, skipped): 8 documents."""
  for i, text in enumerate(TEXTS):
    (tmp_path / f"t{i}.txt").write_text(text, encoding="utf-8")
  lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(RECORDS)]
  (tmp_path / "r.jsonl").write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n")
  docs = TEXTS + [t for t in RECORDS if t]  # sorted file order: r.jsonl, t0.txt, t1.txt
  return [tmp_path / "*.txt", tmp_path / "r.jsonl"], docs[2:] + docs[:2]


def _unique_docs(tmp_path, name, count, letter="", seed=0):
  """JSONL of `count` distinct documents (`letter`, 3 digits, 1..25 × `letter`), prepared byte-level (3 shards)
  into tmp_path/name."""
  rng = np.random.default_rng(seed)
  texts = [f"{letter}{i:03d}" + letter * int(rng.integers(1, 26)) for i in range(count)]
  (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
  prepare.prepare([str(tmp_path / f"{name}.jsonl")], "byte", tmp_path / name, shards=3, progress=False)
  return texts


def _cfg(source, *overrides):
  source = "[" + ",".join(map(str, source)) + "]" if isinstance(source, list) else source
  return load_config("tiny-v3", f"data.source={source}", *overrides)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _segments(batch):
  """Every packed document piece of a local batch, as (input tokens + last target) bytes."""
  out = []
  for inputs, targets, seg in zip(batch["inputs"], batch["targets"], batch["segment_ids"]):
    for s in np.unique(seg[seg > 0]):
      where = seg == s
      out.append(bytes(np.append(inputs[where], targets[where][-1]).astype(np.uint8)))
  return out


def test_prepare_byte_level_writes_shards_and_manifest(tmp_path):
  inputs, docs = _corpus(tmp_path)
  manifest = prepare.prepare([str(p) for p in inputs], "byte", tmp_path / "out", shards=3, progress=False)
  encoded = [d.encode().replace(b"\0", b"") + b"\0" for d in docs]
  assert (manifest["documents"], manifest["tokens"], manifest["vocab_size"], manifest["eos_id"]) == (
      len(docs), sum(map(len, encoded)), 256, 0)
  assert [s["documents"] for s in manifest["shards"]] == [3, 3, 2]
  assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == manifest
  for entry in manifest["shards"]:
    for kind in ("tokens", "index"):
      assert shards.file_sha256(tmp_path / "out" / entry[f"{kind}_file"]) == entry["sha256"][kind]
  opened = shards.open_folder(tmp_path / "out", 264)
  for i, doc in enumerate(encoded):  # document i is document i // 3 of shard i % 3
    tokens, offsets = opened.tokens[i % 3], opened.offsets[i % 3]
    assert bytes(np.asarray(tokens[offsets[i // 3]:offsets[i // 3 + 1]]).astype(np.uint8)) == doc


def _word_tokenizer(folder):
  from tokenizers import Tokenizer, models, pre_tokenizers

  words = sorted({w for t in RECORDS + ["with", "a", "NUL"] for w in t.replace(".", " ").split()})
  vocab = {"[UNK]": 0, "<end>": 1, **{w: i + 2 for i, w in enumerate(words)}}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  folder.mkdir()
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<end>"}))
  return tok, len(vocab)


def test_prepare_with_tokenizer_json_in_parallel_workers(tmp_path):
  inputs, docs = _corpus(tmp_path)
  tok, vocab = _word_tokenizer(tmp_path / "tok")
  one = prepare.prepare([str(p) for p in inputs], str(tmp_path / "tok" / "tokenizer.json"), tmp_path / "one",
                        shards=2, workers=1, progress=False)
  two = prepare.prepare([str(p) for p in inputs], str(tmp_path / "tok"), tmp_path / "two", shards=2, workers=2,
                        progress=False)
  assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]]
  assert (one["vocab_size"], one["eos_id"], one["tokenizer"]["eos_token"]) == (vocab, 1, "<end>")
  expected = [tok.encode(d).ids + [1] for d in docs]
  assert one["tokens"] == sum(map(len, expected)) and one["documents"] == len(docs)
  opened = shards.open_folder(tmp_path / "one", 264)
  got = [np.asarray(t[o[i]:o[i + 1]]).tolist() for t, o in zip(opened.tokens, opened.offsets)
         for i in range(len(o) - 1)]
  assert got == expected[0::2] + expected[1::2]


def test_chunks_split_long_documents_into_consecutive_pairs():
  doc = np.arange(100, 115, dtype=np.uint32)  # 15 tokens: 14 pairs → chunks of 6, 6, 2
  short = np.array([7, 8], np.uint32)
  docs = sources.Documents("t", (np.concatenate([short, doc]),), (np.array([0, 2, 17]),), 264, None, "t")
  chunks = sources.DocumentChunks(docs, 6)
  assert len(chunks) == 4
  np.testing.assert_array_equal(chunks[0], [[7, 8, 1]])
  np.testing.assert_array_equal(chunks[2], np.stack([doc[6:12], doc[7:13], np.ones(6)], 1))
  np.testing.assert_array_equal(chunks[3], np.stack([doc[12:14], doc[13:15], np.ones(2)], 1))
  # with a loss mask (chat data) the weight of a pair is its target token's mask
  mask = np.array([0, 1] + [0] * 8 + [1] * 7, np.uint8)
  masked = sources.DocumentChunks(dataclasses.replace(docs, masks=(mask,)), 6)
  np.testing.assert_array_equal(masked[0][:, 2], [1])
  np.testing.assert_array_equal(masked[2][:, 2], [0, 1, 1, 1, 1, 1])  # targets at 9..14
  np.testing.assert_array_equal(masked[3][:, 2], [1, 1])


def test_packing_segments_positions_and_loss_mask():
  docs = [np.array(d, np.int32) for d in ([10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34, 35])]
  weights = [[1, 1, 1], [1], [0, 0, 1, 1, 0]]  # the last document's targets 31, 32 and 35 are not trained on
  chunks = [{"tokens": np.stack([d[:-1], d[1:], w], 1), "index": j} for j, (d, w) in enumerate(zip(docs, weights))]
  rows = list(batches.pack(grain.MapDataset.source(chunks).to_iter_dataset(), seq_len=6, bins=2, source=1))
  assert len(rows) == 2
  expected = [
      dict(inputs=[10, 11, 12, 20, 0, 0], targets=[11, 12, 13, 21, 0, 0], segment_ids=[1, 1, 1, 2, 0, 0],
           positions=[0, 1, 2, 0, 0, 0], loss_mask=[1, 1, 1, 1, 0, 0], _index=1, _source=1),
      dict(inputs=[30, 31, 32, 33, 34, 0], targets=[31, 32, 33, 34, 35, 0], segment_ids=[1, 1, 1, 1, 1, 0],
           positions=[0, 1, 2, 3, 4, 0], loss_mask=[0, 0, 1, 1, 0, 0], _index=2, _source=1)]
  for row, want in zip(rows, expected):
    assert set(row) == set(want)
    for key, value in want.items():
      np.testing.assert_array_equal(row[key], value, err_msg=key)


def test_packed_row_forward_equals_documents_run_separately():
  cfg = load_config("tiny-v3")
  model = nnx.jit(lambda: model_lib.build(cfg.model, seed=3))()  # compiled: faster than eager init
  forward = nnx.jit(lambda m, *args: m(*args))
  rng = np.random.default_rng(0)
  docs = [rng.integers(1, cfg.model.vocab_size, n).astype(np.int32) for n in (8, 5, 10)]
  chunks = [{"tokens": np.stack([d[:-1], d[1:], np.ones_like(d[1:])], 1), "index": j} for j, d in enumerate(docs)]
  (row,) = list(batches.pack(grain.MapDataset.source(chunks).to_iter_dataset(), seq_len=24, bins=1))
  packed_TV = forward(model, row["inputs"][None], row["positions"][None], row["segment_ids"][None])[0]
  # Each document alone in its own row from position 0 (zeros after it cannot reach it through causal attention).
  alone_BT = np.zeros((len(docs), 9), np.int32)
  for b, doc in enumerate(docs):
    alone_BT[b, :len(doc) - 1] = doc[:-1]
  alone_BTV = forward(model, alone_BT)
  for s, doc in enumerate(docs, 1):
    np.testing.assert_allclose(packed_TV[row["segment_ids"] == s], alone_BTV[s - 1, :len(doc) - 1], atol=2e-5,
                               rtol=1e-4)
  assert row["loss_mask"].sum() == sum(len(d) - 1 for d in docs)


def test_process_shards_are_disjoint_and_cover_every_document(tmp_path):
  texts = _unique_docs(tmp_path, "d", 400)
  docs = shards.open_folder(tmp_path / "d", 264)
  n = len(sources.DocumentChunks(docs, 40))  # every document fits one chunk
  seen = []
  for p in range(4):
    stream = batches.chunk_stream(docs, 40, seed=5, start=0, index=p, count=4)
    first_epoch = [stream[k] for k in range(len(range(p, n, 4)))]
    assert all(e["index"] == p + 4 * k for k, e in enumerate(first_epoch))
    seen += [bytes(np.append(e["tokens"][:, 0], e["tokens"][-1, 1]).astype(np.uint8)) for e in first_epoch]
  assert sorted(seen) == sorted(t.encode() + b"\0" for t in texts)
  cfg = _cfg(tmp_path / "d", "train.seq_len=40", "train.batch_size=4")
  firsts = [_segments(next(iter(batches.make_dataset(cfg, p, 4)))) for p in range(4)]
  assert len({piece for pieces in firsts for piece in pieces}) == sum(map(len, firsts))  # no document twice
  one = batches.chunk_stream(docs, 40, seed=5, start=0, index=0, count=1)
  epochs = [[one[e * n + k]["tokens"].tobytes() for k in range(n)] for e in range(2)]
  assert sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1]  # reshuffled each epoch


def test_batches_keep_pairs_inside_documents(tmp_path):
  texts = _unique_docs(tmp_path, "d", 40, "x")
  cfg = _cfg(tmp_path / "d", "train.seq_len=16", "train.batch_size=4", "data.pack_bins=3")
  whole = {t.encode() + b"\0" for t in texts}
  for batch in _take(iter(batches.make_dataset(cfg)), 6):
    np.testing.assert_array_equal(batch["loss_mask"], batch["segment_ids"] > 0)
    assert all(any(piece in doc for doc in whole) for piece in _segments(batch))


def _state_roundtrip(it):
  return json.loads(json.dumps(it.get_state()))


def test_resume_gives_exactly_the_uninterrupted_batches(tmp_path):
  _unique_docs(tmp_path, "a", 30, "a")
  _unique_docs(tmp_path, "b", 20, "b", seed=1)
  cfg = _cfg([tmp_path / "a", tmp_path / "b"], "train.seq_len=16", "train.batch_size=4", "data.weights=[2,1]",
             "data.pack_bins=3", "data.prefetch=3")
  layout = Layout(0, 1, 4)
  it = batches.pipeline_iterator(cfg, layout)
  _take(it, 5)
  state = _state_roundtrip(it)
  expected = _take(it, 7)
  resumed = batches.pipeline_iterator(cfg, layout)
  _take(resumed, 2)  # a used iterator is rewound too
  resumed.set_state(state)
  for want, got in zip(expected, _take(resumed, 7)):
    assert set(got) == set(batches.BATCH_KEYS)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_resume_through_orbax_with_global_batches(tmp_path):
  import orbax.checkpoint as ocp

  _unique_docs(tmp_path, "d", 50)
  cfg = _cfg(tmp_path / "d", "train.seq_len=16", "train.batch_size=8")
  mesh = mesh_lib.make_mesh(cfg)
  stream = batches.GlobalBatches(cfg, mesh)
  first = next(stream)
  assert first["inputs"].shape == (8, 16) and first["inputs"].sharding == stream.shardings["inputs"]
  local = next(iter(batches.make_dataset(cfg)))
  for key in batches.BATCH_KEYS:
    np.testing.assert_array_equal(np.asarray(first[key]), local[key])
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    manager.save(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(stream.iterator)))
    manager.wait_until_finished()
    expected = [jax.device_get(b) for b in _take(stream, 3)]
    fresh = batches.GlobalBatches(cfg, mesh)
    manager.restore(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh.iterator)))
  for want, got in zip(expected, _take(fresh, 3)):
    for key in batches.BATCH_KEYS:
      np.testing.assert_array_equal(np.asarray(got[key]), want[key], err_msg=key)


def test_resplit_state_across_process_counts(tmp_path):
  _unique_docs(tmp_path, "d", 1000)
  cfg = _cfg(tmp_path / "d", "train.seq_len=40", "train.batch_size=8", "data.pack_bins=2")
  old = [batches.pipeline_iterator(cfg, Layout(p, 4, 2)) for p in range(4)]
  seen_before = {piece for it in old for b in _take(it, 3) for piece in _segments(b)}
  states = [_state_roundtrip(it) for it in old]
  new = batches.pipeline_iterator(cfg, Layout(1, 2, 4))
  with pytest.raises(UserError, match="states of all 4 old data shards"):
    new.set_state(states[1])
  new.set_state(states)
  start = max(s["frontier"][0] for s in states) + 1
  assert new.starts == [start]
  after = [piece for b in _take(new, 3) for piece in _segments(b)]
  assert not seen_before & set(after)  # nothing is read twice within the epoch
  assert new.get_state()["frontier"][0] >= start


def test_mixture_follows_weights(tmp_path):
  _unique_docs(tmp_path, "a", 60, "a")
  _unique_docs(tmp_path, "b", 60, "b", seed=1)
  for weights, share in (("[3,1]", 0.75), ("[1,4]", 0.2)):
    cfg = _cfg([tmp_path / "a", tmp_path / "b"], "train.seq_len=24", "train.batch_size=8", f"data.weights={weights}")
    rows = [row for b in _take(iter(batches.make_dataset(cfg)), 25) for row in b["inputs"]]
    first = [chr(r[0]) for r in rows]
    assert set(first) <= {"a", "b"}
    assert abs(first.count("a") / len(rows) - share) <= 0.02  # rows of source a: share ± 0.02


def test_synthetic_and_stdlib_sources_keep_working():
  cfg = load_config("tiny-v3", "train.batch_size=8")
  (batch,) = _take(iter(batches.make_dataset(cfg, 1, 2)), 1)
  record = sources.SyntheticSource(cfg.model.vocab_size, cfg.train.seq_len + 1, cfg.data.seed)[3]
  np.testing.assert_array_equal(batch["inputs"][1], record[:-1])  # row 1 of shard 1 of 2 is record 3
  np.testing.assert_array_equal(batch["segment_ids"], 1)
  cfg = load_config("tiny-v3", "data.source=python-stdlib", "data.max_bytes=100000")
  batch = next(iter(batches.make_dataset(cfg)))
  assert all(piece.endswith(b"\0") or len(piece) == 25 for piece in _segments(batch))


def test_an_installed_package_is_a_corpus_pinned_by_its_version():
  """data.source=python-package:NAME: the package's own .py files (tests left out), sorted by their path inside
  it, one document each; its name carries the version and its fingerprint the bytes' sha256, so a run names the
  corpus it read and two machines with the same lock read the same one."""
  import importlib.metadata
  import jax as package

  docs = sources.python_package_documents("jax", 300_000)
  root = Path(package.__file__).parent
  files = sorted((p for p in root.rglob("*.py") if not {"test", "tests"} & set(p.relative_to(root).parts)),
                 key=lambda p: p.relative_to(root).as_posix())
  read = bytes(docs.tokens[0].astype(np.uint8))  # the last file cut at the budget, then its end of document
  text = b"".join(p.read_bytes().replace(b"\0", b"") + b"\0" for p in files)[:len(read) - 1]
  assert docs.name == f"python-package:jax=={importlib.metadata.version('jax')}"
  assert read == text + b"\0" and 300_000 <= len(read) and docs.fingerprint.startswith(docs.name + ":")
  assert sources.python_package_documents("jax", 300_000).fingerprint == docs.fingerprint
  cfg = load_config("tiny-v3", "data.source=python-package:jax", "data.max_bytes=100000")
  assert all(piece.endswith(b"\0") or len(piece) == 25 for piece in _segments(next(iter(batches.make_dataset(cfg)))))
  with pytest.raises(UserError, match="no installed package named 'no_such_package_x'"):
    batches.open_sources(load_config("tiny-v3", "data.source=python-package:no_such_package_x"))


def test_bad_inputs_give_one_line_errors(tmp_path):
  _unique_docs(tmp_path, "d", 10)
  cases = [(lambda: batches.open_sources(_cfg(tmp_path / "missing")), "missing not found"),
           (lambda: batches.open_sources(_cfg(tmp_path / "d", "model.vocab_size=200")), "manifest.json"),
           (lambda: prepare.prepare([str(tmp_path / "d")], "byte", tmp_path / "d2", progress=False), "is a folder without .arrow or .parquet files"),
           (lambda: prepare.prepare([str(tmp_path / "d.jsonl")], "byte", tmp_path / "d", progress=False),
            "--overwrite")]
  (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": 3}\n')
  cases.append((lambda: prepare.prepare([str(tmp_path / "bad.jsonl")], "byte", tmp_path / "x", progress=False),
                "bad.jsonl:2"))
  with open(tmp_path / "d" / "shard-00001.tokens", "r+b") as f:
    f.write(b"\xff")
  cases.append((lambda: batches.open_sources(_cfg(tmp_path / "d")), "shard-00001.tokens does not match"))
  for fn, words in cases:
    with pytest.raises(UserError, match=words) as e:
      fn()
    assert "\n" not in str(e.value)


def test_prepare_refuses_inputs_without_documents_or_text_and_keeps_prepared_data(tmp_path):
  """Empty inputs and bytes that are not UTF-8 (named by file and offset) end in one line; an --overwrite of
  prepared data that fails halfway leaves that data as it was."""
  _unique_docs(tmp_path, "d", 10)
  before = {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()}
  (tmp_path / "empty.txt").write_bytes(b"")
  (tmp_path / "blank.jsonl").write_text("\n\n{\"text\": \"\"}\n")
  (tmp_path / "good.txt").write_text("fine text")
  (tmp_path / "latin1.txt").write_bytes("caf\u00e9 ok".encode("utf-8") + b" na\xefve")
  (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "a\xff"}\n')
  cases = [(["empty.txt"], r"holds no document \(the files are empty\)"),
           (["empty.txt", "blank.jsonl"], "holds no document .* have no text"),
           (["good.txt", "latin1.txt"], r"latin1.txt is not UTF-8 text: byte offset 11 \(0xef\)"),
           (["bad.jsonl"], r"bad.jsonl is not UTF-8 text: byte offset 26 \(0xff\)")]
  for names, words in cases:
    with pytest.raises(UserError, match=words) as e:
      prepare.prepare([str(tmp_path / n) for n in names], "byte", tmp_path / "d", overwrite=True, progress=False)
    assert "\n" not in str(e.value)
    assert {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()} == before  # untouched
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging left
  prepare.prepare([str(tmp_path / "good.txt")], "byte", tmp_path / "d", overwrite=True, progress=False)
  assert shards.read_manifest(tmp_path / "d")["documents"] == 1
  assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["manifest.json", "shard-00000.index",
                                                                 "shard-00000.tokens"]



@pytest.mark.parametrize("where", ["manifest", "swap"])
def test_an_interrupted_overwrite_keeps_the_old_data(tmp_path, monkeypatch, where):
  """Ctrl-C while --overwrite publishes the new shards (as the manifest is written, or between moving the old
  folder aside and the new one in): the old prepared data is still there, whole, and reads as before; a file the
  user kept in the folder survives a finished overwrite."""
  _unique_docs(tmp_path, "d", 10)
  (tmp_path / "d" / "NOTES.txt").write_text("mine")
  before = shards.read_manifest(tmp_path / "d")
  (tmp_path / "new.txt").write_text("new text")
  real_write, real_replace = shards.write_manifest, prepare.os.replace

  def interrupted_write(folder, manifest):
    raise KeyboardInterrupt

  def interrupted_replace(src, dst):
    if Path(src).name.startswith(".d.partial"):  # the old folder is aside, the new one not yet in
      raise KeyboardInterrupt
    return real_replace(src, dst)

  if where == "manifest":
    monkeypatch.setattr(shards, "write_manifest", interrupted_write)
  else:
    monkeypatch.setattr(prepare.os, "replace", interrupted_replace)
  with pytest.raises(KeyboardInterrupt):
    prepare.prepare([str(tmp_path / "new.txt")], "byte", tmp_path / "d", overwrite=True, progress=False)
  monkeypatch.setattr(shards, "write_manifest", real_write)
  monkeypatch.setattr(prepare.os, "replace", real_replace)
  kept = tmp_path / "d" if (tmp_path / "d" / "manifest.json").exists() else next(tmp_path.glob(".d.old-*"))
  assert shards.read_manifest(kept) == before
  assert shards.open_folder(kept, 300).num_documents == 10
  prepare.prepare([str(tmp_path / "new.txt")], "byte", tmp_path / "e", progress=False)
  prepare.prepare([str(tmp_path / "new.txt")], "byte", tmp_path / "e", overwrite=True, progress=False)
  if where == "manifest":  # a finished overwrite of d keeps the user's file
    prepare.prepare([str(tmp_path / "new.txt")], "byte", tmp_path / "d", overwrite=True, progress=False)
    assert (tmp_path / "d" / "NOTES.txt").read_text() == "mine"
    assert shards.read_manifest(tmp_path / "d")["documents"] == 1

def test_prepare_cli_exits_2_with_one_line(tmp_path, run_env):
  out = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--input", str(tmp_path / "no*"),
                        "--tokenizer", "byte", "--out", str(tmp_path / "o")], capture_output=True, text=True,
                       env=run_env, timeout=60)
  assert out.returncode == 2 and out.stderr.count("\n") == 1 and "matches no file" in out.stderr
  (tmp_path / "a.txt").write_text("some text")
  out = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--input", str(tmp_path / "a.txt"),
                        "--tokenizer", "byte", "--out", str(tmp_path / "o"), "--workers", "0"], capture_output=True,
                       text=True, env=run_env, timeout=60)
  assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--workers 0 must be ≥ 1" in out.stderr
  assert not (tmp_path / "o").exists()


def test_worker_processes_resume_exactly(tmp_path):
  _unique_docs(tmp_path, "d", 200, "w")
  cfg = _cfg(tmp_path / "d", "train.seq_len=16", "train.batch_size=4", "data.worker_count=1")
  chunks = sources.DocumentChunks(shards.open_folder(tmp_path / "d", 264), 16)
  assert len(pickle.dumps(chunks)) < chunks.docs.tokens[0].nbytes  # workers get file names, not the data
  it = batches.pipeline_iterator(cfg, Layout(0, 1, 4))
  _take(it, 2)
  state = _state_roundtrip(it)
  expected = _take(it, 3)
  resumed = batches.pipeline_iterator(cfg, Layout(0, 1, 4))
  resumed.set_state(state)
  for want, got in zip(expected, _take(resumed, 3)):
    for key in want:
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  it.close()
  resumed.close()
