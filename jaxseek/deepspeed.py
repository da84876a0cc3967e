"""DeepSpeed config → jaxseek config (`scripts/from_deepspeed.py`, docs/from-deepspeed.md).

`translate(ds, cluster)` maps every key of a DeepSpeed JSON config it knows to jaxseek settings, each with the
key it came from. A key that has no jaxseek equivalent is listed with what to do instead (`unmapped`); a
performance knob XLA makes unnecessary is listed with why (`not_needed`); nothing is dropped silently. Values
that contradict each other (a train_batch_size that is not micro × accumulation × data-parallel size, fp16 and
bf16 both on) raise UserError. DeepSpeed's own defaults are written out where they differ from jaxseek's, so
the translated run behaves like the DeepSpeed one (initial_scale_power 16, hysteresis 2, Adam's betas).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import yaml
from flax import traverse_util

from jaxseek import config as config_lib
from jaxseek.errors import UserError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@dataclasses.dataclass(frozen=True)
class Cluster:
  nodes: int
  gpus_per_node: int
  platform: str = "gpu"  # "cpu": simulated devices (host offload is not available there)

  @property
  def devices(self) -> int:
    return self.nodes * self.gpus_per_node


@dataclasses.dataclass
class Translation:
  values: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # section → key → value
  sources: dict[str, str] = dataclasses.field(default_factory=dict)  # "section.key" → where it came from
  unmapped: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (DeepSpeed key, what to do)
  not_needed: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (DeepSpeed key, why)

  def set(self, key: str, value: Any, source: str) -> None:
    section, _, field = key.partition(".")
    self.values.setdefault(section, {})[field] = value
    self.sources[key] = source


# DeepSpeed keys whose job XLA or jaxseek already does: (key or prefix, why no setting is needed).
_NOT_NEEDED = {
    "zero_optimization.contiguous_gradients": "XLA lays out gradient buffers itself",
    "zero_optimization.overlap_comm": "XLA's latency-hiding scheduler overlaps collectives "
                                      "(scripts/slurm/train.sbatch)",
    "zero_optimization.reduce_scatter": "XLA reduce-scatters gradients onto their fsdp shards",
    "zero_optimization.reduce_bucket_size": "collective combining: --xla_gpu_reduce_scatter_combine_threshold_bytes "
                                            "in scripts/slurm/train.sbatch",
    "zero_optimization.allgather_bucket_size": "collective combining: --xla_gpu_all_gather_combine_threshold_bytes "
                                               "in scripts/slurm/train.sbatch",
    "zero_optimization.allgather_partitions": "XLA all-gathers each weight for its layer",
    "zero_optimization.round_robin_gradients": "XLA schedules the gradient reductions",
    "zero_optimization.sub_group_size": "the optimiser update is one fused XLA computation per shard",
    "zero_optimization.stage3_prefetch_bucket_size": "XLA's pipelined all-gather prefetches the next layer's weights",
    "zero_optimization.stage3_param_persistence_threshold": "every parameter is sharded by the rules table",
    "zero_optimization.stage3_max_live_parameters": "XLA frees gathered weights after their layer",
    "zero_optimization.stage3_max_reuse_distance": "XLA frees gathered weights after their layer",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "export with scripts/convert_checkpoint.py to-hf "
                                                                   "--dtype bfloat16",
    "zero_optimization.offload_optimizer.pin_memory": "host offload uses pinned host memory",
    "zero_optimization.offload_param.pin_memory": "pinned host memory is the only host memory kind used",
    "zero_optimization.offload_optimizer.fast_init": "the optimiser state is created sharded in place",
    "zero_optimization.offload_optimizer.buffer_count": "no staging buffers: XLA moves the state",
    "zero_optimization.offload_param.buffer_count": "no staging buffers: XLA moves the parameters",
    "zero_optimization.offload_param.buffer_size": "no staging buffers: XLA moves the parameters",
    "zero_optimization.offload_param.max_in_cpu": "parameters stay in device memory",
    "zero_optimization.ignore_unused_parameters": "every parameter takes part in each step",
    "zero_optimization.load_from_fp32_weights": "checkpoints hold float32 master weights",
    "zero_optimization.elastic_checkpoint": "checkpoints restore on any mesh shape",
    "zero_allow_untested_optimizer": "one optimiser (AdamW) is built in",
    "zero_force_ds_cpu_optimizer": "one optimiser (AdamW) is built in",
    "fp16.auto_cast": "compute_dtype covers the model; norms, softmax, router and losses stay float32",
    "bf16.immediate_grad_update": "gradients are applied once per step",
    "prescale_gradients": "gradients are averaged once, in float32",
    "gradient_predivide_factor": "gradients are averaged once, in float32",
    "wall_clock_breakdown": "step_time_s, data_wait_s and ckpt_block_s are logged every metrics.every steps; "
                            "metrics.profile_steps writes a trace",
    "memory_breakdown": "memory in use per device is logged with the metrics",
    "flops_profiler": "tflops_per_device and mfu are logged every metrics.every steps",
    "tensorboard.output_path": "TensorBoard scalars go to <run_dir>/tensorboard",
    "tensorboard.job_name": "TensorBoard scalars go to <run_dir>/tensorboard",
    "activation_checkpointing.partition_activations": "activations stay sharded as the rules table says",
    "activation_checkpointing.contiguous_memory_optimization": "XLA allocates the saved activations",
    "activation_checkpointing.number_checkpoints": "every layer is a checkpoint boundary",
    "activation_checkpointing.synchronize_checkpoint_boundary": "XLA orders the recomputation",
    "activation_checkpointing.profile": "use metrics.profile_steps for a trace",
    "pipeline.partition": "stages hold equal numbers of layers (padded when the stage count does not divide them)",
    "pipeline.partition_method": "stages hold equal numbers of layers (padded when the stage count does not "
                                 "divide them)",
    "pipeline.seed_layers": "layers are initialised from train.seed on every mesh",
    "pipeline.activation_checkpoint_interval": "train.remat applies to every layer",
    "pipeline.pipe_partitioned": "activations stay sharded as the rules table says",
    "pipeline.grad_partitioned": "gradients stay sharded as the rules table says",
    "pipeline_parallelism.enabled": "read together with the stage count",
    "data_types.grad_accum_dtype": "gradients are accumulated in float32",
    "checkpoint": "Orbax checkpoints: checkpoint.every, checkpoint.keep (docs/checkpoints.md)",
    "aio": "no NVMe offload",
    "dump_state": "the resolved config is written to <run_dir>/config.yaml",
}

# DeepSpeed keys with no jaxseek equivalent: (key or prefix, what to do instead).
_UNMAPPED = {
    "amp": "use train.compute_dtype (bfloat16, or float16 with loss scaling)",
    "elasticity": "jaxseek has no elastic world size; a checkpoint resumes on any mesh, so restart with the new size",
    "wandb": "read <run_dir>/metrics.jsonl, TensorBoard (metrics.tensorboard=true) or Prometheus "
             "(metrics.prometheus_port)",
    "comet": "read <run_dir>/metrics.jsonl, TensorBoard (metrics.tensorboard=true) or Prometheus "
             "(metrics.prometheus_port)",
    "csv_monitor": "<run_dir>/metrics.jsonl has every logged metric",
    "sparse_attention": "not built; attention is dense (causal, packed)",
    "compression_training": "not built",
    "curriculum_learning": "not built; prepare the data order with scripts/prepare_data.py",
    "data_efficiency": "not built",
    "autotuning": "use python -m jaxseek.explore --suggest to rank meshes",
    "moe": "the model config sets the experts (model.n_routed_experts, ...); expert parallelism is mesh.expert",
    "sparse_gradients": "not built; embedding gradients are dense",
    "zero_optimization.offload_optimizer.nvme_path": "no NVMe offload; use device cpu (train.optimizer_memory=host)",
    "zero_optimization.offload_optimizer.ratio": "the whole optimiser state moves to host memory",
    "zero_optimization.offload_param.nvme_path": "no NVMe offload",
    "zero_optimization.mics_shard_size": "set mesh.fsdp to the shard group size and mesh.data to the rest (hybrid)",
    "zero_optimization.zero_hpz_partition_size": "set mesh.fsdp to the partition size and mesh.data to the rest",
    "zero_optimization.zero_quantized_weights": "not built",
    "zero_optimization.zero_quantized_gradients": "train.grad_compression=int8 compresses the data-axis sum "
                                                  "(mesh.data > 1; docs/compression.md)",
    "fp16.consecutive_hysteresis": "jaxseek refills the hysteresis budget only when the scale grows "
                                   "(DeepSpeed's default, consecutive_hysteresis false)",
    "activation_checkpointing.cpu_checkpointing": "train.remat=offload keeps saved activations in host memory "
                                                  "(GPU only)",
}

_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
_ADAM = ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam")
AUTO = "auto"


def read(path: str | Path) -> dict[str, Any]:
  """A DeepSpeed config: JSON, or a Python dict literal as guides print it (`ds_config = {... True ...}`)."""
  path = Path(path)
  if not path.is_file():
    raise UserError(f"DeepSpeed config {path} not found; pass the JSON file given to --deepspeed_config")
  text = config_lib.read_text(path, f"DeepSpeed config {path}", "pass the JSON file given to --deepspeed_config")
  try:
    raw = json.loads(text)
  except json.JSONDecodeError:
    body = re.sub(r"^\s*\w+\s*=\s*", "", text.strip(), count=1)  # "ds_config = {...}"
    try:
      raw = ast.literal_eval(body)
    except (ValueError, SyntaxError):
      raise UserError(f"DeepSpeed config {path} is neither JSON nor a Python dict literal; fix its syntax") from None
  if not isinstance(raw, dict):
    raise UserError(f"DeepSpeed config {path} must hold one mapping of keys")
  return raw


def flatten(tree: dict[str, Any]) -> dict[str, Any]:
  """{"a.b": value} for every leaf of a nested mapping; an empty mapping is a leaf ({})."""
  flat = traverse_util.flatten_dict(tree, keep_empty_nodes=True, sep=".")
  return {key: {} if value is traverse_util.empty_node else value for key, value in flat.items()}


def translate(ds: dict[str, Any], cluster: Cluster) -> Translation:
  """Every key of `ds` translated, listed as not needed, or listed as unmapped."""
  flat = flatten(ds)
  used: set[str] = set()
  out = Translation()

  def get(key: str, default: Any = None) -> Any:
    if key in flat:
      used.add(key)
      value = flat[key]
      if value == AUTO:
        out.unmapped.append((key, "'auto' is filled in by the Hugging Face Trainer; write the value itself"))
        return default
      return value
    return default

  def unmapped(key: str, advice: str) -> None:
    used.add(key)
    out.unmapped.append((key, advice))

  _parallelism(get, out, cluster, flat)
  _precision(get, unmapped, out, flat)
  _optimizer(get, unmapped, out, flat)
  _scheduler(get, unmapped, out, flat)
  _logging(get, unmapped, out, flat, cluster)
  for key in sorted(set(flat) - used):
    match = _prefix_match(key, _NOT_NEEDED)
    if match is not None:
      out.not_needed.append((key, _NOT_NEEDED[match]))
      continue
    match = _prefix_match(key, _UNMAPPED)
    if match is not None:
      out.unmapped.append((key, _UNMAPPED[match]))
    else:
      out.unmapped.append((key, "not a DeepSpeed setting jaxseek knows; check its spelling, or find the jaxseek "
                                "setting in jaxseek/config.py"))
  return out


def _prefix_match(key: str, table: dict[str, str]) -> str | None:
  for name in table:
    if key == name or key.startswith(name + "."):
      return name
  return None


def _int(key: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise UserError(f"DeepSpeed key {key}: {value!r} must be a positive integer")
  return value


def _parallelism(get, out: Translation, cluster: Cluster, flat: dict[str, Any]) -> None:
  """The mesh, offload and batch rules, in that order."""
  pp, dp, stage = _mesh(get, out, cluster)
  _offload(get, out, cluster, stage)
  _batch(get, out, pp, dp)


def _mesh(get, out: Translation, cluster: Cluster) -> tuple[int, int, int]:
  """World size → pipeline × tensor × data-parallel; ZeRO stage → where the data-parallel ranks go. Returns
  (pipeline stages, data-parallel size, ZeRO stage)."""
  def size(*keys: str) -> tuple[int, str | None]:  # the last of `keys` the file sets (all are read)
    found = (1, None)
    for key in keys:
      value = get(key)
      if value is not None:
        found = (_int(key, value), key)
    return found

  pp, pp_key = size("pipeline_parallelism.stages", "pipeline.stages", "pipeline_parallel_size",
                    "pipeline_model_parallel_size")
  if get("pipeline_parallelism.enabled", True) is False:
    pp, pp_key = 1, "pipeline_parallelism.enabled=false: no stages"
  tp, tp_key = size("tensor_parallel.autotp_size", "tensor_parallel.tp_size", "tensor_parallel.tp.tp_size",
                    "tensor_model_parallel_size")
  world = cluster.devices
  if world % (pp * tp):
    raise UserError(f"{world} devices ({cluster.nodes} nodes × {cluster.gpus_per_node}) are not divisible by "
                    f"pipeline {pp} × tensor {tp}; change the stage count, the tensor size or the cluster")
  dp = world // (pp * tp)
  stage = get("zero_optimization.stage", 0)
  if stage not in (0, 1, 2, 3):
    raise UserError(f"DeepSpeed key zero_optimization.stage: {stage!r} must be 0, 1, 2 or 3")
  where = f"{world} devices / (pipeline {pp} × tensor {tp})"
  out.set("mesh.pipeline", pp, (pp_key if "=" in pp_key else f"{pp_key}={pp}") if pp_key else
          "no pipeline stages in the file")
  if stage == 0:
    out.set("mesh.data", dp, f"ZeRO stage 0: {dp} data-parallel replicas = {where}")
    out.set("mesh.fsdp", 1, "ZeRO stage 0: nothing sharded over the data-parallel ranks")
  else:
    out.set("mesh.data", 1, f"ZeRO stage {stage}: the data-parallel ranks shard the state, on fsdp")
    out.set("mesh.fsdp", dp, f"ZeRO stage {stage}: {dp} data-parallel ranks = {where}")
    if stage == 3:
      out.set("train.zero", 3, "ZeRO stage 3: parameters, gradients and optimiser state sharded on fsdp")
    else:
      extra = " (gradients are kept whole as in ZeRO-1; stage 3 also shards them)" if stage == 2 else ""
      out.set("train.zero", 1, f"ZeRO stage {stage}: optimiser state sharded on fsdp, parameters replicated{extra}")
  out.set("mesh.expert", 1, "DeepSpeed config sets no expert parallelism")
  out.set("mesh.context", 1, "DeepSpeed config sets no sequence parallelism")
  out.set("mesh.tensor", tp, f"{tp_key}={tp}" if tp_key else "no tensor parallelism in the file")
  if cluster.platform == "cpu":
    out.set("mesh.num_cpu_devices", cluster.gpus_per_node, f"--platform cpu: {cluster.gpus_per_node} simulated "
            f"devices per process")
  return pp, dp, stage


def _offload(get, out: Translation, cluster: Cluster, stage: int) -> None:
  device = get("zero_optimization.offload_optimizer.device")
  if device == "cpu":
    if stage == 0:
      raise UserError("DeepSpeed key zero_optimization.offload_optimizer needs zero_optimization.stage ≥ 1; "
                      "set a ZeRO stage or remove the offload")
    if cluster.platform == "cpu":
      out.unmapped.append(("zero_optimization.offload_optimizer.device", "host offload needs a GPU or TPU; on "
                           "simulated CPU devices the optimiser state stays in device memory"))
    else:
      out.set("train.optimizer_memory", "host", "zero_optimization.offload_optimizer.device=cpu: AdamW state in "
              "pinned host memory")
  elif device == "nvme":
    out.unmapped.append(("zero_optimization.offload_optimizer.device", "no NVMe offload; device cpu maps to "
                         "train.optimizer_memory=host"))
  device = get("zero_optimization.offload_param.device")
  if device in ("cpu", "nvme"):
    if stage != 3:
      raise UserError(f"DeepSpeed key zero_optimization.offload_param needs zero_optimization.stage 3, not {stage}; "
                      f"set stage 3 or remove the offload")
    out.unmapped.append(("zero_optimization.offload_param.device", "parameters stay in device memory, sharded on "
                         "fsdp; if they do not fit, add devices to mesh.fsdp or mesh.pipeline (the explorer "
                         "shows the memory per device)"))


def _batch(get, out: Translation, pp: int, dp: int) -> None:
  """micro batch × accumulation × data-parallel size = the global batch; any two DeepSpeed keys give the third."""
  micro = get("train_micro_batch_size_per_gpu")
  accum = get("gradient_accumulation_steps")
  total = get("train_batch_size")
  for key, value in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", accum),
                     ("train_batch_size", total)):
    if value is not None:
      _int(key, value)
  if total is not None and micro is not None and accum is not None and total != micro * accum * dp:
    raise UserError(f"DeepSpeed keys train_batch_size={total} and train_micro_batch_size_per_gpu={micro} × "
                    f"gradient_accumulation_steps={accum} × data-parallel size {dp} = {micro * accum * dp} "
                    f"contradict each other; fix one of them")
  if total is not None and micro is None and accum is None:
    accum = 1
  if total is not None and (micro is None) != (accum is None):
    known, name = (micro, "train_micro_batch_size_per_gpu") if micro is not None else \
        (accum, "gradient_accumulation_steps")
    if total % (known * dp):
      raise UserError(f"DeepSpeed key train_batch_size={total} is not divisible by {name}={known} × data-parallel "
                      f"size {dp}; fix one of them")
    micro, accum = (known, total // (known * dp)) if micro is not None else (total // (known * dp), known)
  if micro is not None:
    accum = accum or 1
    out.set("train.batch_size", micro * accum * dp, f"train_micro_batch_size_per_gpu={micro} × "
            f"gradient_accumulation_steps={accum} × data-parallel size {dp}")
    what = "pipeline microbatches" if pp > 1 else "gradient accumulation steps"
    out.set("train.microbatches", accum, f"gradient_accumulation_steps={accum}: {what}")
  elif accum is not None:
    out.unmapped.append(("gradient_accumulation_steps", "without train_micro_batch_size_per_gpu or "
                         "train_batch_size the global batch is unknown; set train.batch_size and "
                         "train.microbatches"))


def _precision(get, unmapped, out: Translation, flat: dict[str, Any]) -> None:
  fp16 = get("fp16.enabled", False) is True
  bf16 = get("bf16.enabled", False) is True or get("bfloat16.enabled", False) is True
  if fp16 and bf16:
    raise UserError("DeepSpeed keys fp16.enabled and bf16.enabled are both true; enable one of them")
  for section, enabled in (("fp16", fp16), ("bf16", bf16), ("bfloat16", bf16)):
    if not enabled:
      for key in [k for k in flat if k.startswith(section + ".") and k != section + ".enabled"]:
        get(key)
        out.not_needed.append((key, f"{section} is not enabled"))
  if bf16:
    key = "bf16.enabled" if "bf16.enabled" in flat else "bfloat16.enabled"
    out.set("train.compute_dtype", "bfloat16", f"{key}=true")
  elif fp16:
    out.set("train.compute_dtype", "float16", "fp16.enabled=true (with dynamic loss scaling)")
    _loss_scale(get, out, flat)
  else:
    out.set("train.compute_dtype", "float32", "neither fp16 nor bf16 enabled: DeepSpeed computes in float32")
  dtype = get("communication_data_type")
  if dtype is not None:
    unmapped("communication_data_type", "gradients are reduced in float32; train.grad_compression=bf16, int8 or "
             "powersgd compresses the data-axis sum (mesh.data > 1; docs/compression.md)")
  accum_dtype = flat.get("data_types.grad_accum_dtype")
  if accum_dtype not in (None, "fp32", "float32"):
    unmapped("data_types.grad_accum_dtype", "gradients are always accumulated in float32")


def _loss_scale(get, out: Translation, flat: dict[str, Any]) -> None:
  """The fp16 block's loss scaling, DeepSpeed's defaults written out; a nonzero `loss_scale` is a static scale."""
  static = get("fp16.loss_scale", 0)
  power = get("fp16.initial_scale_power")
  window = get("fp16.loss_scale_window")
  hysteresis = get("fp16.hysteresis")
  floor = get("fp16.min_loss_scale")
  if static:
    out.set("train.loss_scale_init", float(static), f"fp16.loss_scale={static}: a static scale")
    out.set("train.loss_scale_min", float(static), f"fp16.loss_scale={static}: never halved")
    out.set("train.loss_scale_window", 2**31 - 1, f"fp16.loss_scale={static}: never grown")
    for key in ("fp16.initial_scale_power", "fp16.loss_scale_window", "fp16.hysteresis", "fp16.min_loss_scale"):
      if key in flat:
        out.not_needed.append((key, "fp16.loss_scale sets a static scale, which DeepSpeed also uses instead"))
    return
  power = 16 if power is None else power
  out.set("train.loss_scale_init", float(2**power), f"fp16.initial_scale_power={power}" +
          (" (DeepSpeed's default)" if "fp16.initial_scale_power" not in flat else ""))
  window = 1000 if window is None else window
  out.set("train.loss_scale_window", _int("fp16.loss_scale_window", window), f"fp16.loss_scale_window={window}" +
          (" (DeepSpeed's default)" if "fp16.loss_scale_window" not in flat else ""))
  hysteresis = 2 if hysteresis is None else hysteresis
  out.set("train.loss_scale_hysteresis", _int("fp16.hysteresis", hysteresis), f"fp16.hysteresis={hysteresis}" +
          (" (DeepSpeed's default)" if "fp16.hysteresis" not in flat else ""))
  floor = 1 if floor is None else floor
  out.set("train.loss_scale_min", float(floor), f"fp16.min_loss_scale={floor}" +
          (" (DeepSpeed's default)" if "fp16.min_loss_scale" not in flat else ""))


def _block_type(get, unmapped, flat: dict[str, Any], section: str, kept: str) -> Any:
  """`section.type`, or None (listed when the section is there without a type: `kept` stays as the base has it)."""
  kind = get(f"{section}.type")
  if kind is None and any(k.startswith(section + ".") for k in flat):
    unmapped(section, f"no {section}.type; the base config's {kept} is kept")
  return kind


def _optimizer(get, unmapped, out: Translation, flat: dict[str, Any]) -> None:
  kind = _block_type(get, unmapped, flat, "optimizer", "optimiser")
  if kind is None:
    return
  if str(kind).lower() not in _ADAM:
    out.unmapped.append(("optimizer.type", f"{kind}: jaxseek trains with AdamW only; its lr, betas, eps and "
                         f"weight_decay below were carried over"))
  adamw = str(kind).lower() == "adamw" or bool(get("optimizer.params.adam_w_mode", True))
  if not adamw:
    out.unmapped.append(("optimizer.params.adam_w_mode", "false (L2 regularisation in the gradient): jaxseek's "
                         "AdamW decays the weights directly (adam_w_mode true)"))
  lr = get("optimizer.params.lr")
  if lr is not None:
    out.set("optim.lr", float(lr), f"optimizer.params.lr={lr}")
  betas = get("optimizer.params.betas")
  default = betas is None
  b1, b2 = (0.9, 0.999) if default else betas
  note = " (DeepSpeed's Adam default)" if default else ""
  out.set("optim.b1", float(b1), f"optimizer.params.betas[0]={b1}{note}")
  out.set("optim.b2", float(b2), f"optimizer.params.betas[1]={b2}{note}")
  eps = get("optimizer.params.eps")
  out.set("optim.eps", float(1e-8 if eps is None else eps),
          f"optimizer.params.eps={eps}" if eps is not None else "optimizer.params.eps=1e-8 (DeepSpeed's default)")
  decay = get("optimizer.params.weight_decay")
  out.set("optim.weight_decay", float(decay or 0.0), f"optimizer.params.weight_decay={decay}"
          if decay is not None else "optimizer.params.weight_decay=0 (DeepSpeed's Adam default)")
  for key in ("optimizer.params.bias_correction", "optimizer.params.torch_adam",
              "optimizer.params.fp32_optimizer_states"):
    if key in flat:
      get(key)
      out.not_needed.append((key, "AdamW with bias correction, optimiser state as optim.moments_dtype says"))


def _scheduler(get, unmapped, out: Translation, flat: dict[str, Any]) -> None:
  kind = _block_type(get, unmapped, flat, "scheduler", "schedule")
  if kind is None:
    return
  if kind not in _SCHEDULERS:
    unmapped("scheduler.type", f"{kind}: jaxseek schedules are warm-up then cosine, warm-up-stable-decay or "
             f"constant (optim.schedule)")
    return
  p = "scheduler.params."
  warmup = get(p + "warmup_num_steps", 1000)
  out.set("optim.warmup_steps", _int(p + "warmup_num_steps", warmup), f"{p}warmup_num_steps={warmup}" +
          ("" if p + "warmup_num_steps" in flat else " (DeepSpeed's default)"))
  wtype = get(p + "warmup_type", "log")
  if wtype != "linear":
    out.unmapped.append((p + "warmup_type", f"{wtype}{'' if p + 'warmup_type' in flat else ' (the default)'}: "
                         f"jaxseek warms up linearly"))
  if kind in ("WarmupLR", "WarmupDecayLR"):
    top = get(p + "warmup_max_lr", 0.001)
    low = get(p + "warmup_min_lr", 0.0)
    lr = flat.get("optimizer.params.lr")
    why = f"{p}warmup_max_lr={top}" + ("" if p + "warmup_max_lr" in flat else " (DeepSpeed's default)")
    if lr is not None and lr != top:
      why += f", which DeepSpeed uses instead of optimizer.params.lr={lr}"
    out.set("optim.lr", float(top), why)
    if low and kind == "WarmupLR":
      out.unmapped.append((p + "warmup_min_lr", f"{low}: jaxseek's warm-up starts at lr/warmup_steps"))
    if kind == "WarmupLR":
      out.set("optim.schedule", "constant", "scheduler.type=WarmupLR: warm-up, then constant")
      return
    total = _int(p + "total_num_steps", get(p + "total_num_steps"))
    out.set("optim.schedule", "wsd", "scheduler.type=WarmupDecayLR: warm-up, then a linear decay")
    out.set("optim.decay_steps", max(total - warmup, 0), f"{p}total_num_steps={total} − warmup_num_steps={warmup}")
    out.set("optim.min_lr_ratio", float(low) / float(top), f"{p}warmup_min_lr={low} / warmup_max_lr={top}: the "
            f"decay ends there")
    out.set("train.steps", total, f"{p}total_num_steps={total}")
    return
  total = _int(p + "total_num_steps", get(p + "total_num_steps"))  # WarmupCosineLR
  out.set("optim.schedule", "cosine", "scheduler.type=WarmupCosineLR")
  out.set("optim.decay_steps", 0, "cosine decay until train.steps")
  floor = get(p + "cos_min_ratio", 0.0001)
  out.set("optim.min_lr_ratio", float(floor), f"{p}cos_min_ratio={floor}" +
          ("" if p + "cos_min_ratio" in flat else " (DeepSpeed's default)"))
  start = get(p + "warmup_min_ratio", 0.0)
  if start:
    out.unmapped.append((p + "warmup_min_ratio", f"{start}: jaxseek's warm-up starts at lr/warmup_steps"))
  out.set("train.steps", total, f"{p}total_num_steps={total}")


def _logging(get, unmapped, out: Translation, flat: dict[str, Any], cluster: Cluster) -> None:
  clip = get("gradient_clipping")
  if clip is not None:
    out.set("optim.clip_norm", float(clip), f"gradient_clipping={clip} (global norm; 0 turns it off)")
  every = get("steps_per_print")
  if every is not None:
    out.set("metrics.every", _int("steps_per_print", every), f"steps_per_print={every}")
  if get("tensorboard.enabled", False):
    out.set("metrics.tensorboard", True, "tensorboard.enabled=true")
  if any(k.startswith("activation_checkpointing.") for k in flat):
    offload = bool(flat.get("activation_checkpointing.cpu_checkpointing")) and cluster.platform == "gpu"
    if offload:
      get("activation_checkpointing.cpu_checkpointing")
      out.set("train.remat", "offload", "activation_checkpointing.cpu_checkpointing=true: saved activations in "
              "host memory")
    else:
      out.set("train.remat", "full", "activation_checkpointing: each layer recomputed in the backward pass")


# ------------------------------------------------------------------------------------------------ output


def base_config(model: str | None) -> tuple[dict[str, Any], str]:
  """The config the translation is laid over: a jaxseek YAML (a path or a name in configs/), or a Hugging Face
  folder / config.json (its model section only). Returns (raw sections, where it came from)."""
  if model is None:
    return {}, "jaxseek's defaults"
  path = Path(model)
  candidates = [path, CONFIGS / f"{model}.yaml", CONFIGS / model]
  found = next((c for c in candidates if c.exists()), None)
  if found is None:
    names = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.yaml")))
    raise UserError(f"--model {model}: no such file, folder or config name; give a Hugging Face folder, a YAML "
                    f"file or one of: {names}")
  if found.is_dir() or found.suffix == ".json":
    from jaxseek.convert import hf

    cfg_json = found / "config.json" if found.is_dir() else found
    if not cfg_json.is_file():
      raise UserError(f"--model {model}: {cfg_json} not found; give a Hugging Face model folder")
    raw = hf.read_json(cfg_json)
    model_cfg = hf.model_config(raw, raw.get("num_nextn_predict_layers", 0) or 0)
    return {"model": dataclasses.asdict(model_cfg)}, str(cfg_json)
  try:
    raw = yaml.safe_load(config_lib.read_text(found, f"--model {model}: {found}", "give a jaxseek YAML config")) or {}
  except yaml.YAMLError:
    raise UserError(f"--model {model}: {found} is not valid YAML; fix its syntax") from None
  if not isinstance(raw, dict):
    raise UserError(f"--model {model}: {found} is not a jaxseek config (a mapping of sections)")
  return raw, f"configs/{found.name}" if found.parent == CONFIGS else str(found)


def merge(base: dict[str, Any], t: Translation) -> dict[str, Any]:
  merged = {section: dict(values or {}) for section, values in base.items()}
  for section, values in t.values.items():
    merged.setdefault(section, {}).update(values)
  if "mesh" in merged:  # the six axes in their order, then the rest
    mesh = merged["mesh"]
    merged["mesh"] = {**{a: mesh[a] for a in config_lib.MESH_AXES if a in mesh},
                      **{k: v for k, v in mesh.items() if k not in config_lib.MESH_AXES}}
  return merged


def override(merged: dict[str, Any], t: Translation, overrides: list[str]) -> None:
  """`section.key=value` items (values read as YAML) over the merged sections, commented as such."""
  for item in overrides:
    section, field, value = config_lib.parse_override(item, "model.num_hidden_layers=8")
    if not isinstance(merged.setdefault(section, {}), dict):
      raise UserError(f"config section {section!r} must be a mapping")
    merged[section][field] = value
    t.sources[f"{section}.{field}"] = "command line"


def check(merged: dict[str, Any], cluster: Cluster) -> config_lib.Config:
  """The same validation as `python -m jaxseek.train`, for the cluster's device count."""
  from jaxseek.explore import core as explore

  cfg = config_lib.from_dict(merged)
  config_lib.validate(cfg)
  sizes = explore.mesh_sizes(cfg, cluster.devices)
  config_lib.check_mesh_fit(cfg, sizes)
  from jaxseek.pipeline import stages as pipeline_lib

  if sizes["pipeline"] > 1:
    pipeline_lib.check_stacks(cfg, sizes["pipeline"])
  return cfg


def _scalar(value: Any) -> str:
  return yaml.safe_dump([value], default_flow_style=True, width=10**6).strip()[1:-1]


def render(merged: dict[str, Any], t: Translation, header: list[str]) -> str:
  """The YAML text: each translated key with a comment naming its source; the rest as the base gave them; the
  keys not translated listed at the end."""
  lines = [f"# {h}" for h in header]
  for section in config_lib.Config.__dataclass_fields__:
    values = merged.get(section)
    if not values:
      continue
    lines.append(f"{section}:")
    for key, value in values.items():
      source = t.sources.get(f"{section}.{key}")
      lines.append(f"  {key}: {_scalar(value)}" + (f"  # {source}" if source else ""))
  if t.unmapped:
    lines.append("")
    lines.append("# Not translated (no jaxseek equivalent; what to do instead):")
    lines += [f"#   {key}: {advice}" for key, advice in t.unmapped]
  if t.not_needed:
    lines.append("")
    lines.append("# Not needed in jaxseek:")
    lines += [f"#   {key}: {why}" for key, why in t.not_needed]
  return "\n".join(lines) + "\n"
