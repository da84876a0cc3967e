"""Model FLOPs and MFU, the metric writers (console, metrics.jsonl, TensorBoard, Prometheus) and the step reporter."""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxseek.config import Config
from jaxseek.errors import RunStopped, UserError

# Dense bf16 peak TFLOP/s per device (vendor data sheets, without sparsity).
PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0, "h800": 989.0, "a100": 312.0, "a800": 312.0, "l40s": 362.0,
               "gh200": 989.0, "b200": 2250.0}


def _matrices(abstract_params: nnx.State):
  """(path names, logical axes, size) of every weight matrix (two or more axes besides `layers`)."""
  for path, var in jax.tree_util.tree_flatten_with_path(abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    names = var.get_metadata()["logical_axes"]
    if sum(n != "layers" for n in names) >= 2:
      yield [str(getattr(k, "key", k)) for k in path], names, math.prod(var.shape)


def flops_by_part(cfg: Config, abstract_params: nnx.State) -> dict[str, tuple[float, float]]:
  """Training FLOPs per token by the part of the model that runs them, with the share train.fp8 runs in FP8:
  {part: (flops, recipe flops)}, parts "dense_layers", "moe_layers", "mtp_layers" (each with its layers'
  attention) and "head" (the output projection, once per MTP depth too); they sum to `flops_per_token` and
  `recipe_flops_per_token`. The explorer places them on the pipeline's stages (explore/comm.py)."""
  m = cfg.model
  ratio = lambda names: m.num_experts_per_tok / m.n_routed_experts if "experts" in names else 1
  parts: dict[str, list[float]] = {}

  def add(part: str, flops: float, recipe: float = 0.0) -> None:
    total = parts.setdefault(part, [0.0, 0.0])
    total[0], total[1] = total[0] + flops, total[1] + recipe

  for keys, names, size in _matrices(abstract_params):
    if "table_VD" in keys:
      continue
    part = "head" if keys[0] == "head_DV" else keys[0]
    recipe = ("attn" in keys or "mlp" in keys or "shared" in keys) and not any(k.startswith("w_router") for k in keys)
    add(part, 6 * size * ratio(names), 6 * size * ratio(names) * recipe)
  depth = m.num_nextn_predict_layers
  add("head", 6 * (int(m.tie_word_embeddings) + depth) * m.vocab_size * m.hidden_size)  # the head, once per MTP depth too
  qk, v = (m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim) if m.is_mla else (m.dense_head_dim,) * 2
  per_layer = 3 * 2 * m.num_attention_heads * (qk + v) * (cfg.train.seq_len + 1) / 2
  for part, layers in (("dense_layers", m.num_dense_layers), ("moe_layers", m.num_moe_layers), ("mtp_layers", depth)):
    if layers:
      add(part, per_layer * layers)
  return {part: (flops, recipe) for part, (flops, recipe) in parts.items()}


def recipe_flops_per_token(cfg: Config, abstract_params: nnx.State) -> float:
  """The part of `flops_per_token` FP8 training runs in FP8 (train.fp8): the attention and MLP projections, shared
  and routed experts (K/E of them), forward and both gradients; not the embedding, the head, the router or the
  attention scores."""
  return sum(recipe for _, recipe in flops_by_part(cfg, abstract_params).values())


def flops_per_token(cfg: Config, abstract_params: nnx.State) -> float:
  """Training FLOPs per token = 3 × forward, forward = 2 × active matmul parameters + attention.

  Active parameters: every matrix but the embedding lookup, routed experts counted K/E (only the chosen ones
  run). Attention: 2 · N · (qk head dim + v head dim) multiply-adds per query-key pair, (T + 1)/2 pairs per
  query under the causal mask, per layer.
  """
  return sum(flops for flops, _ in flops_by_part(cfg, abstract_params).values())


@lru_cache(maxsize=1)
def cpu_matmul_tflops() -> float:
  """Measured float32 matmul rate of this host (all cores), in TFLOP/s: the best of 5 rounds of 4 products of
  1024² matrices (about 0.2 s; the best, because other work on the machine only ever slows a round down)."""
  n, reps = 1024, 4
  x = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  f(x).block_until_ready()
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(reps):
      y = f(x)
    y.block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 * reps / best / 1e12


def peak_tflops_per_device(override: float | None) -> tuple[float, str]:
  """(peak TFLOP/s per device, where it came from): config, the accelerator table, or a CPU probe."""
  if override:
    return override, "config"
  device = jax.local_devices()[0]
  kind = device.device_kind.lower()
  for name, tflops in PEAK_TFLOPS.items():
    if name in kind.replace(" ", ""):
      return tflops, f"table ({device.device_kind})"
  if device.platform == "cpu":
    return cpu_matmul_tflops() / jax.local_device_count(), "cpu matmul probe, shared by the simulated devices"
  return float("nan"), f"unknown device {device.device_kind}; set metrics.peak_tflops"


class Writer:
  """The one place per-step metrics go, on process 0: the console, metrics.jsonl, and optionally TensorBoard
  (metrics.tensorboard), a Prometheus /metrics endpoint (metrics.prometheus_port) and Weights & Biases
  (metrics.wandb)."""

  def __init__(self, run_dir: Path, cfg: Config):
    self.enabled = jax.process_index() == 0
    self.sinks: list = []
    if not self.enabled:
      return
    if cfg.metrics.prometheus_port is not None:  # first: a busy port fails before any file is opened
      self.sinks.append(Prometheus(cfg.metrics.prometheus_port, Path(run_dir).absolute().name))
    self.sinks += [Console(cfg.train.steps), Jsonl(run_dir / "metrics.jsonl")]
    if cfg.metrics.tensorboard:
      self.sinks.append(TensorBoard(run_dir / "tensorboard"))
    if cfg.metrics.wandb:
      self.sinks.append(WandB(Path(run_dir), cfg))

  def write(self, step: int, values: dict[str, Any]) -> None:
    record = {"step": step, **{k: _plain(v) for k, v in values.items()}}
    for sink in self.sinks:
      sink.write(step, record)

  def close(self) -> None:
    for sink in self.sinks:
      sink.close()
    self.sinks = []


class Jsonl:
  """metrics.jsonl: one JSON object per written step, appended, so a resumed run continues the file.

  Each record goes out in one write(2) of a whole line. A run killed mid-write can leave a partial last line;
  opening the file again cuts it off, so the records after a resume start on a line of their own.
  """

  def __init__(self, path: Path):
    self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    size = os.fstat(self.fd).st_size
    if size:
      with open(path, "rb") as f:
        f.seek(max(0, size - (1 << 20)))
        tail = f.read()
      if not tail.endswith(b"\n"):
        cut = tail.rfind(b"\n")
        os.truncate(path, size - len(tail) + cut + 1 if cut >= 0 else size - len(tail))

  def write(self, step: int, record: dict) -> None:
    line = (json.dumps(record) + "\n").encode()
    while line:
      line = line[os.write(self.fd, line):]

  def close(self) -> None:
    os.close(self.fd)


def jsonl_records(path: Path) -> tuple[list[tuple[int, dict]], int | None]:
  """((line number, record) per non-blank line of a metrics.jsonl, the number of a last line cut off mid-write
  (no newline, not JSON yet: the trainer may be writing it) or None). UserError for a file that cannot be read
  or a line that is not a JSON object."""
  path = Path(path)
  try:
    text = path.read_text()
  except (OSError, UnicodeDecodeError) as e:
    raise UserError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
  lines = text.split("\n")
  records, partial = [], None
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      if number == len(lines):
        partial = number
        continue
      raise UserError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
      raise UserError(f"{path}:{number}: not a JSON object")
    records.append((number, record))
  return records, partial


def read_jsonl(path: Path) -> list[dict]:
  """The complete records of a metrics.jsonl (a last line still being written is left out)."""
  return [record for _, record in jsonl_records(path)[0]]


class Console:
  """A compact line per written step (rich); on a terminal also a live progress bar with the ETA."""

  def __init__(self, total_steps: int):
    import rich.console
    import rich.progress

    self.console = rich.console.Console(highlight=False, soft_wrap=True)
    self.total_steps = total_steps
    self.first: tuple[int, float] | None = None  # (step, time) of the first write: ETA excludes compilation
    self.progress = None
    if self.console.is_terminal:
      self.progress = rich.progress.Progress(
          rich.progress.TextColumn("step {task.completed}/{task.total}"), rich.progress.BarColumn(),
          rich.progress.TaskProgressColumn(), rich.progress.TimeRemainingColumn(), console=self.console,
          transient=True)
      self.task = self.progress.add_task("train", total=total_steps)
      self.progress.start()

  def write(self, step: int, record: dict) -> None:
    now = time.perf_counter()
    if self.first is None:
      self.first = (step, now)
    done_steps = step - self.first[0]
    eta = (now - self.first[1]) / done_steps * (self.total_steps - step) if done_steps else float("nan")
    parts = [f"step {step:>6}/{self.total_steps}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}",
             f"grad {record['grad_norm']:.3f}"]
    if "tokens_per_sec" in record:
      parts += [f"{record['tokens_per_sec']:,.0f} tok/s", f"mfu {100 * record['mfu']:.1f}%"]
    if record.get("moe_load_max_over_mean") is not None:
      parts.append(f"load max/mean {record['moe_load_max_over_mean']:.2f}")
    if record.get("moe_extra_round_fraction"):  # skew: copies past one receive buffer went in further rounds
      parts.append(f"extra rounds {100 * record['moe_extra_round_fraction']:.1f}% of copies")
    if record.get("skipped"):
      why = "non-finite" if record.get("nonfinite") else "float16 overflow" if record.get("overflow") else "loss spike"
      parts.append(f"SKIPPED ({why})")
    if "loss_scale" in record:
      parts.append(f"loss scale {record['loss_scale']:g}")
    if "eval_loss" in record:
      mtp = f" (mtp {record['eval_mtp_loss']:.4f})" if "eval_mtp_loss" in record else ""
      parts.append(f"eval loss {record['eval_loss']:.4f}{mtp} ppl {record['eval_perplexity']:.3g}")
    parts.append(f"eta {_hms(eta)}")
    self.console.print(" | ".join(parts), markup=False)
    if self.progress is not None:
      self.progress.update(self.task, completed=step)

  def close(self) -> None:
    if self.progress is not None:
      self.progress.stop()


class TensorBoard:
  """Scalars under <run_dir>/tensorboard (tensorboardX); per-layer lists as <name>/<layer>."""

  def __init__(self, log_dir: Path):
    from tensorboardX import SummaryWriter

    self.writer = SummaryWriter(str(log_dir))

  def write(self, step: int, record: dict) -> None:
    for key, value in record.items():
      if key == "step" or value is None:
        continue
      if isinstance(value, list):
        for i, v in enumerate(value):
          if isinstance(v, (int, float)):
            self.writer.add_scalar(f"{key}/{i}", v, step)
      elif isinstance(value, (int, float)):
        self.writer.add_scalar(key, value, step)
    self.writer.flush()

  def close(self) -> None:
    self.writer.close()


class WandB:
  """Weights & Biases (metrics.wandb): every number of every record (per-layer lists as <name>/<layer>) at its
  step, and the resolved config. The run's id is kept in <run_dir>/wandb_id, so a resumed run continues the same
  W&B run; its files go under <run_dir>/wandb. Entity, mode (WANDB_MODE=offline) and key come from W&B's own
  environment variables.

  W&B drops a record whose step is not above the last it holds, and a resumed run repeats the steps after its
  checkpoint that the stopped run had already logged. So every metric is plotted against the record's own `step`
  (define_metric), and W&B's step is the training step plus an offset kept in <run_dir>/wandb_step_offset: the
  first repeated step raises the offset past the last W&B step, so the repeats are logged too."""

  def __init__(self, run_dir: Path, cfg: Config):
    import wandb

    from jaxseek import config as config_lib

    id_file, self.offset_file = run_dir / "wandb_id", run_dir / "wandb_step_offset"
    resumed = id_file.exists()
    run_id = id_file.read_text().strip() if resumed else uuid.uuid4().hex[:8]
    id_file.write_text(run_id + "\n")
    self.offset = int(self.offset_file.read_text()) if self.offset_file.exists() else 0
    # every record reaches metrics.jsonl before W&B: its last step is the last one W&B may hold (less the offset)
    last = _last_jsonl_step(run_dir / "metrics.jsonl") if resumed else None
    try:
      self.run = wandb.init(project=cfg.metrics.wandb_project, name=cfg.metrics.wandb_name or run_dir.absolute().name,
                            id=run_id, resume="allow", dir=str(run_dir), config=config_lib.to_dict(cfg))
    except wandb.errors.UsageError as e:
      raise UserError(f"W&B refused to start (metrics.wandb=true): {str(e).splitlines()[0]}") from None
    # online, W&B says where the run's history ends too
    self.last = max(-1 if last is None else last + self.offset, (getattr(self.run, "starting_step", 0) or 0) - 1)
    self.run.define_metric("step")
    self.run.define_metric("*", step_metric="step")

  def write(self, step: int, record: dict) -> None:
    data = {"step": step}
    for key, value in record.items():
      if key == "step" or value is None:
        continue
      if isinstance(value, list):
        data.update({f"{key}/{i}": v for i, v in enumerate(value) if isinstance(v, (int, float))})
      elif isinstance(value, (int, float)):
        data[key] = value
    if step + self.offset <= self.last:  # a step logged before the resume
      logged = self.last - self.offset
      self.offset = self.last + 1 - step
      self.offset_file.write_text(f"{self.offset}\n")
      steps = f"step {step} was" if step == logged else f"steps {step}–{logged} were"
      print(f"W&B: {steps} logged before the resume and now again, at W&B's own steps from {step + self.offset} "
            f"(charts plot against `step`, where both runs' values show)", flush=True)
    self.last = step + self.offset
    self.run.log(data, step=self.last)

  def close(self) -> None:
    self.run.finish()


def _last_jsonl_step(path: Path) -> int | None:
  """The step of the last complete record of a metrics.jsonl (read from its last MiB), or None."""
  try:
    with open(path, "rb") as f:
      f.seek(max(0, os.fstat(f.fileno()).st_size - (1 << 20)))
      lines = f.read().split(b"\n")
  except FileNotFoundError:
    return None
  for line in reversed(lines):  # a line cut off by the seek or by a kill is no JSON object with a step
    try:
      return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError, IndexError):
      continue
  return None


WANDB_MODES = ("online", "offline", "dryrun", "disabled", "run", "shared")
WANDB_CLOUD = ("api.wandb.ai", "api.forge.coreweave.com")  # W&B's cloud service, under either address


def check_wandb(cfg: Config) -> None:
  """metrics.wandb: refuses, before anything is written, a WANDB_MODE W&B does not know and an online run without
  credentials, looked for where W&B looks (no network call): WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, an api_key
  in W&B's settings files, the netrc entry for the W&B host."""
  if not cfg.metrics.wandb:
    return
  settings = _wandb_settings()
  env_mode = os.environ.get("WANDB_MODE")
  if env_mode and env_mode not in WANDB_MODES:
    raise UserError(f"WANDB_MODE={env_mode} is not a W&B mode ({', '.join(WANDB_MODES)}); set WANDB_MODE=offline "
                    f"or online")
  mode = env_mode or settings.get("mode", "online")
  disabled = os.environ.get("WANDB_DISABLED", "").lower() in ("true", "1", "yes")
  if mode in ("offline", "dryrun", "disabled") or disabled or _wandb_credentials(settings):
    return
  raise UserError("metrics.wandb=true logs to W&B online, but no W&B API key is set (WANDB_API_KEY, or the netrc "
                  "entry `wandb login` writes); run `wandb login`, or set WANDB_MODE=offline to log locally")


def _wandb_settings() -> dict[str, str]:
  """The [default] section of W&B's global settings file and of ./wandb/settings (the latter wins)."""
  import configparser

  folder = os.environ.get("WANDB_CONFIG_DIR") or os.path.join("~", ".config", "wandb")
  values = {}
  for path in (Path(folder).expanduser() / "settings", Path("wandb") / "settings"):
    parser = configparser.ConfigParser()
    try:
      parser.read(path)
    except (configparser.Error, OSError, UnicodeDecodeError):
      continue
    if parser.has_section("default"):
      values.update(parser["default"])
  return values


def _wandb_credentials(settings: dict[str, str]) -> bool:
  """Whether W&B would find credentials (True where a file cannot be read: then W&B decides)."""
  import netrc
  from urllib.parse import urlsplit

  if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or settings.get("api_key"):
    return True
  host = urlsplit(os.environ.get("WANDB_BASE_URL") or settings.get("base_url") or "").netloc
  hosts = WANDB_CLOUD if not host or host in WANDB_CLOUD else (host,)
  path = os.environ.get("NETRC") or next((p for p in ("~/.netrc", "~/_netrc") if os.path.exists(
      os.path.expanduser(p))), "~/.netrc")
  try:
    entries = netrc.netrc(os.path.expanduser(path))
  except FileNotFoundError:
    return False
  except (netrc.NetrcParseError, OSError, UnicodeDecodeError):
    return True
  return any((entries.authenticators(h) or (None, None, None))[2] for h in hosts)


# metrics.jsonl key → Prometheus gauge name (the Grafana dashboard in docs/ reads these)
PROMETHEUS_GAUGES = {
    "step": "jaxseek_step", "loss": "jaxseek_loss", "loss_tokens": "jaxseek_loss_tokens",
    "lr": "jaxseek_learning_rate", "grad_norm": "jaxseek_grad_norm",
    "tokens_per_sec": "jaxseek_tokens_per_second", "mfu": "jaxseek_mfu", "tflops_per_device": "jaxseek_tflops_per_device",
    "step_time_s": "jaxseek_step_time_seconds", "data_wait_s": "jaxseek_data_wait_seconds",
    "ckpt_block_s": "jaxseek_checkpoint_block_seconds", "host_memory_bytes": "jaxseek_host_memory_bytes",
    "moe_load_max_over_mean": "jaxseek_moe_load_max_over_mean",
    "moe_load_max_over_mean_worst": "jaxseek_moe_load_max_over_mean_worst",
    "moe_dropped_fraction": "jaxseek_moe_dropped_fraction",
    "moe_extra_round_fraction": "jaxseek_moe_extra_round_fraction", "mtp_loss": "jaxseek_mtp_loss",
    "loss_scale": "jaxseek_loss_scale", "eval_loss": "jaxseek_eval_loss",
    "eval_perplexity": "jaxseek_eval_perplexity", "eval_mtp_loss": "jaxseek_eval_mtp_loss",
}


class Prometheus:
  """Serves the latest values at http://<host>:<port>/metrics (prometheus-client), one `run` label per run."""

  def __init__(self, port: int, run: str):
    import prometheus_client as prom

    self.registry = prom.CollectorRegistry()
    self.gauges = {key: prom.Gauge(name, f"jaxseek {key}", ["run"], registry=self.registry)
                   for key, name in PROMETHEUS_GAUGES.items()}
    self.memory = prom.Gauge("jaxseek_device_memory_bytes", "device memory in use", ["run", "device"],
                             registry=self.registry)
    self.skipped = prom.Counter("jaxseek_skipped_steps", "steps skipped (non-finite or loss spike)", ["run"],
                                registry=self.registry)
    self.run = run
    try:
      self.server, self.thread = prom.start_http_server(port, registry=self.registry)
    except OSError as e:
      raise UserError(f"metrics.prometheus_port={port}: cannot serve /metrics ({e.strerror}); choose a free port")
    print(f"prometheus: serving /metrics on port {self.server.server_port}", flush=True)

  def write(self, step: int, record: dict) -> None:
    for key, gauge in self.gauges.items():
      value = record.get(key)
      if isinstance(value, (int, float)):
        gauge.labels(run=self.run).set(value)
    for device, used in enumerate(record.get("device_memory_bytes") or []):
      if used is not None:
        self.memory.labels(run=self.run, device=str(device)).set(used)
    if record.get("skipped"):
      self.skipped.labels(run=self.run).inc()

  def close(self) -> None:
    self.server.shutdown()
    self.server.server_close()


class StepProfiler:
  """A jax.profiler trace of steps [first, last] (metrics.profile_steps) into <run_dir>/profile; open it with
  TensorBoard's profile plugin or xprof (`xprof --logdir RUN_DIR/profile`), or the .trace.json.gz in Perfetto."""

  def __init__(self, steps: tuple[int, ...], directory: Path):
    self.first, self.last = steps if steps else (0, -1)
    self.directory = directory
    self.active = False

  def before(self, step: int) -> None:
    if step == self.first:
      jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
      self.active = True

  def after(self, step: int, outputs: Any) -> None:
    if self.active and step == self.last:
      jax.block_until_ready(outputs)
      self.close()
      if jax.process_index() == 0:
        print(f"profile of steps {self.first}-{self.last} written to {self.directory}", flush=True)

  def close(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False


def memory_in_use() -> dict[str, Any]:
  """Bytes in use on each local device (from the runtime, where it reports them) and this process's host RSS."""
  used = []
  for device in jax.local_devices():
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    used.append(stats.get("bytes_in_use") if stats else None)
  out: dict[str, Any] = {"host_memory_bytes": _rss_bytes()}
  if any(u is not None for u in used):
    out["device_memory_bytes"] = used
  return out


def _rss_bytes() -> int | None:
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return None


def _plain(v):
  v = np.asarray(v)
  return v.item() if v.ndim == 0 else v.tolist()


def _hms(seconds: float) -> str:
  if math.isnan(seconds):
    return "-"
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def nonfinite_cause(cfg: Config, values: dict, *, first: bool) -> str:
  """What produced a step's first non-finite value, as far as the step's own numbers tell: the forward pass (a
  non-finite loss) or the backward (a finite loss, a non-finite gradient); at a run's first step nothing has been
  updated yet, so the learning rate cannot be the cause, and the compute dtype and FP8 GEMMs are what overflow."""
  t = cfg.train
  part = "the forward pass (the loss)" if not math.isfinite(values["loss"]) else \
      "the backward pass (the loss was finite, its gradient is not)"
  suspects = []
  if t.compute_dtype == "float16":
    suspects.append("float16 compute, whose values end at 65,504 (train.compute_dtype=bfloat16 has float32's range)")
  if t.fp8 not in (False, "none"):
    suspects.append(f"the FP8 GEMMs (train.fp8={t.fp8}: a run with train.fp8=false tells them apart)")
  if first:
    why = "; ".join(suspects) or "the data or the model's initialisation (the parameters were finite)"
    return f"{part} overflowed at the run's first step, before any update, so optim.lr is not the cause: {why}"
  return f"{part} became non-finite after finite steps: lower optim.lr" + \
      (f", or look at {'; '.join(suspects)}" if suspects else "")


class StepReporter:
  """Fetches each step's metrics (waiting for that step to finish), times steps, writes every metrics.every."""

  def __init__(self, writer: Writer, cfg: Config, flops_per_step: float, peak: float):
    self.writer, self.cfg, self.flops_per_step, self.peak = writer, cfg, flops_per_step, peak
    self.last_done = time.perf_counter()
    self.step_times: list[float] = []
    self.losses: list[float] = []
    self.skipped = 0

  def __call__(self, step: int, metrics: dict[str, jax.Array], data_wait: float, extra: dict[str, float]) -> None:
    values = {k: float(v) if v.ndim == 0 else v.tolist() for k, v in jax.device_get(metrics).items()}
    values.update(extra)
    self.skipped += int(values["skipped"])
    if values["nonfinite"] and self.cfg.train.on_nonfinite == "stop":
      self.writer.write(step, values)
      raise RunStopped(f"step {step}: loss {values['loss']:g}, gradient norm {values['grad_norm']:g}; "
                       f"{nonfinite_cause(self.cfg, values, first=not self.losses)}; the parameters were not updated "
                       f"and checkpoints on disk hold finite values (train.on_nonfinite=skip skips such steps)")
    done = time.perf_counter()
    # the time of an evaluation after the step is not the step's
    step_time, self.last_done = done - self.last_done - extra.get("eval_time_s", 0.0), done
    self.step_times.append(step_time)
    self.losses.append(values["loss"])
    cfg = self.cfg
    if step % cfg.metrics.every == 0 or step in (1, cfg.train.steps) or extra or values["skipped"]:
      tflops = self.flops_per_step / step_time / jax.device_count() / 1e12
      values.update(tokens_per_sec=cfg.train.batch_size * cfg.train.seq_len / step_time, step_time_s=step_time,
                    data_wait_s=data_wait, tflops_per_device=tflops, mfu=tflops / self.peak, **memory_in_use())
      self.writer.write(step, values)
