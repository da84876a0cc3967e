"""Surviving faults: pre-emption signals (save and exit 0) and a watchdog for hung steps."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import jax


class Preemption:
  """Notices SIGTERM (what SLURM sends before pre-empting, with --signal) and SIGINT.

  `requested(step)` is True at the step boundary where every process should save and exit. With several
  processes they must agree on the step: JAX's preemption sync point (jax.distributed's coordination service)
  decides it; a single process uses its own signal flag.
  """

  def __init__(self):
    self.signal_name: str | None = None
    self._previous = {}
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame) -> None:
    self.signal_name = signal.Signals(signum).name

  def requested(self, step: int) -> bool:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      return bool(multihost_utils.reached_preemption_sync_point(step)) or self.signal_name is not None
    return self.signal_name is not None

  def restore(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


class Watchdog:
  """Exits the process (status 1) when no step completes within `timeout_s`, instead of hanging forever on a
  collective whose peer died. Armed by the first `beat()`, so compilation is not timed."""

  def __init__(self, timeout_s: float | None):
    self.timeout_s = timeout_s
    self.last: float | None = None
    self.step = 0
    self._stop = threading.Event()
    if timeout_s:
      threading.Thread(target=self._watch, name="jaxseek-watchdog", daemon=True).start()

  def beat(self, step: int) -> None:
    self.step, self.last = step, time.monotonic()

  def _watch(self) -> None:
    while not self._stop.wait(min(self.timeout_s / 4, 5.0)):
      if self.last is not None and time.monotonic() - self.last > self.timeout_s:
        print(f"error: process {jax.process_index()}: step {self.step + 1} did not finish within "
              f"train.step_timeout_s={self.timeout_s:g} s (a dead peer or a hung collective); exiting",
              file=sys.stderr, flush=True)
        os._exit(1)

  def stop(self) -> None:
    self._stop.set()
