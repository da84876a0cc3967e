"""Config loading, overrides and the one-line errors for bad input."""

import os
import subprocess
import sys

import pytest

from conftest import CONFIGS, ROOT, load_config
from jaxseek import config as config_lib
from jaxseek.errors import UserError
from jaxseek.train import main


def test_overrides_are_typed_and_applied():
  cfg = load_config("tiny-v3", "train.steps=7", "optim.lr=1e-3", "mesh.fsdp=2", "model.rope_scaling=null")
  assert cfg.train.steps == 7 and cfg.optim.lr == 1e-3 and cfg.mesh.fsdp == 2
  assert cfg.model.rope_scaling is None
  assert isinstance(cfg.optim.lr, float)


def test_resolved_config_round_trips(tmp_path):
  cfg = load_config("tiny-v3", "train.seq_len=20")
  config_lib.dump(cfg, tmp_path / "config.yaml")
  assert config_lib.load(tmp_path / "config.yaml") == cfg


def test_hugging_face_key_names_are_the_model_fields():
  hf = {"hidden_size": 7168, "num_hidden_layers": 61, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc"}
  cfg = config_lib.from_dict({"model": hf})
  assert all(getattr(cfg.model, k) == v for k, v in hf.items())


BAD_INPUT = [
    (["train.stepz=5"], "unknown config key train.stepz", "valid keys in train"),
    (["train.steps=abc"], "config key train.steps: expected an integer", "'abc'"),
    (["trian.steps=5"], "unknown config section 'trian'", "valid sections"),
    (["train.steps=0"], "config key train.steps", "positive"),
    (["model.topk_method=best"], "config key model.topk_method", "'noaux_tc'"),
    (["mesh.data=4", "mesh.num_cpu_devices=8"], "needs 4 devices but 8 are available", "mesh.data=-1"),
    (["mesh.tensor=8"], "config key model.num_attention_heads: 4 is not divisible by mesh.tensor=8", "change"),
    (["mesh.data=-1", "mesh.fsdp=-1"], "at most one mesh axis may be -1", "explicit"),
    (["train.microbatches=3"], "config key train.microbatches: 3 must divide train.batch_size=16", ""),
    (["model.n_group=3"], "config key model.n_group: 3 must divide model.n_routed_experts=8", ""),
    (["mesh.data=2", "mesh.tensor=4", "mesh.sequence_parallel=true", "train.seq_len=30"],
     "config key train.seq_len: 30 tokens are not divisible by mesh.context × mesh.tensor", "change the sequence"),
    (["model.rope_scaling={type: linear, factor: 2}"], "model.rope_scaling: type 'linear' is not supported", "yarn"),
    (["model.rope_scaling={type: yarn, factor: 4}"], "yarn needs original_max_position_embeddings", "add it"),
    (["model.rope_scaling={type: yarn, factor: 4, original_max_position_embeddings: 16, beta: 2}"],
     "unknown yarn key 'beta'", "beta_fast"),
    (["model.rope_scaling={type: yarn, factor: -4, original_max_position_embeddings: 16}"],
     "factor must be a positive number", "-4"),
    (["model.attention_bias=true"], "model.attention_bias: true is not supported", "set it to false"),
    (["model.max_position_embeddings=16"], "model.max_position_embeddings: 16 is below train.seq_len=24", "raise"),
    (["model.topk_group=1", "model.num_experts_per_tok=3"],
     "model.topk_group: 1 groups of 2 experts cannot hold model.num_experts_per_tok=3", "raise topk_group"),
    (["model.n_group=8", "model.topk_group=4"], "model.n_group: 8 groups of 1 expert leave noaux_tc no top-2",
     "at most 4 groups"),
    (["mesh.expert=4", "model.moe_max_expert_shards=1", "model.num_experts_per_tok=3"],
     "model.moe_max_expert_shards: 1 of the 4 expert shards (2 experts each) cannot hold", "raise it"),
    (["mesh.num_cpu_devices=0"], "mesh.num_cpu_devices: 0 must be ≥ 1", "null"),
    (["model.moe_matmul=tokamax"], "model.moe_matmul: tokamax is a GPU kernel but the mesh's devices are cpu",
     "blocked"),
    (["model.attention_impl=mosaic"], "model.attention_impl: mosaic is a GPU kernel", "blocked"),
    (["model.moe_dispatch=ragged"], "model.moe_dispatch: ragged needs ragged-all-to-all, which XLA does not "
     "implement on cpu", "use auto or fixed"),
    (["model.moe_recv_factor=0"], "config key model.moe_recv_factor: 0.0 must be > 0", "dropless"),
    (["model.moe_overlap_chunks=0"], "config key model.moe_overlap_chunks: 0 must be ≥ 1", "one exchange"),
    (["model.overlap_streams=0"], "config key model.overlap_streams: 0 must be ≥ 1", "one stream"),
    (["model.overlap_streams=4"], "model.overlap_streams: 4 streams do not divide the 2 rows a device holds",
     "use a divisor of 2"),
    (["model.moe_dispatch_dtype=float16"], "config key model.moe_dispatch_dtype: 'float16' is not one of",
     "'float8_e4m3fn'"),
    (["mesh.data=1", "mesh.expert=4", "mesh.tensor=2", "model.moe_tensor=experts", "model.n_routed_experts=4",
      "model.n_group=1", "model.topk_group=1"],
     "config key model.n_routed_experts: 4 is not divisible by mesh.expert=4 × mesh.tensor=2", "change the mesh"),
    (["mesh.data=4", "mesh.tensor=2", "model.moe_tensor=experts", "train.seq_len=23"],
     "train.seq_len: 23 tokens are not divisible by mesh.context × mesh.tensor (model.moe_tensor=experts)", "change"),
    (["model.moe_tensor=whole"], "config key model.moe_tensor: 'whole' is not one of", "'experts'"),
    # the eval section
    (["eval.source=holdout", "eval.holdout=1.5"], "config key eval.holdout: 1.5 must be between 0 and 1", "0.01"),
    (["eval.holdout=0.1"], "config key eval.holdout: 0.1 needs eval.source=holdout", "None"),
    (["eval.source=synthetic"], "config key eval.source: synthetic is what training reads", "use holdout"),
    (["eval.source=holdout", "eval.holdout=0.1"], "eval.source: holdout needs documents", "prepared folder"),
    (["eval.tokens=0"], "config key eval.tokens: 0 must be ≥ 1", ""),
    (["eval.every=-1"], "config key eval.every: -1 must be ≥ 0", ""),
    # weights, rates, counts and intervals outside the range they mean anything in
    (["train.mtp_loss_weight=-0.3"], "config key train.mtp_loss_weight: -0.3 must be ≥ 0", "untrained"),
    (["optim.lr=-1e-3"], "config key optim.lr: -0.001 must be ≥ 0", ""),
    (["optim.lr=nan"], "config key optim.lr: nan must be ≥ 0", ""),
    (["optim.warmup_steps=-5"], "config key optim.warmup_steps: -5 must be ≥ 0", ""),
    (["optim.decay_steps=-1"], "config key optim.decay_steps: -1 must be ≥ 0", "cosine"),
    (["optim.min_lr_ratio=1.5"], "config key optim.min_lr_ratio: 1.5 must be between 0 and 1", "0.1"),
    (["optim.b1=-0.1"], "config key optim.b1: -0.1 must be ≥ 0 and below 1", "0.9"),
    (["optim.b2=1"], "config key optim.b2: 1.0 must be ≥ 0 and below 1", "0.95"),
    (["optim.eps=0"], "config key optim.eps: 0.0 must be > 0", "1e-8"),
    (["optim.weight_decay=-0.1"], "config key optim.weight_decay: -0.1 must be ≥ 0", ""),
    (["optim.bias_update_rate=-0.001"], "config key optim.bias_update_rate: -0.001 must be ≥ 0", "freezes"),
    (["train.spike_sigma=-3"], "config key train.spike_sigma: -3.0 must be > 0", "null"),
    (["train.spike_window=1"], "config key train.spike_window: 1 must be ≥ 2", "standard deviation"),
    (["train.step_timeout_s=0"], "config key train.step_timeout_s: 0.0 must be > 0", "null"),
    (["train.loss_scale_min=65536"], "config key train.loss_scale_min: 65536.0 exceeds train.loss_scale_init=32768.0",
     "lower it"),
    (["checkpoint.every=-2"], "config key checkpoint.every: -2 must be ≥ 0", "only at the end"),
    (["checkpoint.keep=0"], "config key checkpoint.keep: 0 must be ≥ 1", ""),
    (["checkpoint.keep_every=-10"], "config key checkpoint.keep_every: -10 must be ≥ 0", ""),
    (["metrics.peak_tflops=0"], "config key metrics.peak_tflops: 0.0 must be > 0", "null"),
    # W&B's project names
    (["metrics.wandb=true", "metrics.wandb_project="], "config key metrics.wandb_project: '' is empty",
     "metrics.wandb_project=jaxseek"),
    (["metrics.wandb=true", "metrics.wandb_project=team/proj"], "metrics.wandb_project: 'team/proj' names an entity "
     "and a project", "WANDB_ENTITY=team and metrics.wandb_project=proj"),
    (["metrics.wandb_project=a:b"], "metrics.wandb_project: 'a:b' is not a W&B project name", "none of"),
    # schedule choices
    (["train.pipeline_schedule=zbv"], "train.pipeline_schedule: zbv runs two chunks per stage", "pipeline_repeats=2"),
    (["train.pipeline_schedule=interleaved_1f1b"], "interleaved_1f1b runs train.pipeline_repeats ≥ 2", "or more"),
    (["train.pipeline_schedule=1f1b", "train.pipeline_repeats=2"], "1f1b runs one chunk per stage",
     "interleaved_1f1b"),
    (["train.pipeline_recompute=false"], "train.pipeline_recompute: false keeps the forward's residuals",
     "set true"),
    (["train.pipeline_stashes=2"], "train.pipeline_stashes: 2 caps the stashes of zb_h1 and zbv", "set 0"),
    (["train.pipeline_overlap=true"], "train.pipeline_overlap: true runs a tick's forward beside its backward",
     "use 1f1b or interleaved_1f1b, or set false"),
    (["train.pipeline_overlap=sometimes"], "config key train.pipeline_overlap", "expected true or false"),
    (["train.pipeline_overlap=true", "train.pipeline_schedule=1f1b"], "train.pipeline_overlap: true pairs the ticks "
     "of a pipeline schedule and mesh.pipeline=1 runs none", "set mesh.pipeline > 1"),
    (["train.latency_hiding_memory=100000"], "train.latency_hiding_memory: 100000 must be between 1 and 400",
     "XLA's default is 95"),
    (["model.moe_dispatch=two_stage", "model.moe_capacity_factor=1.25"], "model.moe_dispatch: two_stage is dropless "
     "and model.moe_capacity_factor=1.25 drops", "model.moe_capacity_factor=null"),
    (["train.pgle_profile=/no/such/costs.pbtxt"], "config key train.pgle_profile: /no/such/costs.pbtxt is not a file",
     "--pgle-profile"),
    (["train.pipeline_schedule=pipedream"], "config key train.pipeline_schedule", "'dualpipev'"),
    (["mesh.pipeline=2", "mesh.data=4", "model.num_hidden_layers=4"], "mesh.pipeline: 2 stages split neither layer",
     "twice as many layers"),
    # kernel choices (the CPU has none of the GPU kernels)
    (["model.attention_impl=cudnn"], "model.attention_impl: cudnn is a GPU kernel", "use auto, blocked or dense"),
    (["model.attention_impl=triton"], "model.attention_impl: triton is a GPU kernel", "use auto, blocked or dense"),
    (["model.moe_matmul=tokamax_triton"], "model.moe_matmul: tokamax_triton is a GPU kernel", "ragged_dot"),
    (["model.attention_impl=flash"], "config key model.attention_impl", "'blocked'"),
    # paths: an empty one (an unset shell variable) and a home that does not exist
    (["train.run_dir="], "config key train.run_dir: the path is empty", "name a file or folder"),
    (["checkpoint.load_from="], "config key checkpoint.load_from: the path is empty", "or null"),
    (["train.run_dir=~no-such-user-jaxseek/x"], "train.run_dir: ~no-such-user-jaxseek/x starts with ~ but names no "
     "user's home", "write the path out"),
    # the data and the evaluation set are opened before the run directory is written
    (["data.source=/nonexistent/jaxseek-data"], "data.source folder /nonexistent/jaxseek-data not found",
     "prepare_data.py"),
    (["eval.source=/nonexistent/jaxseek-eval"], "eval.source folder /nonexistent/jaxseek-eval not found",
     "use holdout"),
]


@pytest.mark.parametrize("overrides,message,hint", BAD_INPUT, ids=[b[1][:40] for b in BAD_INPUT])
def test_bad_input_is_one_line_with_exit_status_2(overrides, message, hint, capsys, tmp_path):
  status = main(["--config", str(CONFIGS / "tiny-v3.yaml"), f"train.run_dir={tmp_path}/run", *overrides])
  err = capsys.readouterr().err
  assert status == 2
  assert err.count("\n") == 1 and err.startswith("error: "), err
  assert message in err and hint in err, err
  assert "Traceback" not in err
  assert not (tmp_path / "run").exists()  # nothing written before the input is known good


@pytest.mark.parametrize("content, message", [(b"", "names no instruction's cost (an empty profile)"),
                                              (b"not a profile\n", "is not an op-cost profile XLA reads"),
                                              (b"\x89PNG\r\n\x1a\n\xff\xfe", "is not an op-cost profile XLA reads")],
                         ids=["empty", "text", "binary"])
def test_a_pgle_profile_xla_cannot_read_is_refused(content, message, tmp_path, capsys):
  """XLA drops a profile it cannot parse with a log line while compiling on a GPU; the run would still say it
  plans with it. The file is parsed as XLA's ProfiledInstructionsProto first, on every platform."""
  profile = tmp_path / "costs.pbtxt"
  profile.write_bytes(content)
  assert main(["--config", str(CONFIGS / "tiny-v3.yaml"), f"train.run_dir={tmp_path}/run",
               f"train.pgle_profile={profile}"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"train.pgle_profile: {profile} {message}" in err, err
  assert not (tmp_path / "run").exists()
  profile.write_text('costs { name: "fusion.3" cost_us: 12.5 }\nlatencies { source: "a" target: "b" latency_us: 1 }\n')
  assert config_lib.load(CONFIGS / "tiny-v3.yaml", [f"train.pgle_profile={profile}"]).train.pgle_profile == str(profile)


def test_home_is_expanded_in_every_path_key(tmp_path):
  """`~` in a path key means the home folder, as a shell would have expanded it: never a folder named `~`."""
  cfg = config_lib.load(CONFIGS / "tiny-v3.yaml", ["train.run_dir=~/runs/x", "checkpoint.load_from=~/runs/y",
                                                   "data.source=[~/data/a, ~/data/b]", "eval.source=~/held"])
  home = os.path.expanduser("~")
  assert cfg.train.run_dir == f"{home}/runs/x" and cfg.checkpoint.load_from == f"{home}/runs/y"
  assert cfg.data.source == (f"{home}/data/a", f"{home}/data/b") and cfg.eval.source == f"{home}/held"
  profile = tmp_path / "costs.pbtxt"
  profile.write_text("")
  relative = os.path.relpath(profile, home)
  with pytest.raises(UserError) as refused:  # expanded before it is looked for (and refused: it is empty)
    config_lib.load(CONFIGS / "tiny-v3.yaml", [f"train.pgle_profile=~/{relative}"])
  assert "is not a file" not in str(refused.value)


def test_missing_and_malformed_config_files(tmp_path, capsys):
  assert main(["--config", str(tmp_path / "nope.yaml")]) == 2
  assert "config file" in capsys.readouterr().err
  bad = tmp_path / "bad.yaml"
  bad.write_text("train: {steps: 3\n")
  assert main(["--config", str(bad)]) == 2
  assert "is not valid YAML" in capsys.readouterr().err
  with pytest.raises(UserError, match="section.key=value"):
    config_lib.load(None, ["steps=3"])
  binary = tmp_path / "binary.yaml"
  binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
  assert main(["--config", str(binary), f"train.run_dir={tmp_path}/run"]) == 2
  err = capsys.readouterr().err
  assert err == f"error: config file {binary} is not text (byte 0 is not UTF-8); pass a YAML file to --config\n"
  assert not (tmp_path / "run").exists()


def test_command_line_exit_status(run_env, tmp_path):
  proc = subprocess.run([sys.executable, "-m", "jaxseek.train", "--config", str(CONFIGS / "tiny-v3.yaml"),
                         "mesh.tensor=8"], capture_output=True, text=True, env=run_env, cwd=tmp_path, timeout=120)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      "error: config key model.num_attention_heads: 4 is not divisible by mesh.tensor=8; change the mesh or the "
      "model size"]


def test_context_attention_takes_gather_or_ring():
  from jaxseek.errors import UserError

  assert config_lib.load(CONFIGS / "tiny-dense.yaml", ["model.context_attention=ring"]).model.context_attention == "ring"
  with pytest.raises(UserError, match="model.context_attention: 'spiral' is not one of 'gather', 'ring', 'zigzag'"):
    config_lib.load(CONFIGS / "tiny-dense.yaml", ["model.context_attention=spiral"])
  with pytest.raises(UserError, match="train.seq_len: 36 tokens do not split into 2 × mesh.context = 8 chunks"):
    config_lib.load(CONFIGS / "tiny-dense.yaml", ["model.context_attention=zigzag", "mesh.context=4",
                                                  "mesh.data=2", "train.seq_len=36"])
