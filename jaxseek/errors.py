"""User-facing errors: one clear line on stderr, exit status 2, no traceback."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Callable


class UserError(Exception):
  """A problem the user can fix: bad config, missing file, mesh that does not fit the devices (exit status 2)."""


class RunStopped(Exception):
  """Training stopped itself on purpose (a non-finite loss, a hung step): one line, exit status 1."""


def writable_file(path: str | Path, flag: str) -> Path:
  """`path` as a file the command can write at its end, checked before any work: its folder exists and is
  writable, and it is not a folder itself."""
  path = Path(path)
  if path.is_dir():
    raise UserError(f"{flag} {path} is a folder; name a file")
  folder = path.parent
  if not folder.is_dir():
    raise UserError(f"{flag} {path}: folder {folder} does not exist; create it or choose another path")
  if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
    raise UserError(f"{flag} {path} cannot be written (permission denied); choose another path")
  return path


def cli(main: Callable[..., int | None]) -> Callable[..., int]:
  """Wraps a command-line entry point so a UserError ends with one line on stderr and exit status 2."""

  @functools.wraps(main)
  def wrapped(*args, **kwargs) -> int:
    try:
      return main(*args, **kwargs) or 0
    except UserError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    except RunStopped as e:
      print(f"error: {e}", file=sys.stderr)
      return 1

  return wrapped
