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
    self._wakeup = None
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
      # the signals are counted by a thread that reads Python's wake-up pipe (written by the C-level handler in
      # whatever thread gets the signal): it hears them while the main thread is inside XLA (a compilation,
      # a hung step), where no Python handler runs
      read, write = os.pipe()
      os.set_blocking(write, False)
      self._wakeup = (read, write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
      threading.Thread(target=self._listen, args=(read,), name="jaxseek-signals", daemon=True).start()

  def _handle(self, signum, frame) -> None:
    """Python's handler (the main thread, between bytecodes): `_listen` has counted the signal already."""

  def _listen(self, read: int) -> None:
    """The first SIGTERM or SIGINT asks for a save at the end of the step; a second one exits at once (status
    128 + signal), keeping the last finished checkpoint."""
    while True:
      try:
        data = os.read(read, 64)
      except OSError:
        return
      if not data:
        return
      for signum in data:
        if signum not in (signal.SIGTERM, signal.SIGINT):
          continue
        name = signal.Signals(signum).name
        if self.signal_name is None:
          self.signal_name = name
          print(f"{name}: saving at the end of this step, then exiting (send it again to stop at once)",
                file=sys.stderr, flush=True)
        else:
          print(f"{name} again: stopping now; the last finished checkpoint is kept", file=sys.stderr, flush=True)
          os._exit(128 + signum)

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
    if self._wakeup is not None:
      read, write, previous = self._wakeup
      signal.set_wakeup_fd(previous)
      os.close(write)  # the listening thread reads the end of the pipe and returns
      self._wakeup = None


class Watchdog:
  """Exits the process (status 1) when no step completes within `timeout_s`, instead of hanging forever on a
  collective whose peer died. Armed by the first `beat()`, so compilation is not timed; evaluations and the final
  save run in a `phase` of their own (FINAL × timeout_s)."""

  FINAL = 10

  def __init__(self, timeout_s: float | None):
    self.timeout_s = timeout_s
    self.limit = timeout_s  # the current one (`phase`)
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
  def phase(self, timeout_s: float | None):
    """Inside, the time limit is `timeout_s` from now, armed whether or not a step has beaten (an evaluation or
    the final save, longer than a step, still ends the run if a peer dies there); after, as it was, from now."""
    if not self.timeout_s or not timeout_s:
      yield
      return
    with self._lock:
      saved, self.last, self.limit = (self.last, self.limit), time.monotonic(), timeout_s
    try:
      yield
    finally:
      with self._lock:
        self.last, self.limit = (time.monotonic() if saved[0] is not None else None), saved[1]

  def _watch(self) -> None:
    while not self._stop.wait(min(self.timeout_s / 4, 5.0)):
      with self._lock:
        if self._stop.is_set() or self.last is None or time.monotonic() - self.last <= self.limit:
          continue
        what = (f"step {self.step + 1} did not finish within train.step_timeout_s={self.timeout_s:g} s"
                if self.limit == self.timeout_s else
                f"an evaluation or checkpoint save did not finish within {self.limit:g} s")
        print(f"error: process {jax.process_index()}: {what} (a dead peer or a hung collective); exiting",
              file=sys.stderr, flush=True)
        os._exit(1)

  def stop(self) -> None:
    with self._lock:
      self._stop.set()


class Aligned:
  """A jitted program compiled on its first call with given argument shapes, dtypes and shardings
  (`lower(...).compile()`), with a console line while it compiles (`compiling the train step … done in 41.2 s`,
  process 0); a call with another signature (another batch shape) compiles again, and each compiled program is
  kept for its signature. With several processes it then waits at a barrier of the coordination service (no
  collective) until every process has compiled it, and only then runs it. XLA:CPU creates each Gloo communicator
  lazily, on a program's first run, and gives the other processes 30 s to join it: processes whose compiles end
  further apart than that fail (`Gloo context initialization failed: DEADLINE_EXCEEDED`), and the coordination
  service then aborts the others (SIGABRT). The barrier waits up to `timeout_s` (dist.init_timeout_s)."""

  def __init__(self, fn, name: str, timeout_s: int, options: dict | None = None, compile=None):
    self.fn, self.name, self.timeout_s, self.options, self.compile = fn, name, timeout_s, options, compile
    self.compiled: dict = {}  # signature → compiled program

  def __call__(self, *args):
    key = signature(args)
    compiled = self.compiled.get(key)
    if compiled is None:
      compiled = self.compiled[key] = compile_noted(lambda: self.fn.lower(*args), self.name,
                                                        options=self.options, compile=self.compile)
      if jax.process_count() > 1:
        import orbax.checkpoint as ocp

        # processes given explicitly: the coordination service's barrier, with a timeout (not a collective); every
        # process compiles the same signatures in the same order, so the n-th barrier names the same program
        ocp.multihost.sync_global_processes(f"jaxseek:compiled:{self.name}:{len(self.compiled)}",
                                            timeout=self.timeout_s, processes=set(range(jax.process_count())))
    return compiled(*args)


def signature(args) -> tuple:
  """What a compiled program is specialised to: the arguments' tree, and each leaf's shape, dtype and sharding
  (a Python scalar: its type)."""
  leaves, tree = jax.tree.flatten(args)
  return tree, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x).__name__)),
                      getattr(x, "sharding", None)) for x in leaves)


def compile_noted(lower, name: str, file=None, options: dict | None = None, compile=None):
  """`lower()` (a jitted function's `.lower(...)`) compiled with XLA `options` (by `compile(lowered, options)`
  where given: explore/predict.compile_planned), with `compiling the NAME … done in S s` on process 0's console
  (stdout, or `file`)."""
  loud = jax.process_index() == 0
  if loud:
    print(f"compiling the {name} …", end="", flush=True, file=file)
  start = time.perf_counter()
  compiled = compile(lower(), options) if compile else lower().compile(options or None)
  if loud:
    print(f" done in {time.perf_counter() - start:.1f} s", flush=True, file=file)
  return compiled
