"""Checkpoints written by an earlier jaxseek (main of 2026-12-03, before the model, kernels and pipeline moved
into their own packages) resume on this tree: the same state, the same next losses. The folders under
tests/golden/checkpoints hold step 3 of two runs; the losses of steps 4 to 6 are those the writing tree's own
resume logged (equal, to the last bit, to its never-stopped run)."""

import shutil
import subprocess
import sys

import pytest

from conftest import CONFIGS, ROOT, losses

GOLDEN = ROOT / "tests" / "golden" / "checkpoints"
RUNS = {
    # a DualPipeV V storage order, 5 layers (identity padding of the stacks), expert parallelism, MoE biases
    "v3-dualpipev": (["mesh.pipeline=2", "mesh.expert=2", "mesh.data=2", "model.num_hidden_layers=5",
                      "train.pipeline_schedule=dualpipev", "train.pipeline_repeats=2", "train.microbatches=4"],
                     {4: 5.569822311401367, 5: 5.583151340484619, 6: 5.5867133140563965}),
    # int8-compressed gradient sums over data 4: the residuals of error feedback in the saved state
    "v3-int8": (["mesh.expert=2", "mesh.data=4", "train.grad_compression=int8", "train.microbatches=2"],
                {4: 5.576480865478516, 5: 5.583919525146484, 6: 5.582070827484131}),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_checkpoint_of_an_earlier_tree_resumes_with_its_losses(name, tmp_path, run_env):
  overrides, expected = RUNS[name]
  run_dir = tmp_path / "run"
  shutil.copytree(GOLDEN / name, run_dir)
  command = [sys.executable, "-m", "jaxseek.train", "--config", str(CONFIGS / "tiny-v3.yaml"),
             "mesh.num_cpu_devices=8", "optim.warmup_steps=2", "metrics.every=1", "train.steps=6",
             f"train.run_dir={run_dir}", "checkpoint.every=0", *overrides]
  out = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "resumed from step 3" in out.stdout + out.stderr, out.stdout + out.stderr
  got = losses(run_dir)
  assert min(got) == 4, got  # nothing was trained again from the start
  for step, loss in expected.items():
    assert got[step] == pytest.approx(loss, rel=1e-6, abs=0), (step, got[step], loss)
