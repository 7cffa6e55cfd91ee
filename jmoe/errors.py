"""The errors a command turns into a message and an exit code, and the registry lookup that raises
one. Every package may import this module; it imports nothing of jmoe's."""

from __future__ import annotations

import os
import re
import signal
from typing import Mapping, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
  """A config value (or data, checkpoint, directory) that cannot work; the message says which key
  or file and what to do."""


class Interrupted(Exception):
  """Training stopped by a signal after saving a checkpoint of `step`."""

  def __init__(self, step: int, signum: int):
    super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; "
                     f"the checkpoint of step {step} is saved, and the same command resumes it")
    self.step = step
    self.signum = signum


class Diverged(Exception):
  """Training cannot go on: its loss or parameters are not finite (the message says since when
  and what to try). No checkpoint of the non-finite state is written."""


def not_one_of(key: str, name, allowed) -> str:
  """The message for a config `key` set to `name`, which is not among `allowed`."""
  return f"{key} must be one of {list(allowed)}, got {name!r}"


def choice(key: str, name: str, registry: Mapping[str, T]) -> T:
  """`registry[name]`, or a ConfigError naming the config `key` and the names it may take."""
  if name not in registry:
    raise ConfigError(not_one_of(key, name, registry))
  return registry[name]


def os_error(error: BaseException) -> OSError | None:
  """The operating system's error under a failed write: `error` itself if an OSError, or one
  made from the code TensorStore (which writes Orbax's arrays) puts in its message of a failed
  write (`Failed writing: ... [os_error_code='28']`: a full disk); else None."""
  if isinstance(error, OSError):
    return error
  if isinstance(error, ConfigError):  # (a message of jmoe's, which may quote one of TensorStore's)
    return None
  found = re.search(r"(?:[Ee]rror writing|Failed writing|Failed to write).*os_error_code='?(\d+)",
                    str(error), re.DOTALL)
  if found is None:
    return None
  code = int(found.group(1))
  return OSError(code, os.strerror(code))
