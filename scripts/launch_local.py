"""Start N local processes joined by jax.distributed, each with its share of simulated CPU devices.

  python scripts/launch_local.py -n 2 -- python -m jaxseek.train --config configs/tiny-v3.yaml \\
      mesh.num_cpu_devices=4 mesh.data=2 mesh.fsdp=2 mesh.tensor=2

Each process gets JAXSEEK_COORDINATOR (127.0.0.1 and a free port), JAXSEEK_NUM_PROCESSES, JAXSEEK_PROCESS_ID and
JAXSEEK_NODE (each process counts as a node of its own, as on a cluster with one process per node);
`mesh.num_cpu_devices` is per process. Output lines are forwarded with a "[i]" prefix. If one process exits
with an error, the others are stopped and the launcher exits with that status.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def forward(index: int, stream) -> None:
  for line in stream:
    sys.stdout.write(f"[{index}] {line}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("-n", "--num-processes", type=int, required=True)
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each process runs")
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command or args.num_processes < 1:
    parser.error("give -n N and a command after --")
  port = free_port()
  procs = []
  for i in range(args.num_processes):
    env = dict(os.environ, JAXSEEK_COORDINATOR=f"127.0.0.1:{port}", JAXSEEK_NUM_PROCESSES=str(args.num_processes),
               JAXSEEK_PROCESS_ID=str(i), JAXSEEK_NODE=f"simulated-node-{i}")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    threading.Thread(target=forward, args=(i, proc.stdout), daemon=True).start()
    procs.append(proc)
  status = 0
  try:
    while any(p.poll() is None for p in procs):
      failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
      if failed:
        i, status = failed[0]
        print(f"launch_local: process {i} exited with status {status}; stopping the others", file=sys.stderr)
        break
      time.sleep(0.1)
  except KeyboardInterrupt:
    status = 130
  for p in procs:
    if p.poll() is None:
      p.terminate()
  for p in procs:
    try:
      p.wait(timeout=30)
    except subprocess.TimeoutExpired:
      p.kill()
  time.sleep(0.2)  # let the forwarding threads drain
  return status or next((p.returncode for p in procs if p.returncode), 0)


if __name__ == "__main__":
  sys.exit(main())
