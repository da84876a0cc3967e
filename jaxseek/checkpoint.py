"""Checkpoints: Orbax CheckpointManager, async by default; exact resume, restore onto any mesh, integrity checks.

Layout of `<run_dir>/checkpoints/<step>/` (one Orbax composite per step; a save that did not finish stays in a
`*.orbax-checkpoint-tmp` folder, which resume ignores):

  state      one Orbax PyTree of every array:
               params     the model parameters (pure dict)          } all a converted checkpoint holds
               biases     the MoE correction biases (pure dict)     } (biases only for models with them)
               opt_state  the optimiser state
               train      {step, loss window} of the train state
  data       the data-iterator state of every process (Grain, one JSON per process)
  config     the resolved config (JSON)

All arrays are one item because every Orbax item costs the training loop time in each save (its own futures
and threads): one item instead of four halves the part of an async save that blocks. Loading parameters only
(fine-tuning, conversion) restores part of that tree.

Arrays are restored into the abstract state of the current mesh (ShapeDtypeStruct with the new shardings),
so a checkpoint written on one mesh shape resumes on another. The gradient-compression state follows the run,
not the checkpoint (`carry_plan`): the error-feedback residuals [data, ...] keep their sum over shards across
another data size or method, start at zero or are dropped where one side has none, and PowerSGD bases are kept
at the same rank (they do not depend on the data size) and start afresh otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from jaxseek import config as config_lib
from jaxseek.errors import UserError
from jaxseek.pipeline import stages as pipeline
from jaxseek.sharding import compression, rules

ITEMS = ("state", "data", "config")
STATE_PARTS = ("params", "biases", "opt_state", "train")
# Settings whose value decides which arrays the optimiser or train state holds: a resume that changes one is
# refused naming it (gradient clipping's state, the loss window's length).
STATE_SHAPING_KEYS = ("optim.clip_norm", "train.spike_window")
# The advice after a read that failed on the files themselves (a setting that does not match is named before
# anything is read): nothing on disk is changed, and nothing is to be deleted.
UNREADABLE = ("its files are incomplete or corrupt (nothing on disk was changed); restore them from a copy, or move "
              "that step folder out of checkpoints/ to resume from the step before")
# Orbax splits each replicated array's write across its replicas; every distinct slice shape costs a compile,
# which on a first save of many small arrays blocks training for seconds. Only arrays whose per-replica slice
# is at least this large are split; smaller ones are written by one replica.
MIN_REPLICA_SLICE_BYTES = 64 << 20


@functools.lru_cache(maxsize=None)  # once per process
def _register_array_handler() -> None:
  """jax.Array's Orbax handler with MIN_REPLICA_SLICE_BYTES. Replacing the default on purpose, so Orbax's
  warning that a handler is being overridden (one absl WARNING line in every run) is not logged."""
  from absl import logging as absl_logging
  # orbax has no public name for the Store its default handler uses (pyproject bounds orbax to the tested minor)
  from orbax.checkpoint._src.metadata import array_metadata_store
  handler = ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
                                           array_metadata_store=array_metadata_store.Store())
  verbosity = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.ERROR)
  try:
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
  finally:
    absl_logging.set_verbosity(verbosity)


def to_pure(tree: Any) -> Any:
  """Replaces every nnx Variable by its value (Orbax stores plain arrays)."""
  return jax.tree.map(lambda v: v.get_value() if rules.is_variable(v) else v, tree, is_leaf=rules.is_variable)


def from_pure(template: Any, pure: Any) -> Any:
  """Puts the values of `pure` back into the Variables of `template` (same structure)."""
  return jax.tree.map(lambda t, v: t.replace(v) if rules.is_variable(t) else v, template, pure,
                      is_leaf=rules.is_variable)


def abstract_with_shardings(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs carrying the current mesh's shardings: the restore target."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), to_pure(abstract),
                      to_pure(shardings))


def checkpoint_dir(path: str | Path) -> Path:
  """The `checkpoints/` folder of a run directory, or the folder itself when given directly."""
  path = Path(path)
  return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def _background_failure(record: logging.LogRecord) -> bool:
  """False for Orbax's log of a background save that failed (a traceback of some 100 lines): the failure itself is
  raised again at the next save or wait (`Checkpointer.saving`), and said there in one line."""
  return not any(text in str(record.msg) for text in ("in background save thread", "Save Finalize thread"))


class Checkpointer:
  """Saves and restores the train state, the data iterator and the config of one run."""

  def __init__(self, cfg: config_lib.Config, directory: str | Path, *, read_only: bool = False):
    _register_array_handler()
    logging.getLogger("absl").addFilter(_background_failure)  # a filter added twice is kept once
    self.cfg = cfg
    self.read_only = read_only  # another run's checkpoints (checkpoint.load_from)
    self.directory = checkpoint_dir(directory).absolute()
    # each step's folder is made in the calling thread: Orbax's background folder-making thread, when it fails
    # (a folder that became unwritable), leaves the threads waiting for it, and the save, hung for ever
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.checkpoint.keep, keep_period=cfg.checkpoint.keep_every or None,
        enable_async_checkpointing=cfg.checkpoint.async_save, create=not read_only, read_only=read_only,
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, data_iterator: Any | None) -> float:
    """Starts writing a checkpoint of `state` (TrainState) at `step`; returns the seconds the caller was blocked."""
    start = time.perf_counter()
    arrays = dict(params=to_pure(state.params), opt_state=to_pure(state.opt_state),
                  train=to_pure(_train_fields(state)))
    if jax.tree.leaves(state.biases):  # models without correction biases have none
      arrays["biases"] = to_pure(state.biases)
    stages, repeats, shape = pipeline.layout(self.cfg, _pipeline_size(state.params))
    saved_config = {**config_lib.to_dict(self.cfg),  # and the layer order it is stored in
                    "storage": {"pipeline_stages": stages, "pipeline_repeats": repeats, "pipeline_shape": shape}}
    items = dict(state=ocp.args.PyTreeSave(arrays), config=ocp.args.JsonSave(saved_config))
    if data_iterator is not None:
      import grain
      items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
    with self.saving(step):
      self.manager.check_for_errors()  # the previous save's background write
      check_writable(self.directory, "checkpoints")  # before Orbax starts a save it cannot finish
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    return time.perf_counter() - start

  @contextlib.contextmanager
  def saving(self, step: int | None):
    """A save, or the wait for one, that fails ends the run with one line; the committed steps stay."""
    try:
      yield
    except Exception as e:  # noqa: BLE001 — Orbax and TensorStore raise what the file system raised
      with contextlib.suppress(Exception):  # a save still in flight finishes, or fails, before the steps are read
        self.manager.wait_until_finished()
      kept = sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())
      what = f"saving step {step}" if step is not None else "finishing the last save"
      why = str(e).split(": ", 1)[1] if isinstance(e, UserError) else _innermost_line(e)
      raise UserError(f"checkpoint: {what} in {self.directory} failed ({why}); the committed steps "
                      f"{kept or '(none)'} are kept: make the folder writable (or free space) and run the same "
                      f"command to resume") from None

  def saved_config(self, step: int) -> dict:
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 — any unreadable metadata is a user-facing integrity error
      raise UserError(f"checkpoint {self.directory / str(step)} has no readable config ({type(e).__name__}); "
                      + UNREADABLE) from None
    return restored["config"]

  def check_compatible(self, step: int) -> dict:
    """Refuses a checkpoint written for another model, naming the first key that differs; returns its config.
    Loading another run's checkpoint (load_from) may change the RoPE settings: positions and frequencies are
    not parameters, and a longer context with YaRN scaling is how a model is extended (docs/context.md)."""
    saved = self.saved_config(step)
    current = config_lib.to_dict(self.cfg)
    free = set(config_lib.EXECUTION_KEYS)  # kernels and exchanges: the same arrays on every platform
    if self.read_only:
      free |= {"rope_scaling", "max_position_embeddings"}
    for section in ("model",):
      for key, value in current[section].items():
        if key in free:
          continue
        # a key the checkpoint does not name is newer than it: the run that wrote it had the key's default
        old = saved.get(section, {}).get(key, getattr(config_lib.ModelConfig, key, None))
        if old != value and not (isinstance(value, tuple) and list(value) == old):
          raise UserError(f"checkpoint {self.directory / str(step)} was written for {section}.{key}={old!r} but this "
                          f"run has {section}.{key}={value!r}; use a matching config or another train.run_dir")
    return saved

  def restore(self, step: int, abstract_state: Any, shardings: Any, data_iterator: Any | None, *,
              params_only: bool = False) -> Any:
    """The TrainState at `step`, placed on the current mesh (params and biases only when `params_only`)."""
    saved = self.check_compatible(step)
    source = pipeline.saved_layout(saved)
    targets = {name: abstract_with_shardings(getattr(abstract_state, name), getattr(shardings, name))
               for name in ("params", "biases", "opt_state")}
    names = ("params", "biases") if params_only else STATE_PARTS
    names = tuple(n for n in names if n != "biases" or jax.tree.leaves(abstract_state.biases))
    target = pipeline.layout(self.cfg, _pipeline_size(shardings.params))
    resized = pipeline.resized_stacks(self.cfg.model, source, target)
    saved_arrays = self.saved_arrays(step)
    for name in ("params", "biases"):  # a config that does not describe its arrays: named before Orbax reads
      if name in names and (what := _shape_mismatch(targets[name], saved_arrays.get(name), resized)):
        raise UserError(f"checkpoint {self.directory / str(step)} holds {name} {what}: it was written for another "
                        f"model than its saved config says; use a matching config or another train.run_dir")
    plan = None
    if not params_only:
      train_target = abstract_with_shardings(_train_fields(abstract_state), _train_fields(shardings))
      plan = carry_plan(saved, dict(saved_arrays.get("train") or {}), train_target, self.cfg.train.grad_compression)
      targets["train"] = plan.target(train_target)
      resized += plan.loosened
    for name in ("opt_state", "train"):  # a state another optimiser or train setting shapes: named, not read
      if name in names and (what := _structure_difference(targets[name], saved_arrays.get(name), resized,
                                                          partial=name == "train" and plan.partial)):
        raise UserError(self._state_differs(step, saved, name, what))
    items = {"state": restore_args({n: targets[n] for n in names}, partial=params_only or plan.partial,
                                   resized=resized)}
    resplit = None
    if data_iterator is not None and not params_only:
      resplit = self._data_states_if_resplit(step)
      if resplit is None:
        import grain
        items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
    with reading(f"checkpoint {self.directory / str(step)} cannot be restored",
                 UNREADABLE):
      arrays = self.manager.restore(step, args=ocp.args.Composite(**items))["state"]
    if resplit is not None:  # another process count wrote it: every old process's state re-splits the data
      data_iterator.set_state(resplit)
      data_iterator.start_prefetch()
      if jax.process_index() == 0:
        print(f"data: checkpoint written by {len(resplit)} processes, now {jax.process_count()}: the data streams "
              f"restart after the furthest point any old process reached (docs/data.md)", flush=True)
    arrays = _reorder(arrays, self.cfg.model, source, target)
    values = {n: from_pure(getattr(abstract_state, n), arrays[n]) if n in arrays else getattr(abstract_state, n)
              for n in ("params", "biases")}
    if params_only:
      return values
    values["opt_state"] = from_pure(abstract_state.opt_state, arrays["opt_state"])
    values.update(plan.finish(arrays["train"], train_target, abstract_state.params, self.cfg.train.seed))
    # the gradient residuals mirror the parameters: their Variables back, as the step's trees expect
    values["grad_residual"] = from_pure(abstract_state.grad_residual, values["grad_residual"])
    if (line := plan.line()) is not None and jax.process_index() == 0:
      print(line, flush=True)
    return dataclasses.replace(abstract_state, **values)

  def _state_differs(self, step: int, saved: dict, name: str, what: str) -> str:
    """The refusal of a checkpoint whose optimiser or train state this run's settings shape otherwise: the
    settings that differ from the saved config (those known to shape the state first), else the array."""
    where = self.directory / str(step)
    current = config_lib.to_dict(self.cfg)
    differ = [(f"{section}.{key}", saved.get(section, {}).get(key), value)
              for section in ("optim", "train") for key, value in current[section].items()
              if key in saved.get(section, {}) and saved[section][key] != value
              and not (isinstance(value, tuple) and list(value) == saved[section][key])]
    differ.sort(key=lambda d: d[0] not in STATE_SHAPING_KEYS)
    part = {"opt_state": "optimiser state", "train": "train state"}[name]
    if differ and differ[0][0] in STATE_SHAPING_KEYS:
      key, old, new = differ[0]
      return (f"checkpoint {where} holds the {part} of {key}={old!r} ({what}) and this run has {key}={new!r}, "
              f"which keeps another; resume with {key}={old!r}, or start a new train.run_dir from its weights with "
              f"checkpoint.load_from={self.directory.parent}")
    keys = ", ".join(f"{k}={o!r} (now {n!r})" for k, o, n in differ[:3])
    return (f"checkpoint {where} holds a {part} this run does not have ({what})" +
            (f"; its config differs in {keys}" if keys else "") +
            f"; resume with the config it was written with ({self.directory.parent / 'config.yaml'}), or start a "
            f"new train.run_dir from its weights with checkpoint.load_from={self.directory.parent}")

  def saved_arrays(self, step: int) -> dict:
    """The array metadata (shape, dtype) of every part of the train state saved at `step`."""
    with reading(f"checkpoint {self.directory / str(step)} has unreadable array metadata",
                 UNREADABLE):
      handler = ocp.PyTreeCheckpointHandler()
      try:
        tree = handler.metadata(self.directory / str(step) / "state").tree
      finally:
        handler.close()
    return dict(tree)

  def _data_states_if_resplit(self, step: int) -> list | None:
    """The data-iterator states of all old processes when their count differs from now; None when it matches."""
    files = sorted((self.directory / str(step) / "data").glob("process_*-of-*.json"),
                   key=lambda p: int(p.name.split("_")[1].split("-")[0]))
    if not files or int(files[0].stem.split("-of-")[1]) == jax.process_count():
      return None
    return [json.loads(p.read_text()) for p in files]

  def wait(self) -> None:
    with self.saving(None):
      self.manager.wait_until_finished()
      self.manager.check_for_errors()

  def close(self, *, failed: bool = False) -> None:
    """Waits for the last save and closes; `failed`: the run is ending on an error already said, so a save
    that fails too is not said again."""
    try:
      self.wait()
    except UserError:
      if not failed:
        raise
    finally:
      self.manager.close()


def check_writable(folder: Path, key: str) -> None:
  """Refuses a folder this process cannot write into, or create (its nearest existing parent), leaving nothing
  behind: one line instead of a save that fails in Orbax's background threads."""
  existing = Path(folder)
  while not existing.exists() and existing != existing.parent:
    existing = existing.parent
  if not existing.is_dir():
    raise UserError(f"{key}: {existing} is a file, not a folder; remove it or choose another train.run_dir")
  try:
    tempfile.TemporaryDirectory(dir=existing, prefix=".jaxseek-write-check-").cleanup()
  except OSError as e:
    raise UserError(f"{key}: cannot write into {existing} ({e.strerror}); make it writable or choose another "
                    f"train.run_dir") from None


def _pipeline_size(tree: Any) -> int:
  """The pipeline axis size of the mesh the leaves of `tree` (arrays or shardings) live on."""
  for leaf in jax.tree.leaves(tree):
    sharding = leaf if isinstance(leaf, jax.sharding.Sharding) else getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      return sharding.mesh.shape.get(pipeline.AXIS, 1)
  return 1


def _reorder(arrays: dict, model_cfg: config_lib.ModelConfig, source: pipeline.Layout,
             target: pipeline.Layout) -> dict:
  """Restored arrays from the layer order they were saved in to the one this run stores, one array at a time
  (sharding kept, the old array donated)."""
  stacks = pipeline.stack_sizes(model_cfg)

  def one(path, leaf):
    index = pipeline.reorder_index(path, stacks, source, target)
    if index is None:
      return leaf
    return jax.jit(lambda x: pipeline.take_rows(x, index), out_shardings=leaf.sharding, donate_argnums=0)(leaf)

  return jax.tree_util.tree_map_with_path(one, arrays)


def restore_args(target: dict, *, partial: bool, resized: tuple[str, ...] = ()) -> ocp.args.PyTreeRestore:
  """Restores the `state` item into `target` (ShapeDtypeStructs with shardings); `partial`: only the parts
  `target` names (parameters without the optimiser state). Leaves under the layer stacks named in `resized` may
  have been saved with another number of rows (pipeline padding): they are cut or zero-extended at the end, where
  padding always sits (pipeline/stages.py), and re-ordered after."""
  args = ocp.checkpoint_utils.construct_restore_args(target)
  if resized:
    def loosen(path, arg):
      names = {getattr(k, "key", None) for k in path}
      return dataclasses.replace(arg, strict=False) if names & set(resized) else arg
    args = jax.tree_util.tree_map_with_path(loosen, args)
  return ocp.args.PyTreeRestore(target, restore_args=args, partial_restore=partial)


def _train_fields(state: Any) -> dict[str, Any]:
  """The train state's own counters (everything but params, biases and optimiser state)."""
  return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
          if f.name not in ("params", "biases", "opt_state")}


# --- gradient compression across resumes -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CarryPlan:
  """What a resume makes of the checkpoint's gradient-compression state: the error-feedback residuals
  [shards, *param] (0 shards: none) and the PowerSGD bases [*stack, columns, rank] (rank 0: none), saved (old) and
  wanted by this run (new). Only the residuals' sum over shards enters the next step's sum, so it is kept:

    same size     kept as saved (an exact resume), whatever the method (each is what compression still owes);
    more shards   old shard i stays shard i, the new ones start at zero (Orbax zero-extends the saved rows);
    fewer shards  old shard i is added into new shard ⌊i · new / old⌋ (consecutive groups);
    none saved    zeros;   none wanted    dropped (what compression still owed is lost).

  Bases do not depend on the data size: kept at the same rank, drawn afresh (as a new run draws them) otherwise."""
  old_shards: int
  new_shards: int
  old_rank: int
  new_rank: int
  old_method: str
  new_method: str
  partial: bool  # the restore leaves saved entries out (residuals or bases this run does not take)
  saved_empty: frozenset = frozenset()  # entries saved as empty trees: restored as such where this run has none

  @property
  def keep_residual(self) -> bool:
    return bool(self.old_shards and self.new_shards)

  @property
  def keep_basis(self) -> bool:
    return self.old_rank == self.new_rank > 0

  @property
  def loosened(self) -> tuple[str, ...]:
    """Restore targets whose saved shape may differ from the target's: more shards than were saved."""
    return ("grad_residual",) if self.keep_residual and self.old_shards < self.new_shards else ()

  def target(self, train: dict) -> dict:
    """The restore target of the `train` part: this run's, with the saved residual shape where they fold."""
    train = dict(train)
    empty = lambda key: key in self.saved_empty and not jax.tree.leaves(train[key])  # {} on both sides
    if not self.keep_residual and not empty("grad_residual"):
      del train["grad_residual"]
    elif self.old_shards > self.new_shards:  # each device reads whole old rows: its group when the sizes divide
      def saved_shape(a):
        spec = a.sharding.spec
        split = spec[0] if self.old_shards % self.new_shards == 0 else None
        sharding = jax.sharding.NamedSharding(a.sharding.mesh, jax.sharding.PartitionSpec(split, *spec[1:]))
        return jax.ShapeDtypeStruct((self.old_shards, *a.shape[1:]), a.dtype, sharding=sharding)
      train["grad_residual"] = jax.tree.map(saved_shape, train["grad_residual"])
    if not self.keep_basis and not empty("grad_basis"):
      del train["grad_basis"]
    return train

  def finish(self, restored: dict, train: dict, abstract_params: Any, seed: int) -> dict:
    """The restored `train` part completed for this run (`train`: its full restore target): residuals folded,
    zeroed or dropped, bases kept or drawn afresh, each array made directly in its sharding."""
    out = dict(restored)
    shardings = lambda tree: jax.tree.map(lambda a: a.sharding, tree)
    if not self.new_shards:
      out["grad_residual"] = {}
    elif not self.keep_residual:
      zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), train["grad_residual"])
      out["grad_residual"] = jax.jit(zeros, out_shardings=shardings(train["grad_residual"]))()
    elif self.old_shards > self.new_shards:  # one leaf at a time, straight into its sharding
      fold = lambda x, a: jax.jit(lambda x: fold_shards(x, self.new_shards), out_shardings=a.sharding)(x)
      out["grad_residual"] = jax.tree.map(fold, restored["grad_residual"], train["grad_residual"])
    if not self.new_rank:
      out["grad_basis"] = {}
    elif not self.keep_basis:
      fresh = lambda: compression.init_basis(abstract_params, self.new_rank, seed)
      out["grad_basis"] = jax.jit(fresh, out_shardings=shardings(train["grad_basis"]))()
    return out

  def line(self) -> str | None:
    """One start-up line saying what happened, or None for an exact carry."""
    old, new = self.old_shards, self.new_shards
    residuals = f"the error-feedback residuals of {self.old_method} over data={old}"
    parts = []
    if self.keep_residual and old < new:
      parts.append(f"{residuals} carried into data={new} (shard i kept, shards {old}-{new - 1} start at zero: "
                   f"their sum is kept)")
    elif self.keep_residual and old > new:
      parts.append(f"{residuals} folded into data={new} (consecutive shards summed: their sum is kept)")
    elif self.keep_residual and self.old_method != self.new_method:
      parts.append(f"{residuals} kept for {self.new_method}")
    elif old:
      parts.append(f"{residuals} dropped ({_uncompressed_why(self.new_method)} now): the gradient they still "
                   f"held back is lost")
    elif new:
      parts.append(f"the error-feedback residuals of {self.new_method} over data={new} started at zero (the "
                   f"checkpoint has none: {_uncompressed_why(self.old_method)})")
    if self.new_rank and not self.keep_basis:
      parts.append(f"fresh PowerSGD bases of rank {self.new_rank}" +
                   (f" (the checkpoint's are rank {self.old_rank})" if self.old_rank else ""))
    elif self.old_rank and not self.new_rank:
      parts.append(f"the PowerSGD bases of rank {self.old_rank} dropped")
    elif self.keep_basis and parts:
      parts.append(f"the PowerSGD bases of rank {self.new_rank} kept (they do not depend on the data size)")
    return "resume: " + "; ".join(parts) if parts else None


def carry_plan(saved_config: dict, saved_train: dict, train: dict, method: str) -> CarryPlan:
  """The CarryPlan from the checkpoint's config and `train` array metadata to this run's `train` target."""
  first = lambda tree: next(iter(jax.tree.leaves(tree or {})), None)
  old_residual, new_residual = first(saved_train.get("grad_residual")), first(train["grad_residual"])
  old_basis, new_basis = first(saved_train.get("grad_basis")), first(train["grad_basis"])
  plan = CarryPlan(old_shards=old_residual.shape[0] if old_residual is not None else 0,
                   new_shards=new_residual.shape[0] if new_residual is not None else 0,
                   old_rank=old_basis.shape[-1] if old_basis is not None else 0,
                   new_rank=new_basis.shape[-1] if new_basis is not None else 0,
                   old_method=saved_config.get("train", {}).get("grad_compression", "none"), new_method=method,
                   partial=False, saved_empty=frozenset(k for k, v in saved_train.items() if not jax.tree.leaves(v)))
  left_out = set(saved_train) & (set(train) - set(plan.target(train)))
  return dataclasses.replace(plan, partial=bool(left_out))


def _shape_mismatch(target: Any, saved: Any, loose: tuple[str, ...]) -> str | None:
  """`path is (saved shape) there, (target shape) here` for the first leaf of `target` whose saved shape differs
  (leaves under the stacks in `loose` may: pipeline padding), else None."""
  shapes = {jax.tree_util.keystr(p): tuple(m.shape)
            for p, m in jax.tree_util.tree_leaves_with_path(saved or {}) if hasattr(m, "shape")}
  for path, leaf in jax.tree_util.tree_leaves_with_path(target):
    old = shapes.get(jax.tree_util.keystr(path))
    if old is not None and old != tuple(leaf.shape) and not {getattr(k, "key", None) for k in path} & set(loose):
      return f"{'/'.join(str(getattr(k, 'key', k)) for k in path)} as {old} where this model has {tuple(leaf.shape)}"
  return None


def _leaf_shapes(tree: Any) -> dict[tuple[str, ...], tuple[int, ...]]:
  """{path as names: shape} of every array leaf: an Orbax metadata tree and a restore target (named tuples there,
  dicts here) give the same paths."""
  name = lambda k: str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
  return {tuple(map(name, p)): tuple(leaf.shape) for p, leaf in jax.tree_util.tree_leaves_with_path(tree or {})
          if hasattr(leaf, "shape")}


def _structure_difference(target: Any, saved: Any, loose: tuple[str, ...], *, partial: bool) -> str | None:
  """Where the saved arrays of one part of the state differ from `target` in their paths or shapes (leaves under
  the stacks in `loose` may differ in shape: pipeline padding; `partial`: saved paths the target leaves out are
  fine), else None."""
  want, have = _leaf_shapes(target), _leaf_shapes(saved)
  show = lambda path: "/".join(path)
  for path, shape in want.items():
    if path not in have:
      return f"nothing at {show(path)}, which this run keeps"
    if have[path] != shape and not set(path) & set(loose):
      return f"{show(path)} as {have[path]} where this run has {shape}"
  extra = [p for p in have if p not in want]
  if extra and not partial:
    return f"{show(extra[0])}, which this run does not keep"
  return None


def _uncompressed_why(method: str) -> str:
  return "train.grad_compression=none" if method == "none" else f"{method} on one data shard compresses nothing"


def fold_shards(x_S: jax.Array, shards: int) -> jax.Array:
  """Per-shard residuals [old, ...] → [shards, ...] with the same sum: old shard i added into ⌊i · shards / old⌋."""
  old = x_S.shape[0]
  if old % shards == 0:  # consecutive groups, each on the devices of its new shard
    return x_S.reshape(shards, old // shards, *x_S.shape[1:]).sum(1)
  return jax.ops.segment_sum(x_S, jnp.arange(old) * shards // old, shards, indices_are_sorted=True)


# --- reading failures --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def reading(what: str, advice: str):
  """Orbax reading a checkpoint: any failure becomes one UserError line, `what (its innermost cause); advice`.
  A read that fails part-way leaves TensorStore reads in flight; when they complete they find Orbax's event loop
  closed and each prints an unraisable `RuntimeError: Event loop is closed` traceback (until the interpreter
  exits), and those that fail themselves are logged by asyncio as "Task exception was never retrieved". Those,
  and only those, are silenced while the read runs and, once it has failed, after it: the failed read's results
  are discarded anyway."""
  previous = sys.unraisablehook
  sys.unraisablehook = functools.partial(_quiet_closed_loop, previous)
  # a failing read's other reads fail too, in tasks nobody awaits: asyncio logs each one when it is collected,
  # which may be before the failure reaches this frame, so the filter is on from the start of the read
  asyncio_log = logging.getLogger("asyncio")
  asyncio_log.addFilter(_drop_unretrieved_task_errors)
  try:
    yield
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001 — Orbax and TensorStore raise bare Exceptions for unreadable data
    raise UserError(f"{what} ({_innermost_line(e)}); {advice}") from None  # the filter stays: more may come
  sys.unraisablehook = previous  # the read finished: nothing is left in flight
  asyncio_log.removeFilter(_drop_unretrieved_task_errors)


def _drop_unretrieved_task_errors(record: logging.LogRecord) -> bool:
  return not str(record.msg).startswith("Task exception was never retrieved")


def _quiet_closed_loop(previous: Any, unraisable: Any) -> None:
  if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
    return
  previous(unraisable)


def _innermost_line(e: BaseException) -> str:
  """The first line of the innermost explicit cause of `e` (TensorStore's message under Orbax's wrappers)."""
  while e.__cause__ is not None:
    e = e.__cause__
  return ((str(e).strip().splitlines() or [type(e).__name__])[0])[:240]
