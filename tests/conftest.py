"""Every test sees 8 simulated CPU devices; tiny configs come from configs/. Helpers shared by the test files."""

import os
import shutil
import socket
from pathlib import Path

# Tests compile many small programs and run each a few times: compiling is most of their time. XLA:CPU's
# backend optimisations, its newer fusion emitters, XNNPACK and LLVM's expensive passes each cost more compile
# time than they save in running here (a tiny-v3 train step on 8 devices: 6.6 s to compile with the first three,
# 2.5 s without; a pipelined step with paired ticks: 27 s, 21.7 s without the expensive passes too).
# JAXSEEK_TEST_DEFAULT_OPT=1 keeps XLA's defaults (tests/test_default_opt_level.py runs a subset so).
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                  "--xla_cpu_use_xnnpack=false", "--xla_llvm_disable_expensive_passes=true")
if os.environ.get("JAXSEEK_TEST_DEFAULT_OPT") != "1":
  os.environ.setdefault("XLA_FLAGS", " ".join(TEST_XLA_FLAGS))

# Many tests compile the same programs (the single-device references of the exactness tests, the same tiny
# models in subprocesses): XLA's persistent compilation cache, shared by the workers and the subprocesses they
# start (the environment carries it), compiles each once. It lives for one test session: the first process of a
# session (pytest itself, before it starts its workers) empties it. Across sessions, a multi-device step that
# XLA:CPU loads back from the cache can deadlock in its collectives (seen with the ring-attention step: two of
# the eight device threads wait in a collective-permute, six in an all-reduce, under one op id, until XLA aborts
# the process), where the same program compiled afresh runs.
CACHE = Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax"
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  if "PYTEST_XDIST_WORKER" not in os.environ:  # the session's own process (xdist workers inherit the variable)
    shutil.rmtree(CACHE, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = str(CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_cpu_enable_async_dispatch", False)  # as python -m jaxseek.train runs (sharding/mesh.py)
jax.config.update("jax_platforms", "cpu")

import pytest  # noqa: E402

# The cases `make test` (CI) leaves to `make test-full`: each repeats, on another mesh, schedule or optimisation
# level, a property that a faster case of the same test checks in `make test`, or runs a long real job (the
# demo, late and signalled processes, a resume after SIGKILL). `pytest -m slow tests` runs them alone.
SLOW = {
    "tests/test_default_opt_level.py::test_exactness_subset_passes_at_the_default_optimisation_level[sharding]",
    "tests/test_default_opt_level.py::test_exactness_subset_passes_at_the_default_optimisation_level[moe]",
    "tests/test_default_opt_level.py::test_exactness_subset_passes_at_the_default_optimisation_level[pipeline]",
    "tests/test_default_opt_level.py::test_exactness_subset_passes_at_the_default_optimisation_level[context]",
    "tests/test_pipeline.py::test_memory_bounded_schedules_equal_single_device[v3-p2e2t2-m4-zb_h1-kept]",
    "tests/test_pipeline.py::test_memory_bounded_schedules_equal_single_device[v3-p2e2t2-m4-mtp-dualpipev]",
    "tests/test_pipeline.py::test_memory_bounded_schedules_equal_single_device[v3-p4-r2-m8-interleaved]",
    "tests/test_pipeline.py::test_memory_bounded_schedules_equal_single_device[v3-p4e2-m8-zb_h1]",
    "tests/test_pipeline.py::test_memory_bounded_schedules_equal_single_device[v3-p4-m8-dualpipev]",
    "tests/test_pipeline.py::test_pipelined_training_equals_single_device[v3-p4-m8]",
    "tests/test_pipeline.py::test_pipelined_training_equals_single_device[v3-p2-r2-m1-remat]",
    "tests/test_pipeline.py::test_checkpoint_moves_between_pipelined_and_flat_meshes[p2-dualpipev-to-p1]",
    "tests/test_pipeline.py::test_checkpoint_moves_between_pipelined_and_flat_meshes[p2-zbv-to-p2-zb_h1]",
    "tests/test_pipeline.py::test_compiled_step_passes_activations_with_collective_permute",
    "tests/test_context.py::test_context_parallel_training_equals_single_device[v3-c4-zigzag-packed-mtp]",
    "tests/test_context.py::test_context_parallel_training_equals_single_device[v3-c2-ring]",
    "tests/test_multihost.py::test_sigterm_to_one_process_saves_the_same_step_on_both",
    "tests/test_multihost.py::test_processes_whose_compiles_end_40_s_apart_still_train",
    "tests/test_multihost.py::test_a_dead_peer_ends_the_other_process",
    "tests/test_checkpoint.py::test_resume_after_sigkill_is_exact",
    "tests/test_train.py::test_demo_model_learns_python_source",
    "tests/test_sharding.py::test_gradients_are_summed_over_data_and_expert_once_per_step[p2d2e2-1f1b]",
    "tests/test_pipeline.py::test_memory_bounded_schedules_equal_single_device[v3-p4-m8-1f1b]",
    "tests/test_pipeline.py::test_pipelined_training_equals_single_device[v3-moe5-p2-r2-padded]",
    "tests/test_kernels.py::test_train_step_memory_grows_linearly_with_length[tiny-v3]",
    "tests/test_precision.py::test_remat_policies_order_compiled_memory_as_the_explorer_predicts",
    "tests/test_multihost.py::test_a_hung_peer_is_ended_by_the_watchdog",
    "tests/test_context.py::test_context_extension_continues_a_checkpoint_at_4x_the_length_with_yarn",
    "tests/test_pipeline.py::test_1f1b_memory_is_bounded_by_the_stage_count",
    "tests/test_mtp.py::test_mtp_loss_enters_training_with_its_weight",
    "tests/test_precision.py::test_zero1_equals_zero3_and_holds_what_the_explorer_predicts[f2d2t2]",
    "tests/test_precision.py::test_fp8_training_tracks_bfloat16",
    "tests/test_metrics.py::test_prometheus_tensorboard_and_profile_of_a_real_run",
    "tests/test_checkpoint.py::test_skip_mode_leaves_the_state_unchanged_on_bad_steps",
    "tests/test_fp8_fidelity.py::test_gradient_error_against_float32_tells_a_planted_scaling_fault[false-float16]",
    "tests/test_fp8_fidelity.py::test_gradient_error_against_float32_tells_a_planted_scaling_fault[rowwise-float16]",
    "tests/test_fp8_fidelity.py::test_gradient_error_against_float32_tells_a_planted_scaling_fault[tensorwise-float16]",
    "tests/test_fp8_fidelity.py::test_gradient_error_against_float32_tells_a_planted_scaling_fault[mxfp8-float16]",
    "tests/test_fp8_fidelity.py::test_gradient_error_against_float32_tells_a_planted_scaling_fault[blockwise-float16]",
    "tests/test_fp8_fidelity.py::test_gradient_error_against_float32_tells_a_planted_scaling_fault[tensorwise-bfloat16-dropped_scale-projections]",
    "tests/test_fp8_fidelity.py::test_gradient_error_against_float32_tells_a_planted_scaling_fault[tensorwise-bfloat16-dropped_scale-experts]",
    "tests/test_fp8_fidelity.py::test_gradient_error_against_float32_tells_a_planted_scaling_fault[tensorwise-float16-cast_before_scaling-projections]",
    "tests/test_fp8_fidelity.py::test_gradient_error_against_float32_tells_a_planted_scaling_fault[tensorwise-float16-cast_before_scaling-experts]",
    # paired ticks: the MTP case on expert × tensor (make test) pairs them too
    "tests/test_pipeline.py::test_memory_bounded_schedules_equal_single_device[v3-p4-m8-1f1b-paired]",
    "tests/test_pipeline.py::test_memory_bounded_schedules_equal_single_device[v3-p4-r2-m8-interleaved-paired]",
    # float16 with FP8: rowwise (make test) runs the grouped kernel in FP8 with float16 around it
    "tests/test_fp8.py::test_fp8_with_float16_compute_trains_an_moe_model_as_float32_does[tensorwise]",
    "tests/test_fp8.py::test_fp8_with_float16_compute_trains_an_moe_model_as_float32_does[blockwise]",
    "tests/test_fp8.py::test_fp8_with_float16_compute_trains_an_moe_model_as_float32_does[mxfp8]",
    # the first stage's further rounds: test_moe.py's two-stage layer tests run them against the per-copy reference
    "tests/test_moe.py::test_two_stage_training_on_two_nodes_of_four_equals_single_device[1-0.5-expert8]",
    # chunks: the expert × tensor case (make test) runs the two-stage exchange in 2 chunks
    "tests/test_moe.py::test_two_stage_training_on_two_nodes_of_four_equals_single_device[2-2.0-expert8]",
    # the tensor ranks as expert shards: e2f2t2-experts-sp (make test) runs them with fsdp and sequence parallelism
    "tests/test_moe.py::test_expert_parallel_training_equals_single_device[e2t2-experts]",
    # 1F1B keeping the forward's residuals: the dense case (make test) runs the same table on one chunk a stage
    "tests/test_pipeline.py::test_memory_bounded_schedules_equal_single_device[v3-p4-r2-m8-interleaved-kept]",
}


def pytest_collection_modifyitems(config, items):
  for item in items:  # an entry without parameters names every case of its test
    if item.nodeid in SLOW or item.nodeid.split("[")[0] in SLOW:
      item.add_marker(pytest.mark.slow)

from jaxseek import config as config_lib  # noqa: E402
from jaxseek import step as step_lib  # noqa: E402
from jaxseek.metrics import read_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def load_config(name: str, *overrides: str) -> config_lib.Config:
  return config_lib.load(CONFIGS / f"{name}.yaml", list(overrides))


def run_steps(cfg: config_lib.Config, mesh, trainer, state, batches, steps: int):
  """`steps` training steps from `state`, one batch from `batches` each: the last state and every step's metrics
  on the host."""
  step_fn = step_lib.compile_step(trainer, cfg, mesh)
  records = []
  with jax.set_mesh(mesh):
    for _ in range(steps):
      state, metrics = step_fn(state, next(batches))
      records.append(jax.device_get(metrics))
  return state, records


def losses(run_dir: Path) -> dict[int, float]:
  """Loss per step from metrics.jsonl; a step logged twice (before a kill and after the resume) keeps the last."""
  return {record["step"]: record["loss"] for record in read_jsonl(run_dir / "metrics.jsonl")}


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture
def tiny_v3() -> config_lib.Config:
  return load_config("tiny-v3")


@pytest.fixture(scope="session")
def run_env() -> dict[str, str]:
  """Environment for subprocesses running jaxseek (this checkout first on the path)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_PLATFORMS"] = "cpu"
  return env
