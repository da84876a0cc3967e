"""Run configuration: frozen dataclasses, YAML + dotted overrides, validation with one-line errors.

`load(path, overrides)` reads a YAML file whose top-level keys are the sections below, applies
`section.key=value` overrides (values parsed as YAML), checks every key and type, and validates the values
that can be checked before the devices are known. Model field names are the Hugging Face `config.json` keys;
a model's `config.json` carries more keys than these (architectures, torch_dtype, ...), so it is read through
`jaxseek.convert.hf.model_config` (by `load_pretrained` and `scripts/from_deepspeed.py --model`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxseek.errors import UserError

MESH_AXES = ("pipeline", "data", "fsdp", "expert", "context", "tensor")
# Model keys that choose how the model runs (kernels, exchanges, their buffers, overlap, the tokens an over-full
# expert drops), never which arrays it has: a checkpoint resumes, evaluates and generates under any of their
# values, on any platform (checkpoint.py; `portable`).
EXECUTION_KEYS = ("attention_impl", "context_attention", "moe_matmul", "moe_dispatch", "moe_dispatch_dtype",
                  "moe_recv_factor", "moe_overlap_chunks", "overlap_streams", "moe_capacity_factor",
                  "moe_max_expert_shards", "moe_tensor")
# Their values that run on one kind of device only (GPU kernels, ragged-all-to-all exchanges): `portable` turns
# them back to auto, which picks the kernel or exchange of the platform at hand.
PLATFORM_CHOICES = {"attention_impl": ("mosaic", "triton", "cudnn"), "moe_matmul": ("tokamax", "tokamax_triton"),
                    "moe_dispatch": ("ragged", "two_stage")}
PAIRED_SCHEDULES = ("1f1b", "interleaved_1f1b")  # train.pipeline_overlap: ticks with a forward and a backward


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model, in Hugging Face `config.json` terms (DeepSeek LLM / MoE / V2 / V3)."""

  model_type: Literal["llama", "deepseek", "deepseek_v2", "deepseek_v3"] = "deepseek_v3"
  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 128
  num_hidden_layers: int = 2
  num_attention_heads: int = 4
  num_key_value_heads: int | None = None
  head_dim: int | None = None
  attention_bias: bool = False
  # Multi-head latent attention (V2, V3); kv_lora_rank=None means plain multi-head / grouped-query attention.
  q_lora_rank: int | None = None
  kv_lora_rank: int | None = None
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  # Mixture of experts; n_routed_experts=None means every layer is dense.
  n_routed_experts: int | None = None
  n_shared_experts: int = 0
  num_experts_per_tok: int = 1
  moe_intermediate_size: int = 0
  first_k_dense_replace: int = 0
  scoring_func: Literal["softmax", "sigmoid"] = "softmax"
  topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"] = "greedy"
  n_group: int = 1
  topk_group: int = 1
  norm_topk_prob: bool = False
  routed_scaling_factor: float = 1.0
  aux_loss_alpha: float = 0.0
  # Expert-parallel dispatch (jaxseek's own keys): buffer capacity as a multiple of the balanced load
  # (None = dropless, the worst-case buffer), and device-limited routing (None = a token may reach every
  # expert-axis shard).
  moe_capacity_factor: float | None = None
  moe_max_expert_shards: int | None = None
  # The grouped matmul of the routed experts: "blocked" (rows padded per expert to blocks, one block's matmuls
  # at a time: work ≈ the routed rows), "ragged_dot" (`lax.ragged_dot`: a grouped GEMM where the backend has
  # one, else a dense product with every expert), "tokamax" / "tokamax_triton" (tokamax's Mosaic GPU / Triton
  # grouped GEMM kernels, forward and backward; GPU only, 16-bit inputs); "auto" picks tokamax on GPU (blocked
  # for float32 compute or without tokamax), blocked on CPU, ragged_dot on TPU.
  moe_matmul: Literal["auto", "blocked", "ragged_dot", "tokamax", "tokamax_triton"] = "auto"
  # Expert-parallel dispatch (sharding/experts.py, docs/moe.md): "fixed" sends C rows to every expert shard with
  # all_to_all (padded: any backend); "ragged" exchanges the copy counts first, then sends exactly the routed
  # copies with ragged_all_to_all into one receive buffer per device, grouped by local expert (GPU, TPU: XLA:CPU
  # has no ragged-all-to-all); "two_stage" (node-limited; GPU, TPU, dropless): each token crosses to a node once,
  # then fans out within it. "auto": on GPU and TPU two_stage where the expert axis spans whole nodes and no
  # capacity factor is set, else ragged; fixed elsewhere (docs/moe.md).
  moe_dispatch: Literal["auto", "fixed", "ragged", "two_stage"] = "auto"
  # The ragged receive buffer of one round, R = ⌈moe_recv_factor · K·x⌉ rows for x local tokens (K·x = a shard's
  # balanced load); copies past R go in further rounds of the exchange (never dropped; moe_extra_round_fraction
  # counts them). One round always from f = min(P, E/K) on (P expert shards; the worst case is every source
  # sending min(K, e) copies of each token to one shard). Default 2.0: one round while no shard receives over
  # twice its balanced share, in 2 / min(P, E/K) of the worst-case buffer (bench-v3-1b on expert=8: 8192 rows
  # instead of 32,768).
  moe_recv_factor: float = 2.0
  # Dropless dispatch splits each token shard into this many chunks with independent exchanges, so that XLA may
  # run one chunk's dispatch and combine beside another chunk's expert GEMMs. Results are the same for any count;
  # with a capacity factor it is 1 (capacity holds per exchange). Default 1: compiled for 8 H200s, XLA's
  # scheduler overlaps less of the exchange with 2 chunks than with 1 (docs/moe.md, "Chunks beside each other").
  moe_overlap_chunks: int = 1
  # Each decoder block runs the rows of a microbatch as this many independent streams (rows i, i + n, …), in one
  # program: one stream's expert exchange can run while another's attention and expert GEMMs do. The rows each
  # device holds of a microbatch must divide by it; the loss and gradients are those of one stream up to
  # summation order. Default 1: a second stream holds a second set of the layer's buffers (docs/moe.md).
  overlap_streams: int = 1
  # The dispatched rows' dtype: null = the compute dtype; float8_e4m3fn sends each row as e4m3 with a float32
  # scale per 128 channels (dequantised on arrival); the results come back in the compute dtype.
  moe_dispatch_dtype: Literal["float8_e4m3fn"] | None = None
  # What mesh.tensor does in the routed experts (jaxseek's own key; Megatron's expert tensor parallelism): "split"
  # each expert's hidden width over tensor (every tensor rank dispatches the same tokens; the partial outputs are
  # summed over tensor), or "experts": the tensor ranks hold other experts (experts over expert × tensor, whole),
  # and each tensor rank dispatches its share of the sequence (1/tensor of the tokens), so every token is sent once
  # per tensor group (Megatron's expert tensor parallel size 1). Attention, the dense MLPs and the shared experts
  # stay split over tensor either way. n_routed_experts must divide by expert × tensor and train.seq_len by
  # context × tensor (docs/moe.md, "Tensor ranks as expert shards").
  moe_tensor: Literal["split", "experts"] = "split"
  # Attention (jaxseek's own key): "dense" (the reference: scores [T, S] in memory), "blocked" (online softmax
  # over key blocks, fully masked causal blocks skipped, memory linear in the length: any backend), or a tokamax
  # GPU kernel: "mosaic" (Mosaic GPU flash attention, Hopper and later, 16-bit inputs), "triton", "cudnn".
  # "auto": mosaic on GPU (triton for float32), blocked elsewhere (dense when the sequence is one block).
  # jaxseek/kernels/choice.py, docs/kernels.md.
  attention_impl: Literal["auto", "dense", "blocked", "mosaic", "triton", "cudnn"] = "auto"
  # Attention under context parallelism (jaxseek's own key): "gather" the keys and values (MLA: its latent) over
  # the axis at once, or pass their chunks round a "ring" (one chunk's keys, values and scores at a time: less
  # memory, more sequential steps), or "zigzag": the ring with the sequence stored as an early and a late chunk
  # per device, computing only the causally visible blocks (half the attention work, even over the devices).
  context_attention: Literal["gather", "ring", "zigzag"] = "gather"
  # Position encoding.
  max_position_embeddings: int = 4096
  rope_theta: float = 10000.0
  rope_scaling: dict | None = None
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  initializer_range: float = 0.02
  # Multi-token prediction depth (V3: 1): extra modules predicting token i+1+k from position i.
  num_nextn_predict_layers: int = 0

  @property
  def is_mla(self) -> bool:
    return self.kv_lora_rank is not None

  @property
  def is_moe(self) -> bool:
    return bool(self.n_routed_experts)

  @property
  def num_dense_layers(self) -> int:
    return min(self.first_k_dense_replace, self.num_hidden_layers) if self.is_moe else self.num_hidden_layers

  @property
  def num_moe_layers(self) -> int:
    return self.num_hidden_layers - self.num_dense_layers

  @property
  def kv_heads(self) -> int:
    return self.num_key_value_heads or self.num_attention_heads

  @property
  def dense_head_dim(self) -> int:
    return self.head_dim or self.hidden_size // self.num_attention_heads

  @property
  def attention_head_dims(self) -> tuple[int, int]:
    """(query/key, value) head dims of attention: MLA's nope + rope and v, else the dense head dim twice."""
    if self.is_mla:
      return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
    return self.dense_head_dim, self.dense_head_dim


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh sizes, outermost to innermost; one axis may be -1 (filled from the device count)."""

  pipeline: int = 1
  data: int = -1
  fsdp: int = 1
  expert: int = 1
  context: int = 1
  tensor: int = 1
  sequence_parallel: bool = False  # Megatron SP: the residual stream and its norms split on length over tensor
  num_cpu_devices: int | None = None  # simulated CPU devices per process (machines without an accelerator)
  allow_cross_host: bool = False  # let expert / tensor groups span processes (slow links); refused by default
  # devices per node for the expert exchange (consecutive in the mesh's order); null: the processes' hosts
  devices_per_node: int | None = None

  def sizes(self) -> dict[str, int]:
    return {a: getattr(self, a) for a in MESH_AXES}


@dataclasses.dataclass(frozen=True)
class DistConfig:
  """Multi-process start-up. Unset fields come from JAXSEEK_COORDINATOR / JAXSEEK_NUM_PROCESSES /
  JAXSEEK_PROCESS_ID, else SLURM or Open MPI are detected; a single process skips initialisation."""

  coordinator: str | None = None  # host:port of process 0
  num_processes: int | None = None
  process_id: int | None = None
  process_per: Literal["device", "node"] = "device"  # node: one process sees all of its node's GPUs
  init_timeout_s: int = 300
  heartbeat_timeout_s: int = 100  # a process silent this long is declared dead by the coordinator


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Input: `synthetic` (seeded random tokens), `python-stdlib` (this Python's own sources, byte-level),
  `python-package:NAME` (an installed package's sources, byte-level: pinned by its version), a folder
  written by scripts/prepare_data.py, or a list of such folders mixed by `weights` (see docs/data.md)."""

  source: str | tuple[str, ...] = "synthetic"
  weights: tuple[float, ...] = ()  # one per entry of a source list: shares of packed sequences; () = equal
  max_bytes: int = 8_000_000  # python-stdlib, python-package:NAME: corpus size
  seed: int = 0
  pack_bins: int = 16  # sequences filled together by first-fit packing: more bins, less padding
  prefetch: int = 2  # local batches prepared ahead in the background (0: on demand)
  worker_count: int = 0  # grain worker processes (0: one background thread in this process)
  verify_checksums: bool = True  # hash each shard against manifest.json when the pipeline starts

  def __post_init__(self):
    names = (self.source,) if isinstance(self.source, str) else self.source
    if not names:
      raise UserError("config key data.source: the list is empty; name at least one prepared folder")
    if len(names) > 1 and "synthetic" in names:
      raise UserError("config key data.source: synthetic cannot be mixed; use it alone or list only folders")
    if self.weights and len(self.weights) != len(names):
      raise UserError(f"config key data.weights: {len(self.weights)} weights for {len(names)} sources; "
                      f"give one weight per entry of data.source")
    if any(w <= 0 for w in self.weights):
      raise UserError(f"config key data.weights: {list(self.weights)} must all be positive")
    for key, low in (("pack_bins", 1), ("prefetch", 0), ("worker_count", 0)):
      if getattr(self, key) < low:
        raise UserError(f"config key data.{key}: {getattr(self, key)} must be ≥ {low}")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with warm-up and a cosine or warm-up-stable-decay schedule, global-norm clipping."""

  lr: float = 3e-4
  schedule: Literal["cosine", "wsd", "constant"] = "cosine"
  warmup_steps: int = 100
  decay_steps: int = 0  # wsd: length of the final linear decay; cosine: 0 means "until train.steps"
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  decay_embeddings: bool = False
  clip_norm: float = 1.0  # global-norm gradient clipping; 0 turns it off
  moments_dtype: Literal["float32", "bfloat16"] = "float32"  # AdamW mu and nu as stored (updated in float32)
  bias_update_rate: float = 0.001  # aux-loss-free balancing: correction-bias step per optimiser step


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The training run: global batch in sequences, sequence length, accumulation, dtypes."""

  steps: int = 100
  batch_size: int = 8
  seq_len: int = 128
  microbatches: int = 1  # gradient accumulation steps, or with mesh.pipeline > 1 the pipeline microbatches
  pipeline_repeats: int = 1  # circular pipeline: layer chunks (virtual stages) per pipeline stage; 1 is GPipe
  # gpipe (all forwards, then all backwards; circular with pipeline_repeats > 1), circular (the same, R ≥ 2),
  # 1f1b and interleaved_1f1b (R ≥ 2): one forward and one backward a tick, memory bounded by the stage count;
  # zero-bubble, the backward split into b and W (pipeline/zero_bubble.py): zb_h1 (R = 1, 1F1B's memory), zbv
  # (R = 2, two chunks a stage on a V), dualpipev (R = 2, DeepSeek's DualPipeV order on the V)
  pipeline_schedule: Literal["gpipe", "circular", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"] = "gpipe"
  # zb_h1 / zbv: the most stashes (what a W reads, kept from its b) a stage keeps; fewer cost memory, more fill
  # bubbles. 0: zbv S (pipeline stages), zb_h1 the fewest its fastest order needs
  pipeline_stashes: int = 0
  # table schedules: true, the backward recomputes the chunk's forward from its kept input (the least memory; b
  # costs two forwards); false, the forward keeps its residuals for the backward (zb_h1 / zbv / dualpipev: F = b =
  # W, the orders' unit bubbles; 1f1b / interleaved_1f1b: no forward run twice, Megatron's default), a chunk's
  # activations kept per microbatch in flight
  pipeline_recompute: bool = True
  # 1f1b / interleaved_1f1b: a tick whose forward and backward do not wait for each other runs both side by side in
  # one program (their chunks' layers unrolled), so each one's expert exchange can run beside the other's compute
  # (DualPipe's pairing; pipeline/executor.py). The same numbers; a larger program that needs more memory
  # (docs/pipeline.md: compile it with the explorer first)
  pipeline_overlap: bool = False
  seed: int = 0
  run_dir: str = "runs/default"
  compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # float16: with dynamic loss scaling
  param_dtype: Literal["float32", "bfloat16"] = "float32"
  remat: Literal["none", "save_dots", "minimal", "offload", "full"] = "none"  # what a layer keeps: model/remat.py
  # FP8 GEMMs of the attention, MLP and expert projections (kernels/fp8_gemm.py, docs/precision.md): false,
  # true = auto (mxfp8 on sm_100, rowwise on sm_89/sm_90 and off GPUs), tensorwise, rowwise, mxfp8, or blockwise
  # (DeepSeek's 1x128 / 128x128 scaling, emulated)
  fp8: Literal["none", "auto", "tensorwise", "rowwise", "mxfp8", "blockwise"] | bool = False
  # the head and cross entropy: "chunked" over tokens (no float32 logits [B, T, V] in memory) or "full" (the
  # reference): model/loss.py
  loss_impl: Literal["chunked", "full"] = "chunked"
  zero: Literal[1, 3] = 3  # 3: parameters, gradients, optimiser state sharded on fsdp; 1: only the optimiser state
  optimizer_memory: Literal["device", "host"] = "device"  # host: AdamW state in pinned host memory (GPU, TPU)
  grad_compression: Literal["none", "bf16", "int8", "powersgd"] = "none"  # the data-axis gradient sum:
  # sharding/compression.py, docs/compression.md
  powersgd_rank: int = 4  # grad_compression=powersgd: the rank of each weight matrix's gradient on the wire
  powersgd_start_step: int = 0  # grad_compression=powersgd: steps before this one sum in float32 (warm-up)
  loss_scale_init: float = 32768.0  # float16 compute: the first loss scale
  loss_scale_window: int = 1000  # float16 compute: the scale doubles after this many steps without overflow
  loss_scale_min: float = 1.0  # float16 compute: halving never takes the scale below this
  loss_scale_hysteresis: int = 1  # float16 compute: overflows tolerated (steps still skipped) before the scale halves
  mtp_loss_weight: float = 0.3  # λ: loss = main CE + λ / depth · Σ_k MTP CE_k
  on_nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss or gradient never reaches the parameters
  spike_sigma: float | None = None  # skip steps whose loss exceeds the window mean by this many std devs
  spike_window: int = 32
  step_timeout_s: float | None = None  # hang watchdog: exit non-zero when a step takes longer than this
  # GPU: XLA's latency-hiding scheduler orders the compiled step so that each collective runs beside compute it
  # does not wait for (false: XLA's default order, which minimises memory and runs every collective exposed)
  latency_hiding: bool = True
  # GPU: the memory the latency-hiding scheduler plans within, in % of XLA's limit (80% of the device less the
  # step's arguments; xla_gpu_memory_limit_slop_factor). Above it the scheduler orders for memory and overlaps
  # little, and its own estimate of a pipelined MoE step's peak runs about twice the compiled one: on such a
  # step try 200 and read the compiled memory first (python -m jaxseek.explore ... --compile --target)
  latency_hiding_memory: int = 95
  # GPU: the op costs the latency-hiding scheduler plans with (XLA's PGLE: a ProfiledInstructionsProto text file,
  # a measured profile, or the analytic one `python -m jaxseek.explore ... --compile --target T --pgle-profile
  # FILE` writes from the compiled step's kernels and transfers); null: XLA's own guesses, which cover a long
  # exchange with a few kernels
  pgle_profile: str | None = None
  # GPU, without train.pgle_profile: "rates" compiles the step twice, the second time planning with the op costs
  # of the first program's kernels and transfers timed at the GPU's achieved rates (explore/rates/<gpu>.toml, the
  # explorer's prediction; overlap.analytic_profile), so no profile needs making first; "xla": one compile with
  # XLA's own guesses
  op_costs: Literal["rates", "xla"] = "rates"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints in <train.run_dir>/checkpoints: every N steps and at the end, keep the latest K."""

  every: int = 0  # 0: only at the end (and on pre-emption)
  keep: int = 3
  keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this, permanently (0: none)
  async_save: bool = True  # training goes on while a save is written
  load_from: str | None = None  # another run's folder or checkpoint to start from (when run_dir has none)
  load_mode: Literal["params", "full"] = "params"  # load_from: parameters (fine-tuning) or the whole state


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
  """Logging cadence and outputs."""

  every: int = 10
  peak_tflops: float | None = None  # per device; None = detect
  tensorboard: bool = False  # also write TensorBoard scalars to <run_dir>/tensorboard
  prometheus_port: int | None = None  # serve Prometheus /metrics on this port (process 0)
  wandb: bool = False  # also log to Weights & Biases (pip install -e ".[wandb]"; entity, mode from WANDB_* vars)
  wandb_project: str = "jaxseek"
  wandb_name: str | None = None  # the W&B run's name (default: the run directory's name)
  profile_steps: tuple[int, ...] = ()  # [first, last]: a jax.profiler trace of those steps in <run_dir>/profile


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out evaluation during training (docs/evaluate.md): the loss on a fixed set of batches, the same each time."""

  source: str | None = None  # null: no evaluation; holdout: the held-out share of data.source; or a prepared folder
  holdout: float = 0.0  # eval.source=holdout: the share of data.source's documents held out (training never reads them)
  every: int = 0  # evaluate after every N steps (0: only at the end); always after the last step
  tokens: int = 65536  # token positions per evaluation, rounded up to whole train.batch_size × train.seq_len batches

  def __post_init__(self):
    if self.source == "synthetic":
      raise UserError("config key eval.source: synthetic is what training reads; use holdout or a prepared folder")
    if self.source == "holdout" and not 0 < self.holdout < 1:
      raise UserError(f"config key eval.holdout: {self.holdout} must be between 0 and 1 (exclusive) with "
                      f"eval.source=holdout, e.g. 0.01")
    if self.source != "holdout" and self.holdout:
      raise UserError(f"config key eval.holdout: {self.holdout} needs eval.source=holdout (now {self.source!r})")
    for key, low in (("every", 0), ("tokens", 1)):
      if getattr(self, key) < low:
        raise UserError(f"config key eval.{key}: {getattr(self, key)} must be ≥ {low}")


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  mesh: MeshConfig = MeshConfig()
  dist: DistConfig = DistConfig()
  data: DataConfig = DataConfig()
  optim: OptimConfig = OptimConfig()
  train: TrainConfig = TrainConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  metrics: MetricsConfig = MetricsConfig()
  eval: EvalConfig = EvalConfig()


# ---------------------------------------------------------------------------------------------- loading


def load(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
  """Reads YAML at `path` (None: defaults), applies `section.key=value` overrides, validates."""
  raw: dict[str, Any] = {}
  if path is not None:
    path = Path(path)
    if not path.is_file():
      raise UserError(f"config file {path} not found; pass an existing YAML file to --config (see configs/)")
    try:
      raw = yaml.safe_load(read_text(path, f"config file {path}", "pass a YAML file to --config")) or {}
    except yaml.YAMLError as e:
      line = getattr(getattr(e, "problem_mark", None), "line", None)
      where = f" at line {line + 1}" if line is not None else ""
      raise UserError(f"config file {path} is not valid YAML{where}; fix its syntax") from None
    if not isinstance(raw, dict):
      raise UserError(f"config file {path} must hold a mapping of sections (model:, train:, ...)")
  for item in overrides:
    section, field, parsed = parse_override(item)
    raw.setdefault(section, {})
    if not isinstance(raw[section], dict):
      raise UserError(f"config section {section!r} must be a mapping")
    raw[section][field] = parsed
  cfg = from_dict(raw)
  validate(cfg)
  return cfg


# Keys that name files or folders: `~` is expanded (as a shell would have), and an empty value is refused.
PATH_KEYS = ("data.source", "eval.source", "train.run_dir", "train.pgle_profile", "checkpoint.load_from")


def expand_paths(cfg: Config) -> Config:
  """`cfg` with `~` and `~user` expanded in PATH_KEYS; an empty path (an unset shell variable) or a user that
  does not exist is refused."""
  def one(key: str, path: str) -> str:
    if not path.strip():
      raise UserError(f"config key {key}: the path is empty (an unset shell variable?); name a file or folder"
                      + (", or null" if key != "train.run_dir" and key != "data.source" else ""))
    expanded = os.path.expanduser(path)
    if expanded.startswith("~"):
      raise UserError(f"config key {key}: {path} starts with ~ but names no user's home; write the path out")
    return expanded

  sections = {}
  for key in PATH_KEYS:
    section, field = key.split(".")
    value = getattr(getattr(cfg, section), field)
    if value is None:
      continue
    value = one(key, value) if isinstance(value, str) else tuple(one(f"{key}[{i}]", v) for i, v in enumerate(value))
    sections[section] = dataclasses.replace(sections.get(section, getattr(cfg, section)), **{field: value})
  return dataclasses.replace(cfg, **sections)


def read_text(path: Path, what: str, fix: str) -> str:
  """The file's UTF-8 text; UserError "<what> is not text (byte N is not UTF-8); <fix>" when it is not."""
  data = Path(path).read_bytes()
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise UserError(f"{what} is not text (byte {e.start} is not UTF-8); {fix}") from None


def parse_override(item: str, example: str = "train.steps=100") -> tuple[str, str, Any]:
  """`section.key=value` → (section, key, value read as YAML; text that is not YAML stays a string)."""
  key, sep, value = item.partition("=")
  section, _, field = key.strip().partition(".")
  if not sep or not section or not field or "." in field:
    raise UserError(f"override {item!r} must look like section.key=value, e.g. {example}")
  try:
    parsed = yaml.safe_load(value) if value else ""
  except yaml.YAMLError:
    parsed = value
  return section, field, parsed


def from_dict(raw: dict[str, Any]) -> Config:
  """Builds a Config from nested dicts, rejecting unknown keys and wrong types."""
  sections = {}
  for name, value in raw.items():
    if name not in _SECTIONS:
      raise UserError(f"unknown config section {name!r}; valid sections: {', '.join(_SECTIONS)}")
    if value is None:
      continue
    if not isinstance(value, dict):
      raise UserError(f"config section {name!r} must be a mapping of keys, got {value!r}")
    sections[name] = _build(_SECTIONS[name], value, name)
  return expand_paths(Config(**sections))


def portable(model: ModelConfig) -> ModelConfig:
  """A saved model config as it runs here: the kernel and exchange choices that name one platform's
  (PLATFORM_CHOICES, e.g. a GPU run's moe_dispatch=ragged) back to auto, which picks this platform's. The
  numbers are the same: only the kernel or the exchange differs."""
  return dataclasses.replace(model, **{k: "auto" for k, values in PLATFORM_CHOICES.items()
                                       if getattr(model, k) in values})


def to_dict(cfg: Config) -> dict[str, Any]:
  return dataclasses.asdict(cfg)


def dump(cfg: Config, path: str | Path) -> None:
  """Writes the resolved config as YAML (loadable by `load`)."""
  Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


_SECTIONS = typing.get_type_hints(Config)


def _build(cls: type, values: dict[str, Any], section: str) -> Any:
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for key, value in values.items():
    if key not in hints:
      valid = ", ".join(f.name for f in dataclasses.fields(cls))
      raise UserError(f"unknown config key {section}.{key}; valid keys in {section}: {valid}")
    kwargs[key] = _coerce(value, hints[key], f"{section}.{key}")
  return cls(**kwargs)


def _coerce(value: Any, tp: Any, key: str) -> Any:
  """Checks `value` against the annotation `tp`; ints are accepted where floats are expected."""
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    options = typing.get_args(tp)
    if value is None and type(None) in options:
      return None
    errors = []
    for option in options:
      if option is type(None):
        continue
      try:
        return _coerce(value, option, key)
      except UserError as e:
        errors.append(e)
    literals = [a for o in options if typing.get_origin(o) is Literal for a in typing.get_args(o)]
    if literals and bool in options:  # e.g. Literal["auto"] | bool: name every choice in one line
      raise UserError(f"config key {key}: {value!r} is not one of true, false, {', '.join(map(repr, literals))}")
    raise errors[0]
  if origin is Literal:
    allowed = typing.get_args(tp)
    if value not in allowed:
      raise UserError(f"config key {key}: {value!r} is not one of {', '.join(map(repr, allowed))}")
    return value
  if tp is bool:
    if isinstance(value, bool):
      return value
    raise UserError(f"config key {key}: expected true or false, got {value!r}")
  if tp is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    raise UserError(f"config key {key}: expected an integer, got {value!r}")
  if tp is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
    if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
      try:
        return float(value)
      except ValueError:
        pass
    raise UserError(f"config key {key}: expected a number, got {value!r}")
  if tp is str:
    if isinstance(value, str):
      return value
    raise UserError(f"config key {key}: expected a string, got {value!r}")
  if tp is dict or origin is dict:
    if isinstance(value, dict):
      return value
    raise UserError(f"config key {key}: expected a mapping, got {value!r}")
  if origin is tuple:  # tuple[X, ...]: a YAML list
    if isinstance(value, (list, tuple)):
      item = typing.get_args(tp)[0]
      return tuple(_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    raise UserError(f"config key {key}: expected a list, got {value!r}")
  raise TypeError(f"unsupported config annotation {tp} for {key}")


# ------------------------------------------------------------------------------------------- validation


def validate(cfg: Config, model_only: bool = False) -> None:
  """Checks values that do not depend on the devices (the mesh builder checks the device count), section by
  section. `model_only`: skips what ties the model to this run's sequence length (a config.json describes a
  model, not a run)."""
  _positive(cfg, "model.vocab_size", "model.hidden_size", "model.num_hidden_layers", "model.num_attention_heads",
            "train.steps", "train.batch_size", "train.seq_len", "train.microbatches", "train.pipeline_repeats",
            "train.loss_scale_init", "train.loss_scale_window", "train.loss_scale_min", "train.loss_scale_hysteresis",
            "metrics.every")
  _check_mesh(cfg)
  _check_model(cfg, model_only)
  _check_metrics(cfg)
  _check_ranges(cfg)
  _check_optim(cfg)
  _check_train(cfg)
  _check_eval(cfg)
  check_mesh_fit(cfg, cfg.mesh.sizes())


def _check_mesh(cfg: Config) -> None:
  if cfg.mesh.num_cpu_devices is not None and cfg.mesh.num_cpu_devices < 1:
    raise UserError(f"config key mesh.num_cpu_devices: {cfg.mesh.num_cpu_devices} must be ≥ 1, or null to use the "
                    f"real devices (not simulated)")
  if cfg.mesh.devices_per_node is not None and cfg.mesh.devices_per_node < 1:
    raise UserError(f"config key mesh.devices_per_node: {cfg.mesh.devices_per_node} must be ≥ 1, or null to take "
                    f"the nodes from the processes' hosts")
  sizes = cfg.mesh.sizes()
  if list(sizes.values()).count(-1) > 1:
    raise UserError("at most one mesh axis may be -1 (auto-filled); set the others to explicit sizes")
  for axis, size in sizes.items():
    if size == 0 or size < -1:
      raise UserError(f"config key mesh.{axis}: {size} is not a valid axis size; use a positive integer or -1")


def _check_model(cfg: Config, model_only: bool) -> None:
  m, t = cfg.model, cfg.train
  if m.is_mla:
    _positive(cfg, "model.qk_nope_head_dim", "model.qk_rope_head_dim", "model.v_head_dim")
    if m.qk_rope_head_dim % 2:
      raise UserError(f"config key model.qk_rope_head_dim: {m.qk_rope_head_dim} must be even (RoPE rotates pairs)")
  else:
    if m.num_attention_heads % m.kv_heads:
      raise UserError(f"config key model.num_key_value_heads: {m.kv_heads} must divide "
                      f"model.num_attention_heads={m.num_attention_heads}")
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
      raise UserError(f"config key model.num_attention_heads: {m.num_attention_heads} must divide "
                      f"model.hidden_size={m.hidden_size}, or set model.head_dim")
  if m.is_moe:
    _positive(cfg, "model.moe_intermediate_size", "model.num_experts_per_tok", "model.n_group", "model.topk_group")
    if m.num_experts_per_tok > m.n_routed_experts:
      raise UserError(f"config key model.num_experts_per_tok: {m.num_experts_per_tok} exceeds "
                      f"model.n_routed_experts={m.n_routed_experts}")
    if m.n_routed_experts % m.n_group:
      raise UserError(f"config key model.n_group: {m.n_group} must divide model.n_routed_experts={m.n_routed_experts}")
    if m.topk_group > m.n_group:
      raise UserError(f"config key model.topk_group: {m.topk_group} exceeds model.n_group={m.n_group}")
    if m.topk_method == "noaux_tc" and m.scoring_func != "sigmoid":
      raise UserError("config key model.topk_method: noaux_tc needs model.scoring_func=sigmoid")
  if m.attention_bias:
    raise UserError("config key model.attention_bias: true is not supported (DeepSeek models have no attention "
                    "biases); set it to false")
  if m.max_position_embeddings < t.seq_len and not model_only:
    raise UserError(f"config key model.max_position_embeddings: {m.max_position_embeddings} is below "
                    f"train.seq_len={t.seq_len}; raise it (with model.rope_scaling to extend a trained context)")
  _check_rope_scaling(m.rope_scaling)
  if m.is_moe and m.topk_method != "greedy" and m.n_group > 1:
    per_group = m.n_routed_experts // m.n_group
    if m.topk_group * per_group < m.num_experts_per_tok:
      raise UserError(f"config key model.topk_group: {m.topk_group} groups of {per_group} experts cannot hold "
                      f"model.num_experts_per_tok={m.num_experts_per_tok}; raise topk_group or lower n_group")
    if m.topk_method == "noaux_tc" and per_group < 2:
      raise UserError(f"config key model.n_group: {m.n_group} groups of {per_group} expert leave noaux_tc no "
                      f"top-2 sum to rank groups by; use at most {m.n_routed_experts // 2} groups")
  if m.num_nextn_predict_layers < 0:
    raise UserError(f"config key model.num_nextn_predict_layers: {m.num_nextn_predict_layers} must be ≥ 0")
  if m.num_nextn_predict_layers >= t.seq_len:
    raise UserError(f"config key model.num_nextn_predict_layers: {m.num_nextn_predict_layers} must be below "
                    f"train.seq_len={t.seq_len}")
  if m.moe_capacity_factor is not None and m.moe_capacity_factor <= 0:
    raise UserError(f"config key model.moe_capacity_factor: {m.moe_capacity_factor} must be > 0, or null for "
                    f"dropless dispatch")
  if m.moe_max_expert_shards is not None and m.moe_max_expert_shards < 1:
    raise UserError(f"config key model.moe_max_expert_shards: {m.moe_max_expert_shards} must be ≥ 1, or null")
  _check_dispatch(m)


def _check_dispatch(m: ModelConfig) -> None:
  if m.moe_dispatch == "two_stage" and m.moe_capacity_factor is not None:
    raise UserError(f"config key model.moe_dispatch: two_stage is dropless and model.moe_capacity_factor="
                    f"{m.moe_capacity_factor:g} drops; set model.moe_capacity_factor=null, or model.moe_dispatch="
                    f"auto")
  if m.moe_overlap_chunks < 1:
    raise UserError(f"config key model.moe_overlap_chunks: {m.moe_overlap_chunks} must be ≥ 1 (1: one exchange "
                    f"per MoE layer run)")
  if m.overlap_streams < 1:
    raise UserError(f"config key model.overlap_streams: {m.overlap_streams} must be ≥ 1 (1: the rows in one stream)")
  if m.moe_recv_factor <= 0:
    raise UserError(f"config key model.moe_recv_factor: {m.moe_recv_factor} must be > 0 (receive rows as a multiple "
                    f"of K × local tokens; min(mesh.expert, n_routed_experts / num_experts_per_tok) is dropless)")


def _check_metrics(cfg: Config) -> None:
  profile = cfg.metrics.profile_steps
  if profile and (len(profile) != 2 or not 1 <= profile[0] <= profile[1]):
    raise UserError(f"config key metrics.profile_steps: {list(profile)} must be [first, last] with "
                    f"1 ≤ first ≤ last, e.g. [10,12]")
  port = cfg.metrics.prometheus_port
  if port is not None and not 0 <= port <= 65535:
    raise UserError(f"config key metrics.prometheus_port: {port} is not a port number (0-65535; 0 picks a free one)")
  _check_wandb_project(cfg.metrics.wandb_project)
  import importlib.util

  if cfg.metrics.wandb and importlib.util.find_spec("wandb") is None:
    raise UserError('config key metrics.wandb: true needs the wandb package: pip install -e ".[wandb]" (or set '
                    'metrics.wandb=false)')


def _check_wandb_project(project: str) -> None:
  """A name W&B takes as a project (its own rule: at most 128 characters, none of / \\ # ? % :)."""
  entity, slash, name = project.partition("/")
  if slash and entity.strip() and name.strip() and "/" not in name:
    raise UserError(f"config key metrics.wandb_project: {project!r} names an entity and a project; set the entity "
                    f"apart: WANDB_ENTITY={entity} and metrics.wandb_project={name}")
  if not project.strip():
    raise UserError(f"config key metrics.wandb_project: {project!r} is empty; name a W&B project, e.g. "
                    f"metrics.wandb_project=jaxseek")
  bad = "".join(c for c in "/\\#?%:" if c in project)
  if bad or len(project) > 128:
    raise UserError(f"config key metrics.wandb_project: {project!r} is not a W&B project name (at most 128 "
                    f"characters, none of / \\ # ? % :); choose another")


# Weights, rates, counts and intervals: (key, the test a meaningful value passes, the valid values in words); a
# float must be finite too.
RANGES = (
    ("optim.lr", lambda v: v >= 0, "≥ 0"),
    ("optim.warmup_steps", lambda v: v >= 0, "≥ 0"),
    ("optim.decay_steps", lambda v: v >= 0, "≥ 0 (cosine: 0 decays until train.steps)"),
    ("optim.min_lr_ratio", lambda v: 0 <= v <= 1, "between 0 and 1, e.g. 0.1"),
    ("optim.b1", lambda v: 0 <= v < 1, "≥ 0 and below 1, e.g. 0.9"),
    ("optim.b2", lambda v: 0 <= v < 1, "≥ 0 and below 1, e.g. 0.95"),
    ("optim.eps", lambda v: v > 0, "> 0, e.g. 1e-8"),
    ("optim.weight_decay", lambda v: v >= 0, "≥ 0"),
    ("optim.bias_update_rate", lambda v: v >= 0, "≥ 0 (0 freezes the correction biases)"),
    ("train.mtp_loss_weight", lambda v: v >= 0, "≥ 0 (0 leaves the MTP heads untrained)"),
    ("train.spike_sigma", lambda v: v is None or v > 0, "> 0, or null to skip no spikes"),
    ("train.spike_window", lambda v: v >= 2, "≥ 2 (the losses a standard deviation is taken over)"),
    ("train.step_timeout_s", lambda v: v is None or v > 0, "> 0, or null for no hang watchdog"),
    ("checkpoint.every", lambda v: v >= 0, "≥ 0 (0: only at the end)"),
    ("checkpoint.keep", lambda v: v >= 1, "≥ 1 (the latest checkpoints kept)"),
    ("checkpoint.keep_every", lambda v: v >= 0, "≥ 0 (0: none kept permanently)"),
    ("metrics.peak_tflops", lambda v: v is None or v > 0, "> 0, or null to detect the device's"),
)


def _check_ranges(cfg: Config) -> None:
  for key, meaningful, valid in RANGES:
    section, field = key.split(".")
    value = getattr(getattr(cfg, section), field)
    if (isinstance(value, float) and not math.isfinite(value)) or not meaningful(value):
      raise UserError(f"config key {key}: {value} must be {valid}")
  t = cfg.train
  if t.loss_scale_min > t.loss_scale_init:
    raise UserError(f"config key train.loss_scale_min: {t.loss_scale_min} exceeds train.loss_scale_init="
                    f"{t.loss_scale_init}; lower it (1 is the usual floor)")


def _check_optim(cfg: Config) -> None:
  if cfg.optim.clip_norm < 0:
    raise UserError(f"config key optim.clip_norm: {cfg.optim.clip_norm} must be ≥ 0 (0 turns clipping off)")


# train.latency_hiding_memory's ceiling: the scheduler's own estimate of a pipelined MoE step's peak runs about
# twice the compiled one, so 200 plans for about the device; 400, twice that by either measure.
MAX_LATENCY_HIDING_MEMORY = 400


def _check_train(cfg: Config) -> None:
  t = cfg.train
  if t.pgle_profile is not None and not os.path.isfile(t.pgle_profile):
    raise UserError(f"config key train.pgle_profile: {t.pgle_profile} is not a file; write one with python -m "
                    f"jaxseek.explore --config FILE ... --compile --target h100 --pgle-profile {t.pgle_profile}, or "
                    f"set null")
  if t.pgle_profile is not None:
    from jaxseek.kernels.choice import pgle_profile_error
    if (why := pgle_profile_error(t.pgle_profile)) is not None:
      raise UserError(f"config key train.pgle_profile: {t.pgle_profile} {why}; write one with python -m "
                      f"jaxseek.explore --config FILE ... --compile --target h100 --pgle-profile FILE, or set null")
  if not 1 <= t.latency_hiding_memory <= MAX_LATENCY_HIDING_MEMORY:
    raise UserError(f"config key train.latency_hiding_memory: {t.latency_hiding_memory} must be between 1 and "
                    f"{MAX_LATENCY_HIDING_MEMORY} (% of XLA's memory limit, 80% of the device; XLA's default is 95, "
                    f"and past {MAX_LATENCY_HIDING_MEMORY} the scheduler would plan for far more memory than a "
                    f"device has)")
  if t.powersgd_rank < 1:
    raise UserError(f"config key train.powersgd_rank: {t.powersgd_rank} must be ≥ 1 (4 is a good start)")
  if t.powersgd_start_step < 0:
    raise UserError(f"config key train.powersgd_start_step: {t.powersgd_start_step} must be ≥ 0 (0: compress "
                    f"from the first step)")
  if t.batch_size % t.microbatches:
    raise UserError(f"config key train.microbatches: {t.microbatches} must divide train.batch_size={t.batch_size}")
  if t.pipeline_schedule in ("circular", "interleaved_1f1b") and t.pipeline_repeats < 2:
    raise UserError(f"config key train.pipeline_schedule: {t.pipeline_schedule} runs train.pipeline_repeats ≥ 2 "
                    f"chunks per stage, got {t.pipeline_repeats}; set train.pipeline_repeats=2 or more")
  if t.pipeline_schedule in ("zbv", "dualpipev") and t.pipeline_repeats != 2:
    raise UserError(f"config key train.pipeline_schedule: {t.pipeline_schedule} runs two chunks per stage (a V: "
                    f"stage s holds "
                    f"virtual stages s and 2S-1-s), got train.pipeline_repeats={t.pipeline_repeats}; set "
                    f"train.pipeline_repeats=2")
  if t.pipeline_stashes < 0 or (t.pipeline_stashes and t.pipeline_schedule not in ("zb_h1", "zbv")):
    raise UserError(f"config key train.pipeline_stashes: {t.pipeline_stashes} caps the stashes of zb_h1 and zbv "
                    f"(a count ≥ 1, or 0 for the order's own); train.pipeline_schedule={t.pipeline_schedule} keeps "
                    f"its own, set 0")
  if not t.pipeline_recompute and t.pipeline_schedule in ("gpipe", "circular"):
    raise UserError(f"config key train.pipeline_recompute: false keeps the forward's residuals for the backward of "
                    f"a table schedule (1f1b, interleaved_1f1b, zb_h1, zbv, dualpipev); train.pipeline_schedule="
                    f"{t.pipeline_schedule} keeps every microbatch's activations already, set true")
  if not t.pipeline_recompute and t.pipeline_overlap:
    raise UserError("config key train.pipeline_overlap: true pairs a tick's forward with a backward that "
                    "recomputes its chunk; with train.pipeline_recompute=false set train.pipeline_overlap=false")
  if t.pipeline_overlap and t.pipeline_schedule not in PAIRED_SCHEDULES:
    raise UserError(f"config key train.pipeline_overlap: true runs a tick's forward beside its backward, and "
                    f"train.pipeline_schedule={t.pipeline_schedule} has no such ticks; use "
                    f"{' or '.join(PAIRED_SCHEDULES)}, or set false")
  if t.pipeline_overlap and cfg.mesh.pipeline == 1:
    raise UserError("config key train.pipeline_overlap: true pairs the ticks of a pipeline schedule and "
                    "mesh.pipeline=1 runs none; set mesh.pipeline > 1, or train.pipeline_overlap=false")
  if t.pipeline_schedule in ("1f1b", "zb_h1") and t.pipeline_repeats != 1:
    raise UserError(f"config key train.pipeline_schedule: {t.pipeline_schedule} runs one chunk per stage, got "
                    f"train.pipeline_repeats={t.pipeline_repeats}; use interleaved_1f1b for several")


def _check_eval(cfg: Config) -> None:
  if cfg.eval.source == "holdout" and "synthetic" in ((cfg.data.source,) if isinstance(cfg.data.source, str)
                                                       else cfg.data.source):
    raise UserError("config key eval.source: holdout needs documents, data.source=synthetic has none; use a "
                    "prepared folder for data.source or eval.source")


# YaRN's keys (DeepSeek's and transformers' names); factor and original_max_position_embeddings are needed.
YARN_KEYS = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"}


def _check_rope_scaling(scaling: dict | None) -> None:
  if not scaling:
    return
  kind = scaling.get("rope_type", scaling.get("type"))
  if kind in (None, "default") and set(scaling) <= {"type", "rope_type"}:
    return
  if kind != "yarn":
    raise UserError(f"config key model.rope_scaling: type {kind!r} is not supported; use yarn, or null for none")
  unknown = sorted(set(scaling) - YARN_KEYS - {"type", "rope_type"})
  if unknown:
    raise UserError(f"config key model.rope_scaling: unknown yarn key {unknown[0]!r}; known: {sorted(YARN_KEYS)}")
  for key in ("factor", "original_max_position_embeddings"):
    if key not in scaling:
      raise UserError(f"config key model.rope_scaling: yarn needs {key}; add it")
  for key in sorted(YARN_KEYS & set(scaling)):
    value = scaling[key]
    if key == "truncate":
      if not isinstance(value, bool):
        raise UserError(f"config key model.rope_scaling: truncate must be true or false, got {value!r}")
    elif value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
      raise UserError(f"config key model.rope_scaling: {key} must be a positive number, got {value!r}")


def check_mesh_fit(cfg: Config, sizes: dict[str, int]) -> None:
  """Each sharded dimension must divide evenly by the mesh axes the rules put it on (axes still -1 are
  skipped: the mesh builder checks again once they are known)."""
  m = cfg.model
  checks = [("model.hidden_size", m.hidden_size, ("fsdp",)), ("model.vocab_size", m.vocab_size, ("tensor",)),
            ("model.num_attention_heads", m.num_attention_heads, ("tensor",)),
            ("model.intermediate_size", m.intermediate_size, ("tensor",))]
  if not m.is_mla:
    checks.append(("model.num_key_value_heads", m.kv_heads, ("tensor",)))
  if m.is_moe and m.moe_tensor == "experts":
    checks += [("model.n_routed_experts", m.n_routed_experts, ("expert", "tensor"))]
  elif m.is_moe:
    checks += [("model.moe_intermediate_size", m.moe_intermediate_size, ("tensor",)),
               ("model.n_routed_experts", m.n_routed_experts, ("expert",))]
  for key, value, axes in checks:
    if any(sizes[a] == -1 for a in axes):
      continue
    size = 1
    for a in axes:
      size *= sizes[a]
    if value % size:
      names = " × ".join(f"mesh.{a}={sizes[a]}" for a in axes)
      raise UserError(f"config key {key}: {value} is not divisible by {names}; change the mesh or the model size")
  on_tensor = cfg.mesh.sequence_parallel or (m.is_moe and m.moe_tensor == "experts")
  length = sizes["context"] * (sizes["tensor"] if on_tensor else 1)
  if length > 0 and cfg.train.seq_len % length:
    why = "sequence parallelism" if cfg.mesh.sequence_parallel else "model.moe_tensor=experts"
    names = "mesh.context" + (f" × mesh.tensor ({why})" if on_tensor else "")
    raise UserError(f"config key train.seq_len: {cfg.train.seq_len} tokens are not divisible by {names} = "
                    f"{length}; change the sequence length or the mesh")
  if cfg.model.context_attention == "zigzag" and sizes["context"] > 1 and cfg.train.seq_len % (2 * sizes["context"]):
    raise UserError(f"config key train.seq_len: {cfg.train.seq_len} tokens do not split into 2 × mesh.context = "
                    f"{2 * sizes['context']} chunks for model.context_attention=zigzag; change the sequence length")
  shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  if shards > 0 and (cfg.train.batch_size // cfg.train.microbatches) % shards:
    raise UserError(f"config key train.batch_size: {cfg.train.batch_size} sequences / {cfg.train.microbatches} "
                    f"microbatches is not divisible by the batch shards data × fsdp × expert = {shards}")
  rows, streams = cfg.train.batch_size // cfg.train.microbatches // max(shards, 1), cfg.model.overlap_streams
  if shards > 0 and rows % streams:
    raise UserError(f"config key model.overlap_streams: {streams} streams do not divide the {rows} rows a device "
                    f"holds of each microbatch (train.batch_size / train.microbatches / data × fsdp × expert); use a "
                    f"divisor of {rows}, or fewer microbatches")


def _positive(cfg: Config, *keys: str) -> None:
  for key in keys:
    section, field = key.split(".")
    value = getattr(getattr(cfg, section), field)
    if value is None or value <= 0:
      raise UserError(f"config key {key}: {value!r} must be a positive number")
