"""Evaluation: the held-out split, eval during training, python -m jaxseek.evaluate."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config, run_steps

from jaxseek import faults
from jaxseek import step as step_lib
from jaxseek.errors import UserError
from jaxseek.evaluate import main as evaluate_main
from jaxseek.input import batches as batches_lib
from jaxseek.input import holdout, prepare, shards
from jaxseek.metrics import read_jsonl
from jaxseek.train import run

STEPS = 4
RUN = ("model.num_nextn_predict_layers=1", f"train.steps={STEPS}", "checkpoint.every=2", "metrics.every=1",
       "data.prefetch=0")


def _docs(folder, count, letter, seed=0):
  """`count` distinct byte-level documents "<letter><3 digits><letters>" prepared into `folder` (3 shards)."""
  rng = np.random.default_rng(seed)
  texts = [f"{letter}{i:03d}" + letter * int(rng.integers(1, 26)) for i in range(count)]
  folder.parent.mkdir(parents=True, exist_ok=True)
  src = folder.parent / f"{folder.name}.jsonl"
  src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
  prepare.prepare([str(src)], "byte", folder, shards=3, progress=False)
  return folder


def _ids(batches, letter):
  """Document ids whose first chunk some row of `batches` holds (the ids are in every document's first bytes)."""
  ids = set()
  for batch in batches:
    for inputs, seg in zip(np.asarray(batch["inputs"]), np.asarray(batch["segment_ids"])):
      for s in np.unique(seg[seg > 0]):
        ids.update(int(m) for m in re.findall(rf"{letter}(\d{{3}})", bytes(inputs[seg == s].astype(np.uint8)).decode()))
  return ids


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  root = tmp_path_factory.mktemp("data")
  return {"train": _docs(root / "train", 120, "a"), "eval": _docs(root / "eval", 60, "e", seed=1)}


@pytest.fixture(scope="module")
def eval_run(data, tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("with-eval")
  cfg = load_config("tiny-v3", *RUN, f"data.source={data['train']}", f"eval.source={data['eval']}", "eval.every=2",
                    "eval.tokens=800", f"train.run_dir={run_dir}")
  run(cfg)
  return run_dir


def test_holdout_is_disjoint_from_training_and_deterministic(tmp_path):
  folder = _docs(tmp_path / "corpus", 200, "a")
  cfg = load_config("tiny-v3", f"data.source={folder}", "eval.source=holdout", "eval.holdout=0.2",
                    "data.prefetch=0", "eval.tokens=4000")
  docs = shards.open_folder(folder, 264)  # folder order of documents (prepare spreads them over the shards)
  text_id = [int(bytes(t[o[d] + 1:o[d] + 4].astype(np.uint8))) for t, o in zip(docs.tokens, docs.offsets)
             for d in range(len(o) - 1)]
  out = {text_id[d] for d in np.flatnonzero(holdout.held_out(200, 0.2))}
  assert 20 <= len(out) <= 60 and np.array_equal(holdout.held_out(200, 0.2), holdout.held_out(200, 0.2))
  assert np.array_equal(holdout.held_out(200, 0.2), holdout.held_out(500, 0.2)[:200])  # by document, not by count
  it = iter(batches_lib.make_dataset(cfg))
  trained = _ids([next(it) for _ in range(30)], "a")  # about three epochs of the training documents
  assert trained == set(range(200)) - out  # every training document, no held-out one
  ecfg = batches_lib.eval_config(cfg)
  it = iter(batches_lib.make_dataset(ecfg, docs=batches_lib.open_sources(ecfg, "eval")))
  assert _ids([next(it) for _ in range(3)], "a") == out


def test_eval_loss_equals_evaluate_on_the_checkpoint(eval_run, data, tmp_path, capsys):
  records = {r["step"]: r for r in read_jsonl(eval_run / "metrics.jsonl")}
  assert [s for s, r in records.items() if "eval_loss" in r] == [2, 4]
  # another mesh; the eval batch in microbatches (as training accumulates)
  for step, path, override in ((4, eval_run, "mesh.tensor=2"), (2, eval_run / "checkpoints" / "2",
                                                                 "train.microbatches=2")):
    out = tmp_path / f"{step}.json"
    assert evaluate_main(["--checkpoint", str(path), "--data", str(data["eval"]), "--tokens", "800",
                          "--json", str(out), override]) == 0
    result = json.loads(out.read_text())
    for key in ("eval_loss", "eval_mtp_loss"):
      np.testing.assert_allclose(result[key], records[step][key], rtol=1e-5)
    np.testing.assert_allclose(result["eval_perplexity"], np.exp(records[step]["eval_loss"]), rtol=1e-5)
    assert result["tokens_per_sec"] > 0
  line = capsys.readouterr().out.strip().splitlines()[-1]
  assert line.startswith(f"eval {eval_run / 'checkpoints' / '2'}") and "perplexity" in line and "tokens/s" in line
  # the MTP head's top-1 accuracy against the text and its acceptance against the main model, side by side
  shares = [f"{result[key][0]:.1%}" for key in ("eval_mtp_accuracy", "eval_mtp_acceptance")]
  assert f"| mtp top-1 {shares[0]} | mtp acceptance {shares[1]} |" in line, line


def test_eval_does_not_change_training(eval_run, data, tmp_path):
  cfg = load_config("tiny-v3", *RUN, f"data.source={data['train']}", f"train.run_dir={tmp_path}")
  run(cfg)
  plain = [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
  assert plain == [r["loss"] for r in read_jsonl(eval_run / "metrics.jsonl")]


GPU_CHOICES = {"moe_dispatch": "ragged", "attention_impl": "mosaic", "moe_matmul": "tokamax"}


def test_a_checkpoint_written_with_gpu_kernels_runs_on_cpu(eval_run, data, tmp_path):
  """Kernel and exchange choices are not the model: a run written on GPUs (its config and its checkpoint's saved
  config naming the ragged exchange and tokamax's kernels, none of which run on XLA:CPU) evaluates here to the
  loss the run recorded, takes those keys as evaluate overrides, generates, and resumes."""
  import shutil

  import yaml

  from jaxseek.convert.pretrained import load_pretrained

  run_dir = tmp_path / "gpu-run"
  shutil.copytree(eval_run, run_dir)
  written = yaml.safe_load((run_dir / "config.yaml").read_text())
  written["model"].update(GPU_CHOICES)
  (run_dir / "config.yaml").write_text(yaml.safe_dump(written, sort_keys=False))
  for saved in (run_dir / "checkpoints").glob("*/config/metadata"):
    kept = json.loads(saved.read_text())
    saved.write_text(json.dumps({**kept, "model": {**kept["model"], **GPU_CHOICES}}))
  want = {r["step"]: r["eval_loss"] for r in read_jsonl(eval_run / "metrics.jsonl") if "eval_loss" in r}[STEPS]
  for overrides in ([], ["model.moe_dispatch=fixed", "model.attention_impl=dense"]):
    out = tmp_path / "eval.json"
    assert evaluate_main(["--checkpoint", str(run_dir), "--data", str(data["eval"]), "--tokens", "800",
                          "--json", str(out), *overrides]) == 0
    np.testing.assert_allclose(json.loads(out.read_text())["eval_loss"], want, rtol=1e-5)
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(1, 12)
  np.testing.assert_allclose(load_pretrained(run_dir)(tokens), load_pretrained(eval_run)(tokens), rtol=1e-5,
                             atol=1e-6)
  summary = run(load_config("tiny-v3", *RUN, f"data.source={data['train']}", f"eval.source={data['eval']}",
                            "eval.tokens=800", f"train.steps={STEPS + 1}", f"train.run_dir={run_dir}"))
  assert summary["steps"] == 1 and np.isfinite(summary["last_loss"])


def test_nonfinite_eval_does_not_stop_training(data, tmp_path, monkeypatch):
  real = step_lib.eval_sums
  monkeypatch.setattr(step_lib, "eval_sums", lambda *a: {**real(*a), "ce_sum": jnp.float32(jnp.nan)})
  cfg = load_config("tiny-dense", "train.steps=2", "data.prefetch=0", f"data.source={data['train']}",
                    f"eval.source={data['eval']}", "eval.every=1", "eval.tokens=10", f"train.run_dir={tmp_path}")
  summary = run(cfg)  # train.on_nonfinite=stop
  records = read_jsonl(tmp_path / "metrics.jsonl")
  assert summary["steps"] == 2 and [r["step"] for r in records] == [1, 2]
  assert all(np.isnan(r["eval_loss"]) and np.isfinite(r["loss"]) for r in records)


def test_evaluate_errors_are_one_line(eval_run, data, tmp_path, capsys):
  (tmp_path / "empty").mkdir()
  big = _docs(tmp_path / "big", 5, "b")
  manifest = json.loads((big / "manifest.json").read_text())
  (big / "manifest.json").write_text(json.dumps({**manifest, "vocab_size": 1000}))
  cases = {"does not exist": (tmp_path / "missing", data["eval"]),
           "not (completely) prepared": (eval_run, tmp_path / "empty"),
           "1000-token vocabulary": (eval_run, big),
           "no config.json": (tmp_path / "empty", data["eval"])}
  for expected, (checkpoint, folder) in cases.items():
    assert evaluate_main(["--checkpoint", str(checkpoint), "--data", str(folder)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and expected in err, err
  for argv, expected in ((["--json", str(tmp_path / "missing" / "out.json")], "does not exist; create it"),
                         (["--json", str(tmp_path)], "is a folder; name a file"),
                         (["--tokens", "0"], "--tokens 0 must be ≥ 1"),
                         (["eval.source=x"], "evaluate reads the folder given with --data"),
                         (["model.vocab_size=300"], "the model comes from the checkpoint"),
                         (["model.attention_impl=mosaic"], "mosaic is a GPU kernel but the mesh's devices are cpu"),
                         (["train.fp8=maybe"], "config key train.fp8"),
                         (["--tokens", "-5"], "--tokens -5 must be ≥ 1")):
    assert evaluate_main(["--checkpoint", str(eval_run), "--data", str(data["eval"]), *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and expected in err, err


@pytest.mark.parametrize("overrides, message", [
    (("eval.holdout=0.1",), "needs eval.source=holdout"),
    (("eval.source=holdout",), "eval.holdout: 0.0 must be between 0 and 1"),
    (("eval.source=holdout", "eval.holdout=0.1"), "data.source=synthetic has none"),
    (("eval.tokens=0",), "eval.tokens: 0 must be ≥ 1"),
])
def test_eval_config_errors(overrides, message):
  with pytest.raises(UserError, match=re.escape(message)):
    load_config("tiny-v3", *overrides)


WATCHDOG = """
import os, sys, time
from jaxseek import faults
case = sys.argv[1]
if case == "phase":
  w = faults.Watchdog(0.4)
  w.beat(3)
  with w.phase(2.0):  # an evaluation slower than a step: not a hang
    time.sleep(1.0)
  print("survived", flush=True)
  with w.phase(1.0):  # a peer dead during the final save: the run ends
    time.sleep(10)
  print("not reached", flush=True)
elif case == "idle":
  w = faults.Watchdog(0.4)  # never beaten (compiling): not timed
  time.sleep(1.5)
  print("idle survived", flush=True)
else:
  p = faults.Preemption()
  print("ready", flush=True)
  r, _ = os.pipe()
  os.read(r, 1)  # blocked in a C call, as inside a compilation or a hung step
"""


@pytest.mark.parametrize("case", ["phase", "idle", "signals"])
def test_watchdog_and_signals_with_their_real_threads(case, tmp_path, run_env):
  """The watchdog's own thread: a phase (an evaluation, the final save) longer than a step survives, one past
  its limit ends the process (status 1, one line), a watchdog never beaten (the first compile) never fires.
  Ctrl-C while the main thread is blocked in a C call: the first asks for a save at the step's end (one line),
  the second exits at once with 130."""
  import signal
  import subprocess
  import sys
  import time

  script = tmp_path / "w.py"
  script.write_text(WATCHDOG)
  proc = subprocess.Popen([sys.executable, str(script), case], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=run_env)
  if case == "signals":
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None  # still running: it saves at the end of the step
    proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=60)
  if case == "phase":
    assert proc.returncode == 1 and out.split() == ["survived"]
    assert "an evaluation or checkpoint save did not finish within 1 s" in err and err.count("\n") == 1, err
  elif case == "idle":
    assert proc.returncode == 0 and out.strip() == "idle survived"
  else:
    assert proc.returncode == 130, err
    assert "SIGINT: saving at the end of this step" in err and "SIGINT again: stopping now" in err


def test_aligned_compiles_again_for_another_batch_shape(capsys):
  """faults.Aligned (the train and eval steps): a call with another batch shape compiles a second program and
  runs it; a call with a shape seen before reuses its program (one compile line per shape)."""
  step = faults.Aligned(jax.jit(lambda w, x: x @ w), "toy step", 10)
  w = jnp.arange(6.0).reshape(3, 2)
  got = [np.asarray(step(w, jnp.ones((b, 3)) * b)) for b in (2, 5, 2)]
  for b, y in zip((2, 5, 2), got):
    np.testing.assert_array_equal(y, np.ones((b, 3)) * b @ np.asarray(w))
  assert capsys.readouterr().out.count("compiling the toy step") == 2


def test_aligned_compiles_with_the_options_given(tmp_path):
  """faults.Aligned hands its XLA options to the compiler (the train step's latency-hiding scheduler on GPU):
  an option XLA does not know is refused at the compile, and the GPU options of a run are the scheduler's, on
  or off as train.latency_hiding says, and none elsewhere."""
  from jaxseek.kernels import choice

  step = faults.Aligned(jax.jit(lambda x: x + 1), "toy step", 10, {"xla_no_such_option": True})
  with pytest.raises(Exception, match="xla_no_such_option"):
    step(jnp.ones(3))
  cfg = load_config("tiny-dense")
  assert choice.compiler_options(cfg, "gpu") == {"xla_gpu_enable_latency_hiding_scheduler": True,
                                                 "xla_gpu_memory_limit_slop_factor": 95}
  roomy = load_config("tiny-dense", "train.latency_hiding_memory=200")
  assert choice.compiler_options(roomy, "gpu")["xla_gpu_memory_limit_slop_factor"] == 200
  off = load_config("tiny-dense", "train.latency_hiding=false")
  assert choice.compiler_options(off, "gpu") == {"xla_gpu_enable_latency_hiding_scheduler": False}
  assert choice.compiler_options(cfg, "cpu") == {}
  profile = tmp_path / "costs.pbtxt"
  profile.write_text('costs { name: "fusion.1" cost_us: 3.0 }\n')
  planned = load_config("tiny-dense", f"train.pgle_profile={profile}")
  assert choice.compiler_options(planned, "gpu")["xla_gpu_pgle_profile_file_or_directory_path"] == str(profile)
  assert "op costs from" in choice.summary(planned, "gpu", 9.0)


def test_a_gpu_step_compiles_again_planning_with_its_op_costs_at_the_gpus_achieved_rates(tmp_path):
  """train.op_costs=rates (the default) on GPU: the step compiles once with the run's options, then again with the
  same options and a profile for the latency-hiding scheduler that costs each kernel of the first program at the
  achieved rates of the run's GPU (a memory-bound fusion over f32[1024, 1024]: 8 MiB read and written at
  explore/rates' achieved HBM bandwidth, 3.0 TB/s on an H100, 7.16 on a B200). One compile with
  train.op_costs=xla, a train.pgle_profile (which overrides), the scheduler off, or off GPU."""
  import tomllib
  from importlib import resources

  from jaxseek.explore import predict
  from jaxseek.kernels import choice

  lowered = jax.jit(lambda x: jnp.sin(x) * 2 + 1).lower(jnp.ones((1024, 1024)))
  fusion = re.search(r"%?([\w.\-]+) = f32\[1024,1024\]\S* fusion\(", lowered.compile().as_text()).group(1)

  def compiles(cfg, kind, where="gpu"):
    calls = []

    class Spy:  # records each compile's options and the profile file as it is then
      def compile(self, options=None):
        path = (options or {}).get("xla_gpu_pgle_profile_file_or_directory_path")
        calls.append((dict(options or {}), open(path).read() if path else None))
        return lowered.compile()

    predict.compile_planned(Spy(), cfg, {"xla_gpu_enable_latency_hiding_scheduler": True}, kind, 8, where=where)
    return calls

  cfg = load_config("tiny-dense")
  for kind, gpu in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA B200", "b200")):
    (first, none), (second, profile) = compiles(cfg, kind)
    assert none is None and first == {"xla_gpu_enable_latency_hiding_scheduler": True}
    assert second == {**first, "xla_gpu_pgle_profile_file_or_directory_path": second[
        "xla_gpu_pgle_profile_file_or_directory_path"]}
    hbm = tomllib.loads(resources.files("jaxseek.explore.rates").joinpath(f"{gpu}.toml").read_text())["memory"]
    want = 2 * 1024 * 1024 * 4 / (hbm["hbm_tbps"] * 1e12) * 1e6
    got = dict(re.findall(r'costs \{ name: "([^"]+)" cost_us: ([\d.]+) \}', profile))
    assert float(got[fusion]) == pytest.approx(want, rel=1e-3), (got, want)
  profile = tmp_path / "costs.pbtxt"
  profile.write_text('costs { name: "fusion.1" cost_us: 3.0 }\n')
  for one in (load_config("tiny-dense", "train.op_costs=xla"), load_config("tiny-dense", f"train.pgle_profile={profile}"),
              load_config("tiny-dense", "train.latency_hiding=false")):
    assert len(compiles(one, "NVIDIA H100 80GB HBM3")) == 1
  assert len(compiles(cfg, "NVIDIA H100 80GB HBM3", where="cpu")) == 1
  assert predict.planner(cfg, None) is None  # this machine's CPU: one compile
  assert "op costs at this GPU's achieved rates" in choice.summary(cfg, "gpu", 9.0)
  assert "XLA's own op costs" in choice.summary(load_config("tiny-dense", "train.op_costs=xla"), "gpu", 9.0)


def _token_folder(folder, vocab, count=40, seed=0):
  """A prepared folder of `count` random documents (8-30 tokens below `vocab`), written with the shard writer."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(8, 31, count)
  folder.mkdir(parents=True)
  writer = shards.ShardWriter(folder, 0)
  writer.add(rng.integers(0, vocab, lengths.sum()).astype(np.uint32), lengths)
  entry = writer.close()
  shards.write_manifest(folder, {"format": shards.FORMAT, "vocab_size": vocab, "eos_id": None, "shards": [entry]})
  return folder


def test_evaluate_hugging_face_folder_equals_its_conversion(tmp_path, capsys):
  pytest.importorskip("transformers")
  from test_parity import hf_model, save
  from jaxseek.convert.pretrained import hf_to_checkpoint

  source = save(hf_model("v3_q_lora_yarn"), tmp_path / "hf")
  hf_to_checkpoint(source, tmp_path / "jax")
  data = _token_folder(tmp_path / "tokens", 97)
  results = []
  for path in (source, tmp_path / "jax"):
    out = tmp_path / f"{path.name}.json"
    assert evaluate_main(["--checkpoint", str(path), "--data", str(data), "--tokens", "600", "--json", str(out),
                          "train.batch_size=8", "train.seq_len=32"]) == 0
    results.append(json.loads(out.read_text()))
  np.testing.assert_allclose(results[0]["eval_loss"], results[1]["eval_loss"], rtol=1e-5)
  assert 0 < results[0]["eval_loss"] < 2 * np.log(97)  # a random model on random tokens: about ln V


def test_eval_metrics_reach_the_console_and_prometheus(capsys):
  from jaxseek import metrics

  record = {"step": 2, "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "eval_loss": 2.0, "eval_perplexity": float(np.exp(2.0)),
            "eval_mtp_loss": 2.5}
  metrics.Console(10).write(2, record)
  assert "eval loss 2.0000 (mtp 2.5000) ppl 7.39" in capsys.readouterr().out
  prom = metrics.Prometheus(0, "run-a")
  try:
    prom.write(2, record)
    sample = lambda name: prom.registry.get_sample_value(name, {"run": "run-a"})
    assert (sample("jaxseek_eval_loss"), sample("jaxseek_eval_mtp_loss")) == (2.0, 2.5)
    assert sample("jaxseek_eval_perplexity") == pytest.approx(np.exp(2.0))
  finally:
    prom.close()


def test_a_long_evaluation_on_simulated_devices_finishes(tmp_path, run_env):
  """The default eval.tokens on the tiny model is 170 batches: dispatched all at once, XLA's CPU runtime
  deadlocks in the all-reduce of one of them (and aborts after 40 s); evaluate.bounded keeps 2 in flight."""
  import subprocess
  import sys

  from conftest import CONFIGS

  command = [sys.executable, "-m", "jaxseek.train", "--config", str(CONFIGS / "tiny-dense.yaml"),
             "data.source=python-stdlib", "data.max_bytes=300000", "train.steps=2", "eval.source=holdout",
             "eval.holdout=0.2", "eval.every=2", f"train.run_dir={tmp_path}"]
  proc = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  (record,) = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "eval_loss" in r]
  assert record["eval_tokens"] > 0 and np.isfinite(record["eval_loss"])
  assert load_config("tiny-dense").eval.tokens // (16 * 24) >= 100  # the case this test is about


def test_evaluate_reads_the_held_out_share_of_data_and_refuses_other_sources(data):
  """eval.holdout=F on evaluate's command line: the held-out share F of --data, the same batches a run with
  that share evaluates on (not silently replaced by the whole folder); eval.source and data.source overrides
  are refused, naming --data."""
  from jaxseek.evaluate import eval_run_config
  from jaxseek.sharding.mesh import make_mesh

  base = load_config("tiny-dense", "data.prefetch=0", "eval.tokens=300")
  cfg = eval_run_config(base, str(data["train"]), None, ["eval.holdout=0.2"])
  assert (cfg.eval.source, cfg.eval.holdout, cfg.data.source) == ("holdout", 0.2, str(data["train"]))
  trained = load_config("tiny-dense", "data.prefetch=0", "eval.tokens=300", f"data.source={data['train']}",
                        "eval.source=holdout", "eval.holdout=0.2")
  mesh = make_mesh(cfg)
  got, want = batches_lib.eval_batches(cfg, mesh), batches_lib.eval_batches(trained, mesh)
  assert len(got) == len(want)
  for a, b in zip(got, want):
    for key in a:
      np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))
  whole = eval_run_config(base, str(data["train"]), None, [])
  assert (whole.eval.source, whole.eval.holdout) == (str(data["train"]), 0.0)
  for item in (f"eval.source={data['eval']}", f"data.source={data['eval']}"):
    with pytest.raises(UserError, match="--data"):
      eval_run_config(base, str(data["train"]), None, [item])


def test_a_small_eval_set_counts_each_document_once(tmp_path, capsys):
  """An evaluation set smaller than eval.tokens: the stream repeats it, but each (input, target) pair counts
  once: eval_tokens is the set's own number of pairs (from its offsets), and a line says so."""
  from jaxseek.sharding.mesh import make_mesh

  folder = _docs(tmp_path / "small", 4, "s")
  cfg = load_config("tiny-dense", "data.prefetch=0", f"eval.source={folder}", "eval.tokens=2000")
  batches = batches_lib.eval_batches(cfg, make_mesh(cfg))
  docs = shards.open_folder(folder, cfg.model.vocab_size)
  pairs = sum(int((np.diff(np.asarray(o)) - 1).sum()) for o in docs.offsets)
  counted = sum(float(np.asarray(b["loss_mask"]).sum()) for b in batches)
  assert len(batches) * cfg.train.batch_size * cfg.train.seq_len >= 2000 > 2 * pairs
  assert counted == pairs
  assert "holds fewer token positions than eval.tokens=2,000; each document counts once" in capsys.readouterr().out


def test_an_eval_set_without_loss_tokens_is_refused(data, monkeypatch):
  """A set whose targets are all masked (prepare refuses to write one; an older or hand-made folder can be so):
  evaluation refuses it instead of reporting loss 0 and perplexity 1."""
  from jaxseek.sharding.mesh import make_mesh

  real = batches_lib._packed_row
  monkeypatch.setattr(batches_lib, "_packed_row", lambda row, **kw: {**real(row, **kw),
                                                                   "loss_mask": np.zeros(row["tokens"].shape[0],
                                                                                         np.float32)})
  cfg = load_config("tiny-dense", "data.prefetch=0", f"eval.source={data['eval']}", "eval.tokens=200")
  with pytest.raises(UserError, match="has no token the loss counts"):
    batches_lib.eval_batches(cfg, make_mesh(cfg))


def test_evaluate_runs_the_model_as_an_fp8_run_trained(data, tmp_path):
  """train.fp8: the command line's loss equals the run's own eval_loss (the model rounds its MLP inputs to FP8
  in both), and differs from the same weights run without FP8."""
  cfg = load_config("tiny-dense", "train.steps=1", "data.prefetch=0", "train.fp8=true", f"data.source={data['train']}",
                    f"eval.source={data['eval']}", "eval.tokens=300", f"train.run_dir={tmp_path / 'run'}",
                    "checkpoint.async_save=false")
  run(cfg)
  want = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]["eval_loss"]
  results = {}
  for fp8 in ("true", "false"):
    out = tmp_path / f"{fp8}.json"
    assert evaluate_main(["--checkpoint", str(tmp_path / "run"), "--data", str(data["eval"]), "--json", str(out),
                          f"train.fp8={fp8}"]) == 0
    results[fp8] = json.loads(out.read_text())["eval_loss"]
  assert abs(results["true"] - want) <= 1e-6 * want < abs(results["false"] - want) / 10


def test_eval_loss_equals_a_numpy_cross_entropy_over_the_same_tokens(data):
  """The Evaluator's eval_loss / eval_tokens (chunked loss, microbatches accumulated by a scan, sums over batches)
  against float64 NumPy: log-softmax of the model's full logits at every loss-mask token of the same batches."""
  from flax import nnx

  from jaxseek.evaluate import Evaluator
  from jaxseek.sharding.mesh import make_mesh

  cfg = load_config("tiny-v3", f"data.source={data['train']}", f"eval.source={data['eval']}", "eval.tokens=300",
                    "train.microbatches=2", "model.initializer_range=0.2")
  mesh = make_mesh(cfg)
  trainer = step_lib.make_trainer(cfg, mesh)
  state = trainer.init()
  evaluator = Evaluator(cfg, mesh, trainer)
  with jax.set_mesh(mesh):  # as training calls it
    got = evaluator(state)
  model = nnx.merge(trainer.graphdef, state.params, state.biases)
  total, count = 0.0, 0
  for batch in evaluator.batches:
    b = {k: np.asarray(v) for k, v in batch.items()}
    with jax.set_mesh(mesh):
      logits = np.asarray(model(jnp.asarray(b["inputs"]), jnp.asarray(b["positions"]),
                                jnp.asarray(b["segment_ids"])), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_probs, b["targets"][..., None].astype(np.int64), -1)[..., 0]
    total -= float((picked * b["loss_mask"]).sum())
    count += int(b["loss_mask"].sum())
  assert count > 0 and got["eval_tokens"] == count
  np.testing.assert_allclose(got["eval_loss"], total / count, rtol=2e-5)
  np.testing.assert_allclose(got["eval_perplexity"], np.exp(total / count), rtol=2e-5)


def _alphabet_docs(folder, count=200, seed=0):
  """`count` documents that run through the alphabet from a random letter ("mnopq…", 10-39 letters), prepared
  into `folder`: the next letter, and the one after, follow from the current one."""
  rng = np.random.default_rng(seed)
  texts = ["".join(chr(97 + (s + j) % 26) for j in range(n))
           for s, n in zip(rng.integers(0, 26, count), rng.integers(10, 40, count))]
  folder.parent.mkdir(parents=True, exist_ok=True)
  src = folder.parent / f"{folder.name}.jsonl"
  src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
  prepare.prepare([str(src)], "byte", folder, shards=3, progress=False)
  return folder


NEAR_TIE = 1e-4  # a top-1 logit this close to the second: float32 and float64 argmaxes may differ there


@pytest.fixture(scope="module")
def mtp_eval(tmp_path_factory):
  """A model with 2 MTP depths after 4 steps on alphabet runs (half learnt: per depth its top-1 accuracy and its
  acceptance are far apart and neither near 0 or 1), its Evaluator's results on those documents, and per eval
  batch (as the step reads it) the float64 NumPy top-1 tokens of the main head [B, T] and of each depth's head,
  with where each top-1 is a near tie."""
  from flax import nnx

  from jaxseek import objective
  from jaxseek.evaluate import Evaluator
  from jaxseek.sharding.mesh import make_mesh

  folder = _alphabet_docs(tmp_path_factory.mktemp("alphabet") / "abc")
  cfg = load_config("tiny-v3", f"data.source={folder}", f"eval.source={folder}", "eval.tokens=300",
                    "model.num_nextn_predict_layers=2", "optim.lr=0.01", "train.steps=4")
  mesh = make_mesh(cfg)
  trainer = step_lib.make_trainer(cfg, mesh)
  state, _ = run_steps(cfg, mesh, trainer, trainer.init(), batches_lib.GlobalBatches(cfg, mesh), 4)
  evaluator = Evaluator(cfg, mesh, trainer)
  with jax.set_mesh(mesh):
    got = evaluator(state)
  def top(h_BTD, head_DV):
    logits = np.asarray(h_BTD, np.float64) @ head_DV
    best = np.sort(logits, -1)[..., -2:]
    return logits.argmax(-1), best[..., 1] - best[..., 0] < NEAR_TIE

  @jax.jit  # one program for the eval batches (run op by op, the forward on 8 devices took half the fixture)
  def hidden(params, biases, b):
    model = nnx.merge(trainer.graphdef, params, biases)
    h, aux = model.forward(b["inputs"], b.get("positions"), b.get("segment_ids"), *objective.mtp_arrays(cfg, b),
                           logits=False)
    return h, aux["mtp_hidden"], model.head()

  batches = []
  for batch in evaluator.batches:
    with jax.set_mesh(mesh):
      b = step_lib.step_batch(cfg, batch)
      h, mtp_hidden, head = hidden(state.params, state.biases, b)
      head = np.asarray(head, np.float64)
    batches.append(({k: np.asarray(v) for k, v in b.items()}, top(h, head),
                    [top(mtp_hidden[k], head) for k in (0, 1)]))
  return got, batches


def test_eval_mtp_accuracy_equals_numpy_top1_over_the_same_batch(mtp_eval):
  """eval_mtp_accuracy per depth: the share of depth k's tokens whose top-1 token of the MTP head's float64
  logits (NumPy argmax) is t_{i+k+1}, over the Evaluator's own batches (to the near ties, none here)."""
  got, batches = mtp_eval
  correct, count, ties = np.zeros(2), np.zeros(2), np.zeros(2)
  for b, _, draft in batches:
    for k in (1, 2):
      (top, tie), mask = draft[k - 1], b[f"mtp_mask_{k}"]
      correct[k - 1] += ((top == b[f"mtp_targets_{k}"]) * mask).sum()
      count[k - 1] += mask.sum()
      ties[k - 1] += (tie * mask).sum()
  assert (count > 0).all() and (correct > 0.1 * count).all(), (correct, count)
  assert (np.abs(np.asarray(got["eval_mtp_accuracy"]) * count - correct) <= ties + 1e-6).all(), (got, correct, ties)


def test_eval_mtp_acceptance_equals_numpy_agreement_with_the_main_heads_greedy_token(mtp_eval):
  """eval_mtp_acceptance per depth: the share of depth k's tokens where the MTP head's top-1 token at position i
  equals the main head's top-1 token at position i+k (both predict t_{i+k+1}; float64 NumPy argmax of each
  head's logits), to the near ties (none here). Far from the accuracy, and from the agreement one position off
  (with the main head at i+k-1), so neither a comparison with the text nor a misalignment could pass."""
  got, batches = mtp_eval
  agree, off_by_one, count, ties = np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(2)
  for b, (main, main_tie), draft in batches:
    for k in (1, 2):
      (top, tie), mask = draft[k - 1], b[f"mtp_mask_{k}"][:, :-k]
      agree[k - 1] += ((top[:, :-k] == main[:, k:]) * mask).sum()
      off_by_one[k - 1] += ((top[:, :-k] == main[:, k - 1:-1]) * mask).sum()
      count[k - 1] += mask.sum()
      ties[k - 1] += ((tie[:, :-k] | main_tie[:, k:]) * mask).sum()
  acceptance = np.asarray(got["eval_mtp_acceptance"])
  assert (np.abs(acceptance * count - agree) <= ties + 1e-6).all(), (acceptance, agree / count, ties)
  assert ((0.2 < acceptance) & (acceptance < 0.95)).all(), acceptance
  assert (np.abs(acceptance - np.asarray(got["eval_mtp_accuracy"])) > 0.02).all(), got
  assert (np.abs(acceptance - off_by_one / count) > 0.1).all(), (acceptance, off_by_one / count)


def test_token_ahead_follows_tokens_in_zigzag_storage():
  """step.token_ahead under model.context_attention=zigzag on 4 context shards: x of token i+k at the position
  where token i is stored, as shifting in token order and then storing in zigzag order gives."""
  from jaxseek.model.transformer import shift_left
  from jaxseek.sharding.mesh import make_mesh

  cfg = load_config("tiny-v3", "mesh.context=4", "mesh.data=2", "model.context_attention=zigzag")
  x = jnp.arange(2 * 32, dtype=jnp.int32).reshape(2, 32) + 1
  with jax.set_mesh(make_mesh(cfg)):
    stored = step_lib.to_zigzag({"inputs": x}, 4)["inputs"]
    want = step_lib.to_zigzag({"inputs": shift_left(x, 3)}, 4)["inputs"]
    got = step_lib.token_ahead(cfg, stored, 3)
  assert not np.array_equal(np.asarray(stored), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
