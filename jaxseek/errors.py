"""User-facing errors: one clear line on stderr, exit status 2, no traceback."""

from __future__ import annotations

import functools
import sys
from typing import Callable


class UserError(Exception):
  """A problem the user can fix: bad config, missing file, mesh that does not fit the devices (exit status 2)."""


class RunStopped(Exception):
  """Training stopped itself on purpose (a non-finite loss, a hung step): one line, exit status 1."""


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
