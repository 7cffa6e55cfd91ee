"""A checkpoints directory as it lies on disk (its finished steps, the saves left unfinished, the
files a saved item needs), and Orbax's logs of a failed write kept off the terminal: the failure
reaches jmoe as an exception and the command says it in one line."""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import re
import shutil
import sys
import time
from typing import Iterator

import orbax.checkpoint as ocp


# An item directory of a saved train state lacks these only when damaged. Orbax itself fails
# later on them, and its reads in flight then print stray tracebacks: they are looked for first.
REQUIRED_FILES = ("_METADATA", "manifest.ocdbt")


def require_complete(item: pathlib.Path) -> None:
  """Raises (a damaged checkpoint) if the saved item directory lacks one of REQUIRED_FILES."""
  missing = [name for name in REQUIRED_FILES if not (item / name).is_file()]
  if missing:
    raise FileNotFoundError(f"{item / missing[0]} is missing")


# Orbax writes a step's checkpoint under this suffix and renames it to the step when complete.
UNFINISHED = ocp.path.step.TMP_DIR_SUFFIX
_UNFINISHED_NAME = re.compile(rf"(\d+){re.escape(UNFINISHED)}(-\d+)?")  # (older Orbax: -<time>)


def unfinished_saves(directory: pathlib.Path) -> list[pathlib.Path]:
  """The temporary directories of saves in `directory` that never finished."""
  try:
    return sorted(p for p in directory.iterdir() if _UNFINISHED_NAME.fullmatch(p.name))
  except OSError:  # not a directory (any more): nothing of Orbax's in it
    return []


def finished_steps(directory: pathlib.Path) -> list[int]:
  """The steps whose checkpoints `directory` holds on disk (Orbax's list in memory forgets,
  at the start of a background save, the steps that save would make old)."""
  try:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())
  except OSError:
    return []


def remove_tree(path: pathlib.Path) -> str:
  """Removes `path` (a directory, or a file or link where a directory was expected); "" or why
  it could not be removed. Nothing there (a file where its directory should be, too), or what
  another process removes meanwhile, is no failure."""
  def gone_already(function, name, error):
    if not isinstance(error, FileNotFoundError):
      raise error

  if not os.path.lexists(path):
    return ""
  try:
    if path.is_dir() and not path.is_symlink():
      shutil.rmtree(path, onexc=gone_already)
    else:
      path.unlink(missing_ok=True)
  except FileNotFoundError:
    pass
  except OSError as e:
    return e.strerror or str(e)
  return ""


def remove_settled(path: pathlib.Path, quiet: float = 1.0, limit: float = 30.0) -> str:
  """Removes `path` for good: the writes of a failed save that were in flight when it failed
  (TensorStore's, in its own threads, which Orbax does not wait for once one write raised)
  make their directories again when they end. Removes it, then again each time it comes back,
  until it has stayed away `quiet` seconds or `limit` seconds have passed. "" or why it could
  not be removed (a write still ending after `limit` is removed by the next start)."""
  deadline = time.monotonic() + limit
  why = remove_tree(path)
  away_since = time.monotonic()
  while not why and time.monotonic() - away_since < quiet and time.monotonic() < deadline:
    time.sleep(0.05)
    if os.path.lexists(path):
      why, away_since = remove_tree(path), time.monotonic()
  return why


class _NotAboutItemMetadata(logging.Filter):
  """Orbax warns that an item directory has no checkpoint-level metadata file: it lives one level
  up, where the checkpoint manager wrote it. Nothing is wrong."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "Metadata file does not exist" not in record.getMessage()


class _NoSaveTracebacks(logging.Filter):
  """A failed background save's tracebacks: logged by Orbax's threads, by asyncio for the writes
  failing beside the one Orbax raises, and raised by the writes that end after Orbax's event loop
  closed on the failure or are dropped unfinished at exit. The failure reaches the run as an
  exception at its next save or wait, and jmoe says it in one line. Also Orbax's warning, at
  each staged save, that it takes no array to the host before returning: none is meant to."""

  LOGGERS = ("absl", "asyncio")

  def filter(self, record: logging.LogRecord) -> bool:
    if record.name == "asyncio":
      return "exception was never retrieved" not in record.getMessage()
    if record.getMessage().startswith("No prioritized params found"):
      return False
    return not (record.levelno >= logging.ERROR and "orbax" in record.pathname
                and (record.exc_info or "Traceback" in record.getMessage()))

  def unraisable(self, raised) -> None:
    """sys.unraisablehook but for the writes of a failed save: an event loop closed under them,
    or their coroutines dropped unfinished."""
    closed = (isinstance(raised.exc_value, RuntimeError)
              and str(raised.exc_value) == "Event loop is closed")
    dropped = "orbax" in getattr(getattr(raised.object, "cr_code", None), "co_filename", "")
    if not (closed or dropped):
      self.hook(raised)


_QUIET = _NoSaveTracebacks()
_quiet_for = 0  # open Checkpointers that keep it on


def _quiet_saves(on: bool) -> None:
  """Turns `_QUIET` on for one more open Checkpointer, or off for one fewer."""
  global _quiet_for
  _quiet_for += 1 if on else -1
  if (_quiet_for, on) == (1, True):
    for name in _QUIET.LOGGERS:
      logging.getLogger(name).addFilter(_QUIET)
    _QUIET.hook, sys.unraisablehook = sys.unraisablehook, _QUIET.unraisable
  elif (_quiet_for, on) == (0, False):
    for name in _QUIET.LOGGERS:
      logging.getLogger(name).removeFilter(_QUIET)
    sys.unraisablehook = _QUIET.hook


@contextlib.contextmanager
def quiet_failed_writes() -> Iterator[None]:
  """Orbax's tracebacks of a write that fails within the block kept off the terminal (the
  failure reaches the caller as an exception, and the command says it in one line), and after
  the block for writes still in flight when it failed. JMOE_DEBUG=1 prints them all."""
  if os.environ.get("JMOE_DEBUG", "") not in ("", "0"):
    yield
    return
  _quiet_saves(True)
  yield  # (an exception leaves the quiet on)
  _quiet_saves(False)


@contextlib.contextmanager
def quiet_orbax() -> Iterator[None]:
  log_filter, absl_log = _NotAboutItemMetadata(), logging.getLogger("absl")
  absl_log.addFilter(log_filter)
  try:
    yield
  finally:
    absl_log.removeFilter(log_filter)
