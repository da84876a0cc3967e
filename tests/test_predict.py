"""The explorer's predictions at achieved rates (explore/predict.py, explore/rates/*.toml) and their check against
published runs (explore/published.py, the table in docs/explore.md)."""

import math
import re
import tomllib
from pathlib import Path

import pytest

from jaxseek.explore import core as explore
from jaxseek.explore import predict, published

ROOT = Path(__file__).resolve().parents[1]
RATES = ROOT / "jaxseek/explore/rates"
SCHEMA = {"peak": {"bf16_tflops", "fp8_tflops", "mxfp8_tflops", "hbm_tbps"},
          "gemm": {"bf16_tflops", "fp8_tflops", "mxfp8_tflops", "size_efficiency", "grouped_efficiency"},
          "attention": {"forward_tflops", "backward_tflops", "seq_efficiency"}, "memory": {"hbm_tbps"},
          "links": {"nvlink_allreduce_gbps", "nvlink_allgather_gbps", "nvlink_alltoall_gbps", "network_allreduce_gbps",
                    "network_allgather_gbps", "network_alltoall_gbps", "sendrecv_gbps", "expert_dispatch_nvlink_gbps",
                    "expert_dispatch_network_gbps", "half_bandwidth_bytes_nvlink", "half_bandwidth_bytes_network",
                    "latency_us_nvlink", "latency_us_network"},
          "launch": {"kernel_us"}}


@pytest.mark.parametrize("gpu", predict.RATE_FILES)
def test_every_achieved_rate_has_its_source_and_lies_below_the_peak(gpu):
  """Each constant of a rates file sits under a comment naming where it comes from; every key the prediction reads
  is there; an achieved rate above its datasheet peak, or an efficiency curve outside (0, 1] or not ordered, is a
  data error."""
  text = (RATES / f"{gpu}.toml").read_text()
  lines = text.splitlines()
  for i, line in enumerate(lines):
    if re.match(r"^\w+ = ", line):
      assert lines[i - 1].startswith("#"), f"{gpu}.toml line {i + 1} has no source comment above it: {line}"
  r = tomllib.loads(text)
  for section, keys in SCHEMA.items():
    assert keys <= set(r[section]), (gpu, section, keys - set(r[section]))
  assert 0 < r["gemm"]["bf16_tflops"] <= r["peak"]["bf16_tflops"]
  assert r["gemm"]["fp8_tflops"] <= r["peak"]["fp8_tflops"] and r["gemm"]["mxfp8_tflops"] <= r["peak"]["mxfp8_tflops"]
  assert 0 < r["memory"]["hbm_tbps"] <= r["peak"]["hbm_tbps"]
  for curve in ("size_efficiency", "grouped_efficiency"):
    points = r["gemm"][curve]
    assert [p[0] for p in points] == sorted(p[0] for p in points)
    assert all(0 < p[1] <= 1 for p in points) and [p[1] for p in points] == sorted(p[1] for p in points)
  for kind in ("forward_tflops", "backward_tflops"):
    assert all(0 < p[1] <= r["peak"]["bf16_tflops"] for p in r["attention"][kind])


def test_curves_interpolate_in_log2_and_clamp():
  points = [[64.0, 0.2], [256.0, 0.6], [1024.0, 1.0]]
  assert predict.curve(points, 128) == pytest.approx(0.4)
  assert predict.curve(points, 512) == pytest.approx(0.8)
  assert predict.curve(points, 8) == 0.2 and predict.curve(points, 1e9) == 1.0


def test_a_collective_takes_its_latency_and_its_bytes_at_the_achieved_bus_bandwidth():
  """1 GiB in one all-reduce within a node: latency + bytes / (bandwidth · m / (m + half)); the same bytes in
  10,000 messages lose bandwidth to their size and pay 10,000 latencies."""
  r = predict.rates("h100")
  links = r["links"]
  item = {"collective": "all-reduce", "count": 1, "bytes_per_device": 2**30, "link": "intra-node", "what": ""}
  half, bw = links["half_bandwidth_bytes_nvlink"], links["nvlink_allreduce_gbps"] * 1e9
  want = links["latency_us_nvlink"] * 1e-6 + 2**30 * (2**30 + half) / (2**30 * bw)
  assert predict.collective_seconds(item, r) == pytest.approx(want)
  small = predict.collective_seconds({**item, "count": 10_000}, r)
  assert small > 10_000 * links["latency_us_nvlink"] * 1e-6 + 2**30 / bw
  across = predict.collective_seconds({**item, "link": "inter-node"}, r)
  assert across == pytest.approx(links["latency_us_network"] * 1e-6 + 2**30 / (links["network_allreduce_gbps"] * 1e9)
                                 * (2**30 + links["half_bandwidth_bytes_network"]) / 2**30)


def v3(*overrides, device="h800-80g"):
  from jaxseek import config as config_lib

  cfg = config_lib.load(ROOT / "configs/deepseek-v3-671b.yaml", [
      "mesh.pipeline=16", "mesh.expert=64", "mesh.data=2", "mesh.fsdp=1", "train.batch_size=15360",
      "train.seq_len=4096", "train.microbatches=60", "train.pipeline_schedule=1f1b", "model.moe_capacity_factor=null",
      "train.compute_dtype=bfloat16", "model.moe_dispatch_dtype=float8_e4m3fn", "mesh.allow_cross_host=true",
      "model.moe_dispatch=two_stage", *overrides])
  return explore.plan(explore.describe(cfg), explore.mesh_sizes(cfg, 2048), explore.hardware(device))


def test_the_prediction_is_its_parts_and_never_faster_than_the_bound_without_overlap():
  """On V3's layout: the step is the sum of its parts; compute at achieved rates takes longer than at peak, each
  collective longer than at its nominal rate; FP8 shortens compute; pairing a forward with a backward hides part of
  the exchange (at most the compute beside it), which nothing hides without it or the config's chunks."""
  one = "model.moe_overlap_chunks=1"
  plain, fp8, paired = (v3("train.fp8=false", one), v3("train.fp8=true", one),
                        v3("train.fp8=true", "train.pipeline_overlap=true", one))
  for plan in (plain, fp8, paired):
    p = plan["prediction"]
    parts = [v for k, v in p.items() if k.endswith("_s") and k not in ("step_s", "exchange_s", "reductions_s",
                                                                      "other_comm_s")]
    assert p["step_s"] == pytest.approx(sum(parts))
    assert p["compute_s"] > plan["compute"]["time_s"] and p["step_s"] > plan["step_time_s"]
    nominal = sum(c["time_s"] for items in plan["communication"].values() for c in items)
    assert p["exchange_s"] + p["reductions_s"] + p["other_comm_s"] > nominal
  assert fp8["prediction"]["compute_s"] < 0.8 * plain["prediction"]["compute_s"]
  assert plain["prediction"]["exposed_exchange_s"] == plain["prediction"]["exchange_s"]
  p = paired["prediction"]
  hidden = p["exchange_s"] - p["exposed_exchange_s"]
  assert 0.3 * p["exchange_s"] < hidden <= p["compute_s"]
  chunked = v3("train.fp8=false")["prediction"]  # the config's 2 chunks: one's exchange beside the other's GEMMs
  assert 0 < chunked["exchange_s"] - chunked["exposed_exchange_s"] <= chunked["compute_s"]


def test_a_table_schedule_is_timed_by_its_busiest_stage():
  """V3 on 16 stages under 1F1B, recomputing each chunk in its backward (a layer's forward twice and its backward:
  4/3 of its training FLOPs), FP8 off. Each stage's work, counted here from the FLOPs of each part of the model:
  4 MoE layers a stage; stage 0 also the 3 dense layers before the pipelined stack (recomputed in its backward
  too); rows 58-63 of the 64 stored are identity padding, which the executor skips (stage 14 runs 2 layers, stage
  15 none) and stage 15 runs MTP, the heads and the loss (their training FLOPs). A lock-step tick lasts as long as
  its busiest stage, so the step's compute is no shorter than stage 0's work; spread evenly over the stages (the
  explorer before) it was 1.7 times shorter."""
  from jaxseek import config as config_lib

  cfg = config_lib.load(ROOT / "configs/deepseek-v3-671b.yaml", [
      "mesh.pipeline=16", "mesh.expert=64", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", "train.batch_size=15360",
      "train.seq_len=4096", "train.microbatches=60", "mesh.allow_cross_host=true", "train.fp8=false"])
  assert cfg.train.pipeline_schedule == "1f1b" and cfg.train.pipeline_recompute
  model = explore.describe(cfg)
  sizes = explore.mesh_sizes(cfg, 2048)
  compute = explore.plan(model, sizes, explore.hardware("h800-80g"))["compute"]
  flops = {part: f for part, (f, _) in model.flops_by_part.items()}
  at_peak = 15360 * 4096 / (2048 / 16) / 989e12  # a stage device's tokens per step, at the bf16 peak
  layer = flops["moe_layers"] / 58 * 4 / 3 * at_peak
  work = compute["stage_work_s"]
  assert len(work) == 16
  assert work[1:14] == pytest.approx([4 * layer] * 13, rel=1e-9)
  assert work[0] == pytest.approx(4 * layer + flops["dense_layers"] * 4 / 3 * at_peak, rel=1e-9)
  assert work[14] == pytest.approx(2 * layer, rel=1e-9)
  assert work[15] == pytest.approx((flops["head"] + flops["mtp_layers"]) * at_peak, rel=1e-9)
  assert compute["time_s"] == pytest.approx(sum(work) / 16)
  assert compute["time_s"] + compute["bubble_s"] >= max(work) == work[0] > 1.6 * sum(work) / 16


def test_the_h800_plans_with_its_cut_nvlink():
  """The H800's NVLink runs at 400 GB/s both ways (200 a direction), the H100's at 900: the bound's in-node
  exchange takes 2.25× as long, and the prediction uses the H800's own rates file."""
  h800, h100 = v3(), v3(device="h100-80g")
  intra = lambda plan: sum(c["time_s"] for c in plan["communication"]["expert"] if c["link"] == "intra-node")
  assert intra(h800) / intra(h100) == pytest.approx(2.25)
  assert h800["prediction"]["rates"] == "h800" and h100["prediction"]["rates"] == "h100"


def docs_table() -> dict[str, float]:
  """{run: predicted / published} from docs/explore.md's table of published runs."""
  text = (ROOT / "docs/explore.md").read_text()
  rows = re.findall(r"^\| ([\w.-]+) \| \d+ \w+ \| [\d.]+ s \| [\d.]+ s \| [\d.]+ s \| ([\d.]+)", text, re.MULTILINE)
  return {name: float(ratio) for name, ratio in rows}


def test_predictions_against_published_runs_hold_the_documented_table():
  """Every published run (explore/published.toml) on jaxseek's nearest layout: the ratio prediction / published
  equals docs/explore.md's table (to its two decimals), and a run the table has inside 0.75-1.33 stays inside: a
  change to the rates, the model or the explorer that moves a check is seen here."""
  documented = docs_table()
  results = {r["name"]: published.check(r) for r in published.runs()}
  assert set(results) == set(documented), (set(results) ^ set(documented))
  lo, hi = published.BOUNDS
  for name, r in results.items():
    assert abs(r["ratio"] - documented[name]) <= 0.006, (name, r["ratio"], documented[name])
    if lo <= documented[name] <= hi:
      assert lo <= r["ratio"] <= hi, (name, r["ratio"])
  assert math.isclose(published.published_step(next(r for r in published.runs() if r["hardware"] == "h800")), 19.9)


def test_a_published_layout_left_open_is_planned_both_ways_and_the_faster_kept():
  """Megatron's DeepSeek-V3 on 256 B200 (EP 32 over 4 nodes) leaves jaxseek two ways near its all-to-all overlap:
  paired ticks (a recomputing backward beside a forward) or 1F1B keeping the forward's residuals. `check` plans
  both and keeps the faster that fits; each is what the explorer predicts for those overrides."""
  from jaxseek import config as config_lib

  run = next(r for r in published.runs() if r["name"] == "megatron-bridge-dsv3-b200-256-mxfp8")
  path, over, _ = published.settings(run)
  steps = {}
  for extra, why in published.variants(run, over):
    cfg = config_lib.load(path, over + extra)
    plan = explore.plan(explore.describe(cfg), explore.mesh_sizes(cfg, run["gpus"]), explore.hardware("b200-180g"))
    steps[tuple(extra)] = (plan["prediction"]["step_s"], plan["memory"]["fits"], why)
  assert len(steps) == 2 and all(fits for _, fits, _ in steps.values())
  chosen = published.check(run)
  best = min(steps, key=lambda k: steps[k][0])
  assert chosen["predicted_s"] == pytest.approx(steps[best][0]) and set(best) <= set(chosen["overrides"])
  assert steps[best][2] in chosen["differs"]
