"""Exact resume, repeated: SIGKILL a training run at a random step, restart it, compare every loss bit for bit.

  python benchmarks/resume_after_kill.py [--trials 10] [--steps 40] [--seed 0]

Run A trains `--steps` steps straight. Each trial starts run B with the same config, kills it with SIGKILL at a
random step after step 20 (a save may be in flight), restarts it, and checks that B's losses for every step equal
A's bit for bit (metrics.jsonl, the last record of each step).
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxseek.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def command(run_dir: Path, steps: int) -> list[str]:
  return [sys.executable, "-m", "jaxseek.train", "--config", str(ROOT / "configs/tiny-v3.yaml"),
          "mesh.num_cpu_devices=8", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "metrics.every=1",
          f"train.steps={steps}", "checkpoint.every=5", f"train.run_dir={run_dir}"]


def losses(run_dir: Path) -> dict[int, float]:
  path = run_dir / "metrics.jsonl"
  return {record["step"]: record["loss"] for record in read_jsonl(path)} if path.exists() else {}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--trials", type=int, default=10)
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  rng = random.Random(args.seed)
  with tempfile.TemporaryDirectory() as tmp:
    straight = Path(tmp) / "A"
    subprocess.run(command(straight, args.steps), check=True, capture_output=True)
    reference = losses(straight)
    passed = 0
    for trial in range(args.trials):
      run_dir = Path(tmp) / f"B{trial}"
      kill_at = rng.uniform(20.5, args.steps - 2)  # a fractional step: somewhere inside a step or a save
      proc = subprocess.Popen(command(run_dir, args.steps), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
      while max(losses(run_dir), default=0) < int(kill_at) and proc.poll() is None:
        time.sleep(0.01)
      time.sleep((kill_at - int(kill_at)) * 0.1)
      proc.send_signal(signal.SIGKILL)
      proc.wait()
      killed_after = max(losses(run_dir), default=0)
      out = subprocess.run(command(run_dir, args.steps), check=True, capture_output=True, text=True).stdout
      resumed = int(out.split("resumed from step ")[1].split()[0]) if "resumed from step" in out else 0
      got = losses(run_dir)
      same = got == reference
      passed += same
      print(f"trial {trial}: killed after step {killed_after}, resumed from step {resumed}: "
            f"{'all losses bit-identical' if same else 'MISMATCH'}", flush=True)
    print(f"{passed}/{args.trials} trials resumed exactly")
    sys.exit(0 if passed == args.trials else 1)


if __name__ == "__main__":
  main()
