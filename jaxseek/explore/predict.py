"""Step-time predictions at achieved rates: the explorer's `prediction` beside its bound (`step_time_s`).

The bound times every FLOP at the datasheet peak and every byte at its link's nominal rate, with nothing overlapped
and nothing else on the device. The prediction times the same work at the rates kernels and links reach in public
microbenchmarks (`rates/<gpu>.toml`: every constant with its source, none fitted to an end-to-end run) and adds
what the bound leaves out:

  compute      the step's FLOPs in three kinds, each at its achieved rate: GEMMs (by the size of the smallest
               matrix side, float8 where train.fp8 runs), the routed experts' grouped GEMMs (by the rows each expert
               receives per call), attention (by head size and sequence length; its backward does 2.5 forwards of
               FLOPs in FlashAttention's kernels); with the bound's recomputation and pipeline bubble scaled alike
  memory       the memory-bound kernels between the GEMMs (norms, residual adds, SwiGLU, rotary embedding, the
               MoE permutation, FP8's casts and scales) at the achieved HBM bandwidth: MEMORY_PASSES per layer
  launch       a per-kernel gap for the kernels a layer launches (KERNELS per layer and microbatch)
  optimiser    AdamW's update: parameters, gradients and moments read, parameters and moments written, at HBM rate
  exchange     the expert axis's all-to-alls at the achieved all-to-all bus bandwidth of their link, less what runs
               beside compute (below)
  reductions   the gradient sums over the batch axes and the pipeline's outer weights, at the achieved
               all-reduce / all-gather / reduce-scatter bus bandwidths
  other        the rest (tensor-parallel all-reduces, fsdp gathers, context gathers, pipeline sends)

Each collective takes latency + bytes / (bandwidth · m / (m + half)), m its message (bytes / count) and half the
message at which the link reaches half its bus bandwidth. What runs beside compute: without --compile, the rules
of `_hidden` (what the step's structure lets overlap); with --compile, the compiled program's own overlap, scored
at the achieved rates (`overlap.overlap` with `achieved_rates`), whatever costs the scheduler was given.
"""

from __future__ import annotations

import functools
import math
import tomllib
from importlib import resources
from typing import Any

from jaxseek.errors import UserError

# Elements of the hidden width D (and of the expert/MLP width F) a layer's memory-bound kernels read or write per
# token, forward and backward (pointwise passes between GEMMs; counted from the layer's code, model/layers.py):
# two RMSNorms (read x, write x̂; backward reads x, x̂'s cotangent, writes dx: 2 + 3 each), two residual adds
# (3 + 2), rotary embedding of q and k (~1 D each way), attention's input/output casts (~2), and per FFN width
# SwiGLU (read gate and up, write h: 3; backward 5). The MoE permutation gathers each token's K copies and
# scatters them back (2 + 2 per copy, forward and backward); FP8 adds an amax pass and a cast per GEMM input (3).
MEMORY_PASSES = {"hidden": 24.0, "ffn": 8.0, "copies": 8.0, "fp8": 3.0}
# kernels a transformer layer launches per microbatch, forward and backward (fused by XLA); the MoE layer's
# routing, permutation and exchange add about as many again
KERNELS = {"dense": 60, "moe": 120}
RATE_FILES = ("a100", "h100", "h800", "h200", "b200")
LINK_KEYS = {"all-reduce": "allreduce", "all-gather": "allgather", "reduce-scatter": "allgather",
             "all-to-all": "alltoall", "ragged-all-to-all": "alltoall", "collective-permute": "sendrecv",
             "collective-broadcast": "allgather"}


@functools.cache
def rates(gpu: str) -> dict[str, Any]:
  """The achieved rates of `gpu` (one of RATE_FILES) from rates/<gpu>.toml."""
  if gpu not in RATE_FILES:
    raise UserError(f"no achieved rates for {gpu!r}: known GPUs are {', '.join(RATE_FILES)}")
  return tomllib.loads(resources.files("jaxseek.explore.rates").joinpath(f"{gpu}.toml").read_text())


def gpu_of(hw) -> str:
  """Which rates file a Hardware's device takes: its name ("h800-80g", a detected "NVIDIA H200"); a bare memory
  size takes the H100's."""
  name = hw.name.lower().replace(" ", "")
  return next((g for g in ("h800", "h200", "b200", "a100", "h100") if g in name), "h100")


def curve(points: list[list[float]], x: float) -> float:
  """Piecewise linear in log2(x) between the points [[x, y], ...] (sorted by x), clamped at both ends."""
  xs = [math.log2(p[0]) for p in points]
  ys = [p[1] for p in points]
  v = math.log2(max(x, 1e-9))
  if v <= xs[0]:
    return ys[0]
  for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
    if v <= x1:
      return y0 + (y1 - y0) * (v - x0) / (x1 - x0)
  return ys[-1]


def flop_kinds(cfg, flops_per_token: float, recipe_flops_per_token: float) -> dict[str, float]:
  """Training FLOPs per token by kind: attention (scores and values), routed experts, other GEMMs; and of those
  the FP8 recipe's (metrics.recipe_flops_per_token: projections and experts)."""
  m = cfg.model
  depth = m.num_nextn_predict_layers
  qk, v = (m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim) if m.is_mla else (m.dense_head_dim,) * 2
  attention = 3 * (m.num_hidden_layers + depth) * 2 * m.num_attention_heads * (qk + v) * (cfg.train.seq_len + 1) / 2
  moe_layers = m.num_moe_layers + (depth if m.num_moe_layers else 0)
  routed = 6 * moe_layers * m.num_experts_per_tok * 3 * m.hidden_size * m.moe_intermediate_size \
      if m.n_routed_experts and moe_layers else 0.0
  return {"attention": attention, "routed": routed, "gemm": flops_per_token - attention - routed,
          "recipe": recipe_flops_per_token, "head_dim": qk}


def _device_tokens(cfg, sizes: dict[str, int]) -> tuple[float, float]:
  """Tokens a device runs per step, and per microbatch (the batch split over data, fsdp, expert and context)."""
  t = cfg.train
  split = sizes["data"] * sizes["fsdp"] * sizes["expert"] * sizes["context"]
  step = t.batch_size * t.seq_len / split
  return step, step / t.microbatches


def compute_ratio(cfg, sizes: dict[str, int], hw, model, fp8: str | None) -> dict[str, float]:
  """The time of the step's FLOPs at achieved rates over their time at `hw`'s peaks (the bound's), with the
  efficiencies used: GEMM by its smallest side, grouped GEMM by rows per expert and call, attention."""
  r, m = rates(gpu_of(hw)), cfg.model
  kinds = flop_kinds(cfg, model.flops_per_token, model.recipe_flops_per_token)
  _, micro = _device_tokens(cfg, sizes)
  gemm_eff = curve(r["gemm"]["size_efficiency"], min(micro, m.hidden_size / sizes["tensor"]))
  chunks = m.moe_overlap_chunks * m.overlap_streams
  rows = micro * (m.num_experts_per_tok or 0) * sizes["expert"] / (m.n_routed_experts or 1) / chunks
  grouped_eff = curve(r["gemm"]["grouped_efficiency"], rows) if m.n_routed_experts and m.num_moe_layers else 1.0
  bf16 = r["gemm"]["bf16_tflops"] * 1e12
  f8 = (r["gemm"]["mxfp8_tflops"] if fp8 == "mxfp8" and r["gemm"]["mxfp8_tflops"] else r["gemm"]["fp8_tflops"]) * 1e12
  seq = curve(r["attention"]["seq_efficiency"], cfg.train.seq_len)
  forward = curve(r["attention"]["forward_tflops"], kinds["head_dim"]) * seq * 1e12
  backward = curve(r["attention"]["backward_tflops"], kinds["head_dim"]) * seq * 1e12
  recipe_gemm = max(kinds["recipe"] - kinds["routed"], 0.0) if fp8 else 0.0
  fast = f8 if fp8 and f8 else bf16
  achieved = (kinds["attention"] / 3 / forward + kinds["attention"] * 2 / 3 * 1.25 / backward
              + kinds["routed"] / ((fast if fp8 else bf16) * grouped_eff)
              + ((kinds["gemm"] - recipe_gemm) / bf16 + recipe_gemm / fast) / gemm_eff)
  fp8_flops = kinds["recipe"] if fp8 else 0.0
  peak = (model.flops_per_token - fp8_flops) / (hw.peak_tflops * 1e12) + \
      (fp8_flops / (hw.fp8_tflops * 1e12) if fp8_flops else 0.0)
  return {"ratio": achieved / peak, "gemm_efficiency": gemm_eff, "grouped_efficiency": grouped_eff,
          "rows_per_expert": rows, "attention_tflops": [forward / 1e12, backward / 1e12],
          "attention_share": kinds["attention"] / model.flops_per_token}


def memory_bound_seconds(cfg, sizes: dict[str, int], hw, fp8: bool, rerun: float) -> float:
  """The memory-bound kernels of a step on one device at achieved HBM bandwidth (MEMORY_PASSES)."""
  import jax.numpy as jnp

  m, p = cfg.model, MEMORY_PASSES
  item = jnp.dtype(cfg.train.compute_dtype).itemsize
  dense_ffn = m.intermediate_size / sizes["tensor"]
  moe_ffn = ((m.num_experts_per_tok or 0) + (m.n_shared_experts or 0)) * (m.moe_intermediate_size or 0) / sizes["tensor"]
  per_dense = p["hidden"] * m.hidden_size + p["ffn"] * dense_ffn + (p["fp8"] * (3 * m.hidden_size + dense_ffn)
                                                                   if fp8 else 0)
  per_moe = p["hidden"] * m.hidden_size + p["ffn"] * moe_ffn + p["copies"] * (m.num_experts_per_tok or 0) * m.hidden_size \
      + (p["fp8"] * (3 * m.hidden_size + moe_ffn) if fp8 else 0)
  depth = m.num_nextn_predict_layers
  layers = (m.num_dense_layers * per_dense + (m.num_moe_layers + depth) * per_moe if m.num_moe_layers
            else (m.num_hidden_layers + depth) * per_dense)
  per_token = item * layers
  step, _ = _device_tokens(cfg, sizes)
  return per_token * step / sizes["pipeline"] * rerun / (rates(gpu_of(hw))["memory"]["hbm_tbps"] * 1e12)


def collective_seconds(item: dict[str, Any], r: dict[str, Any]) -> float:
  """One communication row (comm.communication) at the achieved bus bandwidth of its kind and link."""
  links = r["links"]
  where = "nvlink" if item["link"] == "intra-node" else "network"
  key = LINK_KEYS.get(item["collective"], "allgather")
  bandwidth = links["sendrecv_gbps"] if key == "sendrecv" and where == "network" else \
      links.get(f"{where}_{key}_gbps", links[f"{where}_allgather_gbps"])
  count = max(float(item["count"]), 1.0)
  message = item["bytes_per_device"] / count
  half = links[f"half_bandwidth_bytes_{where}"]
  return count * links[f"latency_us_{where}"] * 1e-6 + \
      item["bytes_per_device"] / (bandwidth * 1e9 * message / (message + half))


def achieved_rates(hw, per_node: int):
  """overlap.Rates at the achieved rates (the compiled program's overlap scored with them)."""
  from jaxseek.explore.overlap import Rates

  r = rates(gpu_of(hw))
  return Rates(flops=r["gemm"]["bf16_tflops"] * 1e12, memory=r["memory"]["hbm_tbps"] * 1e12,
               intra_node=r["links"]["nvlink_alltoall_gbps"] * 1e9, inter_node=r["links"]["network_alltoall_gbps"] * 1e9,
               per_node=per_node, fp8_flops=r["gemm"]["fp8_tflops"] * 1e12)


def compile_planned(lowered, cfg, options: dict | None, device_kind: str, per_node: int, where: str | None = None):
  """`lowered` compiled with XLA `options`; where `plans_with_rates`, compiled a second time with the first
  program's op costs (each kernel and async transfer timed at the achieved rates of `device_kind`'s GPU, links
  within `per_node` devices on NVLink, overlap.analytic_profile) handed to the latency-hiding scheduler as its
  profile. The instruction names are the first program's, which the second compile gives again."""
  import os
  import tempfile
  import types

  from jaxseek.explore.overlap import analytic_profile
  from jaxseek.kernels.choice import plans_with_rates

  compiled = lowered.compile(options or None)
  if not plans_with_rates(cfg, where):
    return compiled

  rates = achieved_rates(types.SimpleNamespace(name=device_kind), per_node)
  with tempfile.TemporaryDirectory(prefix="jaxseek-op-costs-") as folder:
    path = os.path.join(folder, "op_costs.pbtxt")
    with open(path, "w") as f:
      f.write(analytic_profile(compiled.as_text(), rates))
    return lowered.compile({**(options or {}), "xla_gpu_pgle_profile_file_or_directory_path": path})


def planner(cfg, mesh):
  """How the train step on `mesh` compiles: `compile_planned` for its GPUs where `plans_with_rates` (links within
  the devices of one node, mesh.devices_per_node or the processes' hosts, on NVLink), else None (one compile)."""
  from jaxseek.kernels.choice import plans_with_rates

  if not plans_with_rates(cfg):
    return None
  import functools

  import jax

  from jaxseek.sharding import mesh as mesh_lib

  nodes = mesh_lib.process_nodes()
  per_node = cfg.mesh.devices_per_node or jax.local_device_count() * sum(
      node == nodes[jax.process_index()] for node in nodes.values())
  return functools.partial(compile_planned, cfg=cfg, device_kind=mesh.devices.flat[0].device_kind, per_node=per_node)


EXCHANGE = ("ragged-all-to-all", "all-to-all")
REDUCTIONS = ("data", "fsdp", "expert", "context", "pipeline")


def _role(axis: str, item: dict[str, Any]) -> str:
  """exchange (the expert axis's all-to-alls), reductions (once-per-step gradient sums and the pipeline's outer
  weights), or other."""
  if axis == "expert" and item["collective"] in EXCHANGE:
    return "exchange"
  if "once per step" in item["what"]:
    return "reductions"
  return "other"


def _hidden(cfg, sizes: dict[str, int], times: dict[str, float], compute_s: float, routed_s: float) -> dict[str, float]:
  """What runs beside compute without a compiled program to read it from: the expert exchange of one
  microbatch beside another's compute where the step pairs them (train.pipeline_overlap: a tick's forward
  beside its backward, on the ticks that pair) or splits the exchange into chunks or streams (each chunk's
  exchange beside the other chunks' expert GEMMs); fsdp's per-microbatch gathers and scatters prefetched beside
  the layers' compute (XLA's latency-hiding scheduler). The once-per-step sums run after the microbatches and
  the pipeline sends between ticks: exposed."""
  from jaxseek.pipeline import stages as pipeline_lib
  from jaxseek.pipeline import tables

  m = cfg.model
  budget, hidden = compute_s, {"exchange": 0.0, "other": 0.0}
  chunks = m.moe_overlap_chunks * m.overlap_streams
  if tables.pairs(cfg) and sizes["pipeline"] > 1:
    R = pipeline_lib.stack_repeats(m.num_moe_layers, sizes["pipeline"], cfg.train.pipeline_repeats)
    # the share of a stage's microbatches whose forward and backward run in paired ticks
    paired = float(tables.for_config(cfg, sizes["pipeline"], R).paired().sum(0).mean()) / (R * cfg.train.microbatches)
    hidden["exchange"] = min(times["exchange"] * paired, budget * paired)
  elif chunks > 1:
    hidden["exchange"] = min(times["exchange"] * (chunks - 1) / chunks, routed_s)
  budget -= hidden["exchange"]
  hidden["other"] = min(times["fsdp"], max(budget, 0.0))
  return hidden


def predict(model, sizes: dict[str, int], hw, result: dict[str, Any],
            hidden_shares: dict[str, float] | None = None) -> dict[str, Any]:
  """The step at achieved rates and its parts (seconds). `hidden_shares`: {collective kind: the share of its
  every-step bytes the compiled program hides at achieved rates}; without it, `_hidden`'s rules."""
  from jaxseek.explore import comm as comm_lib
  from jaxseek.kernels import fp8_gemm

  cfg = model.cfg
  r = rates(gpu_of(hw))
  fp8 = fp8_gemm.resolve(cfg.train.fp8, "gpu", hw.capability) if comm_lib.fp8_runs(cfg, hw) else None
  eff = compute_ratio(cfg, sizes, hw, model, fp8)
  compute = result["compute"]
  peak_once = (compute["flops_per_device"] - compute["fp8_flops_per_device"]) / (hw.peak_tflops * 1e12) + \
      (compute["fp8_flops_per_device"] / (hw.fp8_tflops * 1e12) if compute["fp8_flops_per_device"] else 0.0)
  rerun = compute["time_s"] / peak_once if peak_once else 1.0
  compute_s, bubble_s = compute["time_s"] * eff["ratio"], compute["bubble_s"] * eff["ratio"]
  kinds = flop_kinds(cfg, model.flops_per_token, model.recipe_flops_per_token)
  routed_s = compute_s * kinds["routed"] / model.flops_per_token  # roughly: the experts' share of the FLOPs
  times = {"exchange": 0.0, "reductions": 0.0, "other": 0.0, "fsdp": 0.0}
  by_kind: dict[str, dict[str, float]] = {}
  for axis, items in result["communication"].items():
    for item in items:
      t = collective_seconds(item, r)
      role = _role(axis, item)
      times[role] += t
      if axis == "fsdp" and role == "other":
        times["fsdp"] += t
      by_kind.setdefault(item["collective"], {}).setdefault(role, 0.0)
      by_kind[item["collective"]][role] += t
  if hidden_shares is None:
    hidden = _hidden(cfg, sizes, times, compute_s, routed_s)
    exposed = {"exchange": times["exchange"] - hidden["exchange"], "reductions": times["reductions"],
               "other": times["other"] - hidden["other"]}
  else:
    exposed = {role: sum(t[role] * (1 - hidden_shares.get(kind, 0.0)) for kind, t in by_kind.items() if role in t)
               for role in ("exchange", "reductions", "other")}
  layers = (model.cfg.model.num_dense_layers * KERNELS["dense"] + (model.cfg.model.num_moe_layers
            + model.cfg.model.num_nextn_predict_layers) * KERNELS["moe" if model.cfg.model.num_moe_layers else "dense"])
  launch_s = layers / sizes["pipeline"] * cfg.train.microbatches * r["launch"]["kernel_us"] * 1e-6
  mem = result["memory_per_device"]
  optimizer_s = (2 * mem["parameters"] + mem["gradients"] + 2 * mem["optimizer"]) / (r["memory"]["hbm_tbps"] * 1e12)
  parts = {"compute_s": compute_s, "memory_bound_s": memory_bound_seconds(cfg, sizes, hw, bool(fp8), rerun),
           "launch_s": launch_s, "bubble_s": bubble_s, "exposed_exchange_s": exposed["exchange"],
           "exposed_reductions_s": exposed["reductions"], "exposed_other_s": exposed["other"],
           "optimizer_s": optimizer_s}
  step_s = sum(parts.values())
  t = cfg.train
  return {"step_s": step_s, **parts, "rates": gpu_of(hw),
          "tokens_per_s_per_device": t.batch_size * t.seq_len / step_s / math.prod(sizes.values()),
          "exchange_s": times["exchange"], "reductions_s": times["reductions"], "other_comm_s": times["other"],
          "overlap": "compiled program, at achieved rates" if hidden_shares is not None else "step structure",
          "efficiency": eff, "fp8": fp8}
