"""Training runs: the run directory, restore or initialise, the loop, the command line (the step: step.py).

python -m jaxseek.train --config FILE [section.key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from pathlib import Path

import jax

from jaxseek import config as config_lib
from jaxseek import input as input_lib
from jaxseek import checkpoint as checkpoint_lib
from jaxseek import metrics as metrics_lib
from jaxseek import faults
from jaxseek.evaluate import Evaluator
from jaxseek.errors import RunStopped, UserError, cli
from jaxseek.explore import predict as explore_predict
from jaxseek.explore import suggest as explore_suggest
from jaxseek.kernels import choice
from jaxseek.sharding import experts, gradsum
from jaxseek.sharding import mesh as mesh_lib
from jaxseek.pipeline import stages as pipeline_lib
from jaxseek.step import TrainState, Trainer, check_setup, compile_step, compression_summary, make_trainer


def prepare_run_dir(cfg: config_lib.Config) -> Path:
  run_dir = Path(cfg.train.run_dir)
  if jax.process_index() == 0:
    try:
      run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise UserError(f"cannot create train.run_dir={run_dir}: {e.strerror}; choose a writable folder") from None
    config_lib.dump(cfg, run_dir / "config.yaml")
  return run_dir


def restore_or_init(cfg: config_lib.Config, trainer: Trainer, ckpt: checkpoint_lib.Checkpointer | None,
                    batches: input_lib.GlobalBatches) -> TrainState:
  """Resumes from the run's latest complete checkpoint (`ckpt`: None when the run has none), else starts from
  `checkpoint.load_from`, else fresh."""
  step = ckpt.latest_step() if ckpt is not None else None
  if step is not None:
    state = ckpt.restore(step, trainer.abstract_state, trainer.state_shardings, batches.iterator)
    _log(f"resumed from step {step} ({ckpt.directory / str(step)})")
    return state
  if cfg.checkpoint.load_from is None:
    return trainer.init()
  source = Path(cfg.checkpoint.load_from)
  if not source.exists():
    raise UserError(f"checkpoint.load_from={source} does not exist; give a run directory or its checkpoints folder")
  other = checkpoint_lib.Checkpointer(cfg, source, read_only=True)
  step = other.latest_step()
  if step is None:
    raise UserError(f"checkpoint.load_from={source} holds no complete checkpoint")
  if cfg.checkpoint.load_mode == "full":
    state = other.restore(step, trainer.abstract_state, trainer.state_shardings, None)
  else:
    state = trainer.init().replace(**other.restore(step, trainer.abstract_state, trainer.state_shardings, None,
                                                   params_only=True))
  _log(f"loaded {cfg.checkpoint.load_mode} from {other.directory / str(step)}")
  other.close()
  return state


def _own_checkpoints(cfg: config_lib.Config) -> checkpoint_lib.Checkpointer | None:
  """The run directory's checkpoints (None when it has none yet); a folder saves could not be written to is
  refused here, before anything is written."""
  own = Path(cfg.train.run_dir) / "checkpoints"
  checkpoint_lib.check_writable(own, f"train.run_dir={cfg.train.run_dir}")
  return checkpoint_lib.Checkpointer(cfg, own) if own.is_dir() else None


def run(cfg: config_lib.Config) -> dict[str, float]:
  """mesh → data and evaluation set → run directory → state (restored or new) → loop. Returns the summary."""
  if jax.process_index() == 0:  # where W&B will log: a missing key is refused before anything is written
    metrics_lib.check_wandb(cfg)
  mesh = mesh_lib.make_mesh(cfg)
  print(mesh_lib.startup_line(mesh), flush=True)
  check_setup(cfg, mesh)  # before the run directory is touched
  trainer = make_trainer(cfg, mesh)
  batches = input_lib.GlobalBatches(cfg, mesh)  # the data (and the evaluation set) opened before it is, too
  # the state is restored before the run directory is written: a refused or unreadable checkpoint leaves it as it was
  ckpt = _own_checkpoints(cfg)
  try:
    evaluator = Evaluator(cfg, mesh, trainer) if cfg.eval.source else None
    state = restore_or_init(cfg, trainer, ckpt, batches)
    run_dir = prepare_run_dir(cfg)
  except BaseException:
    if ckpt is not None:
      ckpt.close(failed=True)
    batches.close()
    raise
  ckpt = ckpt or checkpoint_lib.Checkpointer(cfg, run_dir / "checkpoints")
  start = int(state.step)
  step_fn = faults.Aligned(compile_step(trainer, cfg, mesh), "train step", cfg.dist.init_timeout_s,
                           choice.compiler_options(cfg), compile=explore_predict.planner(cfg, mesh))
  # the model's own parameters and FLOPs, without the identity padding a pipeline may store
  logical = jax.eval_shape(lambda p: pipeline_lib.reorder(p, pipeline_lib.stack_sizes(cfg.model), pipeline_lib.layout(
      cfg, mesh.shape["pipeline"]), (1, 1)), trainer.abstract_state.params)
  flops_per_step = metrics_lib.flops_per_token(cfg, logical) * cfg.train.batch_size * cfg.train.seq_len
  peak, peak_source = metrics_lib.peak_tflops_per_device(cfg.metrics.peak_tflops)
  n_params = sum(x.size for x in jax.tree.leaves(logical))
  _log(f"jaxseek: {n_params / 1e6:.2f}M parameters | mesh {mesh_lib.describe(mesh)} | "
       f"{jax.device_count()} {jax.devices()[0].platform} devices | peak {peak:.3g} TFLOP/s/device ({peak_source})")
  _log(choice.summary(cfg, *choice.device_target(mesh.devices.flat[0]), tensor=mesh.shape["tensor"]))
  if mesh.shape["pipeline"] > 1:
    _log(pipeline_lib.summary(cfg, mesh.shape["pipeline"], dict(mesh.shape)))
  if cfg.model.is_moe:
    with jax.set_mesh(mesh):
      _log(experts.dispatch_summary(cfg, dict(mesh.shape), node=experts.node_shards(
          mesh, cfg.mesh.devices_per_node, experts.expert_axes(cfg.model))))
  _log(gradsum.summary(cfg, dict(mesh.shape)))
  if (line := compression_summary(cfg, trainer, mesh)) is not None:
    _log(line)
  reporter = metrics_lib.StepReporter(metrics_lib.Writer(run_dir, cfg), cfg, flops_per_step, peak)
  preemption, watchdog = faults.Preemption(), faults.Watchdog(cfg.train.step_timeout_s)
  profiler = metrics_lib.StepProfiler(cfg.metrics.profile_steps, run_dir / "profile")
  failed = True  # until the loop returns: a save failing at the end then is not said again
  try:
    with jax.set_mesh(mesh):
      state, stopped = _loop(cfg, step_fn, state, start, batches=batches, ckpt=ckpt, evaluator=evaluator,
                             reporter=reporter, preemption=preemption, watchdog=watchdog, profiler=profiler)
    failed = False
  finally:
    profiler.close()
    with watchdog.phase(watchdog.FINAL * cfg.train.step_timeout_s if cfg.train.step_timeout_s else None):
      ckpt.close(failed=failed)  # the last save finishing (with every process)
    watchdog.stop()
    preemption.restore()
    reporter.writer.close()
    batches.close()
  return _summary(cfg, reporter, start, stopped, run_dir)


def _loop(cfg, step_fn, state, start, *, batches, ckpt, evaluator, reporter, preemption, watchdog, profiler):
  """Steps start+1 … train.steps; evaluates and saves on schedule and at the end, saves on pre-emption. Returns
  (state, stopped)."""
  pending = None
  for step in range(start + 1, cfg.train.steps + 1):
    data_start = time.perf_counter()
    batch = next(batches)
    data_wait = time.perf_counter() - data_start
    profiler.before(step)
    state, metrics = step_fn(state, batch)
    profiler.after(step, metrics)
    if pending is not None:  # read one step late: the device is already busy with this step
      reporter(*pending)
      watchdog.beat(pending[0])
    preempted = preemption.requested()  # with several processes, True at the same step on all of them
    last = preempted or step == cfg.train.steps
    # an evaluation, and the last save, may take longer than a step (and wait for every process): timed apart
    longer = watchdog.FINAL * cfg.train.step_timeout_s if cfg.train.step_timeout_s else None
    evaluate = evaluator is not None and (step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0))
    extra = {}
    with watchdog.phase(longer) if last or evaluate else contextlib.nullcontext():
      if evaluate:  # into this step's record; a non-finite eval never stops the run (on_nonfinite)
        extra.update(evaluator(state))
      if last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
        extra["ckpt_block_s"] = ckpt.save(step, state, batches.iterator)
    pending = (step, metrics, data_wait, extra)
    if preempted:
      reporter(*pending)
      with watchdog.phase(longer):
        ckpt.wait()
      who = f"process {jax.process_index()}/{jax.process_count()}: " if preemption.shared else ""
      print(f"{who}pre-empted ({preemption.reason}): saved step {step}; run the same command again to resume",
            flush=True)  # every process says so: each saved its part
      return state, "preempted"
  if pending is not None:
    reporter(*pending)
  return state, None


def _summary(cfg, reporter, start, stopped, run_dir) -> dict[str, float]:
  if not reporter.losses:
    _log(f"nothing to do: the run in {run_dir} already reached step {start} of {cfg.train.steps}")
    return {"steps": 0, "first_loss": float("nan"), "last_loss": float("nan"), "tokens_per_sec": 0.0}
  steady = reporter.step_times[1:] or reporter.step_times  # the first step includes compilation
  summary = {"first_loss": reporter.losses[0], "last_loss": reporter.losses[-1], "steps": len(reporter.losses),
             "tokens_per_sec": cfg.train.batch_size * cfg.train.seq_len * len(steady) / sum(steady),
             "skipped": reporter.skipped, "stopped": stopped}
  _log(f"done: loss {summary['first_loss']:.4f} → {summary['last_loss']:.4f} over steps {start + 1}–"
       f"{start + summary['steps']} | {summary['tokens_per_sec']:,.0f} tokens/s (after the first step, which "
       f"compiles) | {reporter.skipped} skipped | run dir {run_dir}")
  return summary


def _log(message: str) -> None:
  if jax.process_index() == 0:
    print(message, flush=True)


def parse_args(argv: list[str] | None) -> tuple[str, list[str]]:
  parser = argparse.ArgumentParser(prog="python -m jaxseek.train", description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True, help="YAML config (see configs/)")
  parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=100 mesh.fsdp=2")
  args = parser.parse_args(argv)
  return args.config, args.overrides


@cli
def main(argv: list[str] | None = None) -> int:
  path, overrides = parse_args(argv)
  cfg = config_lib.load(path, overrides)
  mesh_lib.simulate_cpu_devices(cfg.mesh.num_cpu_devices)
  jax.config.update("jax_enable_preemption_service", False)  # faults.Preemption agrees on the step itself
  multi_process = mesh_lib.initialize_distributed(cfg.dist)
  try:
    run(cfg)
  except Exception as e:  # noqa: BLE001
    advice = explore_suggest.explain_oom(cfg, e, path, overrides) if isinstance(e, jax.errors.JaxRuntimeError) \
        else None
    if advice is not None:  # out of device memory: say what would fit and how to explore it
      e = UserError(advice)
    if multi_process:  # a peer is gone or this process failed: leave now, not after jax.distributed's shutdown wait
      if not isinstance(e, (UserError, RunStopped)):
        traceback.print_exc()
      print(f"error: process {jax.process_index()}: {e}".splitlines()[0], file=sys.stderr, flush=True)
      os._exit(2 if isinstance(e, UserError) else 1)
    if advice is not None:
      raise e from None
    raise
  return 0


if __name__ == "__main__":
  sys.exit(main())
