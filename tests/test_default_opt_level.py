"""Exactness at XLA's defaults: conftest.py compiles every test at optimisation level 0, without the CPU fusion
emitters and XNNPACK (faster to compile), so one test each of sharding invariance, expert, pipeline and context
parallelism runs again in a subprocess without those flags; what XLA does by default must not change what they
prove."""

import subprocess
import sys

import pytest

from conftest import ROOT, TEST_XLA_FLAGS
SUBSET = [
    "tests/test_sharding.py::test_sharded_training_equals_single_device[fsdp8]",
    "tests/test_moe.py::test_expert_parallel_training_equals_single_device[expert2]",
    "tests/test_pipeline.py::test_pipelined_training_equals_single_device[dense-p4-m8]",
    "tests/test_context.py::test_context_parallel_training_equals_single_device[dense-c2-ring-packed]",
]
# pytest in-process, then the XLA_FLAGS its conftest left: proof that the subset ran without the tests' flags
INNER = ("import os, sys, pytest; code = pytest.main(['-q', '-p', 'no:cacheprovider', *sys.argv[1:]]); "
         "print('XLA_FLAGS=' + repr(os.environ.get('XLA_FLAGS'))); sys.exit(code)")


@pytest.mark.parametrize("test", SUBSET, ids=[t.split("::")[0].split("/")[1][5:-3] for t in SUBSET])
def test_exactness_subset_passes_at_the_default_optimisation_level(test, run_env):
  env = dict(run_env, JAXSEEK_TEST_DEFAULT_OPT="1")
  flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f not in TEST_XLA_FLAGS)
  env.pop("XLA_FLAGS", None)
  if flags:
    env["XLA_FLAGS"] = flags
  proc = subprocess.run([sys.executable, "-c", INNER, test], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=900)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out
  assert "1 passed" in out, out
  left = out.rsplit("XLA_FLAGS=", 1)[1]
  assert not any(flag in left for flag in TEST_XLA_FLAGS), out
