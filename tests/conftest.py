"""Every test sees 8 simulated CPU devices; tiny configs come from configs/. Helpers shared by the test files."""

import os
import shutil
import socket
from pathlib import Path

# Tests compile many small programs and run each a few times: compiling is most of their time. XLA:CPU's
# backend optimisations, its newer fusion emitters and XNNPACK each cost more compile time than they save in
# running here (a tiny-v3 train step on 8 devices: 6.6 s to compile with them, 2.5 s without).
# JAXSEEK_TEST_DEFAULT_OPT=1 keeps XLA's defaults (tests/test_default_opt_level.py runs a subset so).
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                  "--xla_cpu_use_xnnpack=false")
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
jax.config.update("jax_platforms", "cpu")

import pytest  # noqa: E402

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
