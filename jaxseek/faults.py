"""Surviving faults: pre-emption signals (save and exit 0) and a watchdog for hung steps."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


class Preemption:
  """Notices SIGTERM (what SLURM sends before pre-empting, with --signal) and SIGINT; `requested()`, called once
  per step, is True at the step boundary where the run should save and exit.

  One process: the signal handler sets a flag. Several processes must save the same step (an Orbax save is
  collective), though a scheduler may signal them at different moments, or only one. So after each step every
  process adds its flag to a max over the processes (one int all-reduced between a device of each), and reads
  the result one step later, when the metrics are read and the previous step is done anyway: no extra host
  sync, and every process decides on the same step, whichever processes were signalled and whenever.

  Not JAX's preemption sync point: its native SIGTERM handler is replaced by any Python one (ours must stay
  for one process and for SIGINT), and Orbax's save-finalising thread calls it with the saved step, rewinding
  the step count it compares with; a process could then reach the sync point alone and save alone. main()
  switches JAX's service off, so SIGTERM before the loop ends a process at once, as it does a single one.
  """

  def __init__(self):
    self.signal_name: str | None = None
    self.shared = jax.process_count() > 1
    self._previous = {}
    if self.shared:  # a flag on the first device of each process, 0 or 1, built once
      firsts = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                for p in range(jax.process_count())]
      self._mesh = Mesh(np.array(firsts), ("process",))
      self._flags = [jax.make_array_from_callback((len(firsts),), NamedSharding(self._mesh, P("process")),
                                                  lambda _, v=v: np.full((1,), v, np.int32)) for v in (0, 1)]
      self._any = jax.jit(jnp.max, out_shardings=NamedSharding(self._mesh, P()))
      self._seen = None  # the max dispatched after the previous step
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame) -> None:
    self.signal_name = signal.Signals(signum).name

  def requested(self) -> bool:
    """True once any process has been signalled; with several processes, at the same step on all of them."""
    if not self.shared:
      return self.signal_name is not None
    seen, self._seen = self._seen, None
    if seen is not None and bool(seen):  # ready: it ran right after the previous step
      return True
    with jax.set_mesh(self._mesh):  # not the run's mesh: one device per process
      self._seen = self._any(self._flags[self.signal_name is not None])
    return False

  @property
  def reason(self) -> str:
    if self.shared:
      return f"{self.signal_name} to this process" if self.signal_name else "a signal to another process"
    return self.signal_name or "signal"

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
    self._lock = threading.Lock()  # once stop() returns, the watchdog cannot fire
    if timeout_s:
      threading.Thread(target=self._watch, name="jaxseek-watchdog", daemon=True).start()

  def beat(self, step: int) -> None:
    with self._lock:
      self.step, self.last = step, time.monotonic()

  @contextlib.contextmanager
  def paused(self):
    """Disarmed inside (an evaluation may take longer than a step); armed again after, if it was, from now."""
    with self._lock:
      armed, self.last = self.last is not None, None
    try:
      yield
    finally:
      with self._lock:
        if armed:
          self.last = time.monotonic()

  def _watch(self) -> None:
    while not self._stop.wait(min(self.timeout_s / 4, 5.0)):
      with self._lock:
        if self._stop.is_set() or self.last is None or time.monotonic() - self.last <= self.timeout_s:
          continue
        print(f"error: process {jax.process_index()}: step {self.step + 1} did not finish within "
              f"train.step_timeout_s={self.timeout_s:g} s (a dead peer or a hung collective); exiting",
              file=sys.stderr, flush=True)
        os._exit(1)

  def stop(self) -> None:
    with self._lock:
      self._stop.set()
