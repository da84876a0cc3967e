"""The Grain pipeline and the assembly of global batches on the mesh.

Per source (a prepared folder, or python-stdlib):
  document chunks (sources.DocumentChunks) → global shuffle, reseeded each epoch → repeat → stream index j
  → this data shard's share j = start + i, start + i + n, ... (i of n shards) → first-fit packing into rows of
  train.seq_len with segment ids and positions
Then: mix the sources' rows by data.weights → batch the local rows → prefetch (a thread, or grain worker
processes) → GlobalBatches: jax.make_array_from_process_local_data in the batch sharding.
`synthetic` skips the documents: row j is seeded random tokens, one segment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxseek.config import Config
from jaxseek.errors import UserError
from jaxseek.input import holdout, shards
from jaxseek.input.sources import (PACKAGE_PREFIX, DocumentChunks, Documents, SyntheticSource, python_package_documents,
                                   python_stdlib_documents)
from jaxseek.input.state import PipelineIterator
from jaxseek.sharding.rules import activation_spec

BATCH_KEYS = ("inputs", "targets", "loss_mask", "positions", "segment_ids")
BATCH_NAMES = {k: ("batch", None) for k in BATCH_KEYS}


@dataclasses.dataclass(frozen=True)
class Layout:
  """Which rows of the global batch a pipeline produces: `rows` rows, data shard `shard_index` of `shard_count`."""

  shard_index: int
  shard_count: int
  rows: int


def source_names(cfg: Config) -> tuple[str, ...]:
  return (cfg.data.source,) if isinstance(cfg.data.source, str) else tuple(cfg.data.source)


def open_sources(cfg: Config, part: str = "train") -> list[Documents]:
  """The documents of every entry of data.source (empty for synthetic); checks vocabularies and checksums. With
  eval.source=holdout, `part` "train" leaves the held-out documents out, "eval" keeps only those."""
  docs = []
  for name in source_names(cfg):
    if name == "synthetic":
      continue
    if name == "python-stdlib" or name.startswith(PACKAGE_PREFIX):
      if cfg.model.vocab_size < 256:
        raise UserError(f"data.source={name} is byte-level and needs model.vocab_size ≥ 256, "
                        f"got {cfg.model.vocab_size}")
      docs.append(python_stdlib_documents(cfg.data.max_bytes) if name == "python-stdlib" else
                  python_package_documents(name[len(PACKAGE_PREFIX):], cfg.data.max_bytes))
    else:
      key = "eval.source" if part == "eval" and cfg.eval.source != "holdout" else "data.source"
      docs.append(shards.open_folder(name, cfg.model.vocab_size, cfg.data.verify_checksums, key))
  if cfg.eval.source == "holdout":
    docs = [holdout.split(d, cfg.eval.holdout, part) for d in docs]
  return docs


def eval_config(cfg: Config) -> Config:
  """The config whose data.source is what evaluation reads, read without prefetching (a held-out share without
  hashing the shards again: training's pipeline checks the same files)."""
  if cfg.eval.source == "holdout":
    data = dataclasses.replace(cfg.data, verify_checksums=False)
  else:
    data = dataclasses.replace(cfg.data, source=cfg.eval.source, weights=())
  return dataclasses.replace(cfg, data=dataclasses.replace(data, prefetch=0, worker_count=0))


def eval_batches(cfg: Config, mesh: Mesh) -> list[dict[str, jax.Array]]:
  """The fixed evaluation set: the first ⌈eval.tokens / (B·T)⌉ global batches of eval.source, packed as training
  packs (data.seed, from stream position 0), made once as global arrays on the mesh. Each chunk counts once: in
  a set smaller than that, what the stream repeats carries no loss (a line says so). A set with no loss token
  at all is refused."""
  ecfg = eval_config(cfg)
  B, T = cfg.train.batch_size, cfg.train.seq_len
  shardings = batch_shardings(mesh, cfg)
  layout = data_layout(shardings["inputs"], (B, T))
  docs = open_sources(ecfg, "eval")
  it = iter(make_dataset(ecfg, layout.shard_index, layout.shard_count, rows=layout.rows, docs=docs, once=True))
  local = [next(it) for _ in range(-(-cfg.eval.tokens // (B * T)))]
  batches = [{k: jax.make_array_from_process_local_data(shardings[k], b[k], (B, T)) for k in BATCH_KEYS}
             for b in local]
  tokens = sum(float(jax.jit(jnp.sum)(b["loss_mask"])) for b in batches)
  if not tokens:
    raise UserError(f"eval.source {_eval_name(cfg)} has no token the loss counts (every target masked or "
                    f"padding); evaluate on a folder of text or of chat data with responses")
  epochs = [len(DocumentChunks(d, T)) for d in docs]
  if any(int(i) >= epochs[int(src)] for b in local for i, src in zip(b["_index"], b["_source"])) and \
      jax.process_index() == 0:
    print(f"eval: {_eval_name(cfg)} holds fewer token positions than eval.tokens={cfg.eval.tokens:,}; each "
          f"document counts once ({tokens:,.0f} loss tokens)", flush=True)
  return batches


def _eval_name(cfg: Config) -> str:
  return f"holdout of {cfg.data.source}" if cfg.eval.source == "holdout" else str(cfg.eval.source)


def source_seed(seed: int, source: int) -> int:
  return (seed + 7919 * source) % 2**32


def chunk_stream(docs: Documents, seq_len: int, seed: int, start: int, index: int, count: int) -> grain.MapDataset:
  """This shard's chunks {"tokens": [n, 3], "index": j}: stream positions j = start + index + k·count of the
  shuffled, endlessly repeated chunks (epoch e is shuffled with seed + e)."""
  ds = grain.MapDataset.source(DocumentChunks(docs, seq_len)).shuffle(seed=seed).repeat()
  return ds.map_with_index(_tag)[start + index::count]


def _tag(index: int, tokens: np.ndarray) -> dict:
  return {"tokens": tokens, "index": index}


def pack(chunks: grain.IterDataset, seq_len: int, bins: int, source: int = 0,
         epoch: int | None = None) -> grain.IterDataset:
  """Chunks → rows of seq_len: first-fit over `bins` rows; segment ids 1, 2, ... per chunk (0 = padding),
  positions from 0 in each chunk, loss on every (input, target) pair whose weight is 1 and on no padding (and,
  with `epoch`, the number of chunks in one pass, on no chunk the stream repeats)."""
  packed = grain.experimental.FirstFitPackIterDataset(
      chunks, length_struct={"tokens": seq_len}, num_packing_bins=bins, shuffle_bins=False, meta_features=("index",))
  return packed.map(functools.partial(_packed_row, source=source, epoch=epoch))


def _packed_row(row: dict, source: int, epoch: int | None = None) -> dict[str, np.ndarray]:
  segment_ids = row["tokens_segment_ids"]
  counted = (segment_ids > 0) & (row["tokens"][:, 2] > 0)
  if epoch is not None:  # segment k (id k + 1) holds the chunk at stream position index[k]
    first = np.concatenate([[False], np.asarray(row["index"]).reshape(-1) < epoch])
    counted &= first[np.minimum(segment_ids, first.size - 1)]
  return {"inputs": row["tokens"][:, 0], "targets": row["tokens"][:, 1],
          "loss_mask": counted.astype(np.float32),
          "positions": row["tokens_positions"],
          "segment_ids": segment_ids, "_index": np.int64(max(row["index"])), "_source": np.int32(source)}


def _synthetic_rows(batch: dict) -> dict[str, np.ndarray]:
  tokens_BT1 = batch["tokens"]
  B, T = tokens_BT1.shape[0], tokens_BT1.shape[1] - 1
  return {"inputs": tokens_BT1[:, :-1], "targets": tokens_BT1[:, 1:], "loss_mask": np.ones((B, T), np.float32),
          "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
          "segment_ids": np.ones((B, T), np.int32), "_index": np.asarray(batch["index"], np.int64),
          "_source": np.zeros(B, np.int32)}


def make_dataset(cfg: Config, process_index: int = 0, process_count: int = 1, *, rows: int | None = None,
                 starts: list[int] | None = None, docs: list[Documents] | None = None,
                 once: bool = False) -> grain.IterDataset:
  """Data shard `process_index` of `process_count`: batches of `rows` (default batch_size / count) packed rows,
  numpy arrays keyed BATCH_KEYS plus, per row, "_index" (the highest stream position it holds) and "_source"
  (read by state.PipelineIterator). `starts`: per source, the stream position to begin at. `once`: the loss
  counts each chunk once (evaluation), none of what the stream repeats."""
  B, T, data = cfg.train.batch_size, cfg.train.seq_len, cfg.data
  if rows is None:
    if B % process_count:
      raise UserError(f"train.batch_size={B} must be divisible by the {process_count} data-loading processes")
    rows = B // process_count
  docs = open_sources(cfg) if docs is None else docs
  starts = list(starts or [0] * max(len(docs), 1))
  read = grain.ReadOptions(num_threads=0)  # chunks are memory slices; threads would only contend for the GIL
  if not docs:
    ds = grain.MapDataset.source(SyntheticSource(cfg.model.vocab_size, T + 1, data.seed)).map_with_index(_tag)
    ds = ds[starts[0] + process_index::process_count].batch(rows, drop_remainder=True).map(_synthetic_rows)
    ds = ds.to_iter_dataset(read)
  else:
    streams = [pack(chunk_stream(d, T, source_seed(data.seed, s), starts[s], process_index, process_count)
                    .to_iter_dataset(read), T, data.pack_bins, s, len(DocumentChunks(d, T)) if once else None)
               for s, d in enumerate(docs)]
    ds = streams[0] if len(streams) == 1 else grain.IterDataset.mix(streams, list(data.weights) or None)
    ds = ds.batch(rows, drop_remainder=True)
  if data.worker_count:
    _parse_absl_flags()
    options = grain.MultiprocessingOptions(num_workers=data.worker_count, per_worker_buffer_size=max(data.prefetch, 1))
    return ds.mp_prefetch(options)
  if data.prefetch:
    return grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=data.prefetch)
  return ds


def _parse_absl_flags() -> None:
  """Grain worker processes read absl flags, which fail unless the parent parsed them."""
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS(sys.argv[:1])


def batch_shardings(mesh: Mesh, cfg: Config | None = None) -> dict[str, NamedSharding]:
  """The global batch's shardings (with `cfg`: over the stages too only where the pipeline splits the batch)."""
  from jaxseek.pipeline import stages as pipeline_lib

  with pipeline_lib.batch_rules(cfg, dict(mesh.shape)) if cfg is not None else contextlib.nullcontext():
    return {k: NamedSharding(mesh, activation_spec(names)) for k, names in BATCH_NAMES.items()}


def data_layout(sharding: NamedSharding, global_shape: tuple[int, int]) -> Layout:
  """This process's rows of the global batch: one contiguous block, data shard = block index (processes that
  hold the same rows, e.g. across a tensor axis, read the same data)."""
  B = global_shape[0]
  blocks = sorted({idx[0].indices(B)[:2] for idx in sharding.addressable_devices_indices_map(global_shape).values()})
  lo, hi = blocks[0][0], blocks[0][1]
  for start, stop in blocks[1:]:
    if start > hi:
      raise UserError(f"this process holds rows {blocks} of the batch, not one contiguous block; put the "
                      f"batch axes (data, fsdp, expert) outermost across processes")
    hi = max(hi, stop)
  rows = hi - lo
  return Layout(lo // rows, B // rows, rows)


def pipeline_iterator(cfg: Config, layout: Layout) -> PipelineIterator:
  """This process's local batches as a checkpointable grain DatasetIterator (see state.py)."""
  docs = open_sources(cfg)
  data = {"sources": [d.fingerprint for d in docs] or [f"synthetic:{cfg.model.vocab_size}"],
          "seed": cfg.data.seed, "seq_len": cfg.train.seq_len}
  layout_state = {**dataclasses.asdict(layout), "pack_bins": cfg.data.pack_bins,
                  "worker_count": cfg.data.worker_count, "weights": list(cfg.data.weights)}

  def build(starts: list[int]) -> grain.IterDataset:
    return make_dataset(cfg, layout.shard_index, layout.shard_count, rows=layout.rows, starts=starts, docs=docs)

  return PipelineIterator(build, len(data["sources"]), data, layout_state, BATCH_KEYS)


class GlobalBatches:
  """Global batches on the mesh from this process's pipeline; `.iterator` is its grain DatasetIterator, whose
  state (get_state / set_state, grain.checkpoint.CheckpointSave / CheckpointRestore) resumes it exactly."""

  def __init__(self, cfg: Config, mesh: Mesh):
    self.shardings = batch_shardings(mesh, cfg)
    self.global_shape = (cfg.train.batch_size, cfg.train.seq_len)
    self.layout = data_layout(self.shardings["inputs"], self.global_shape)
    self.iterator = pipeline_iterator(cfg, self.layout)
    self.iterator.start_prefetch()  # overlap the first batches with compilation

  def __iter__(self) -> GlobalBatches:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    local = next(self.iterator)
    return {k: jax.make_array_from_process_local_data(self.shardings[k], local[k], self.global_shape)
            for k in BATCH_KEYS}

  def get_state(self) -> dict:
    return self.iterator.get_state()

  def set_state(self, state: dict | list[dict]) -> None:
    self.iterator.set_state(state)

  def close(self) -> None:
    self.iterator.close()


def global_batches(cfg: Config, mesh: Mesh):
  """Yields global batches (see GlobalBatches)."""
  yield from GlobalBatches(cfg, mesh)
