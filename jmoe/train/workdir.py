"""What a run owns in its workdir: a lock held for the run's life, and files replaced whole.

The lock is `<workdir>/run.lock`, a JSON file naming the host, process id, start time and command
of the run that holds it, made with an exclusive create so that two runs cannot both take it. A
second run on the same workdir stops at once with a message naming the holder. A lock left by a
process of this host that no longer runs is taken over, with a notice. With several processes,
process 0 takes the lock for the run and tells the others whether it got it.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import socket
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from jmoe.errors import ConfigError

log = logging.getLogger("jmoe")
LOCK = "run.lock"


def write_atomic(path: pathlib.Path, text: str) -> None:
  """`text` into `path` through a temporary name renamed into place: a reader, or a crash,
  never sees half a file."""
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_text(text)
  tmp.replace(path)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # someone else's process
    return True
  return True


class WorkdirLock:
  """Held from `acquire()` to `release()` (or the end of a `with` block)."""

  def __init__(self, workdir: pathlib.Path):
    self.path = pathlib.Path(workdir) / LOCK
    self._held = False

  def acquire(self) -> "WorkdirLock":
    problem = self._take() if jax.process_index() == 0 else ""
    if jax.process_count() > 1:  # every process learns whether process 0 got it
      failed = multihost_utils.broadcast_one_to_all(np.int32(bool(problem)))
      if failed and not problem:
        problem = f"{self.path.parent} is in use by another run (see {self.path})"
    if problem:
      raise ConfigError(problem)
    return self

  def _take(self) -> str:
    """Takes the lock; the reason why not, or "" on success."""
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
    for _ in range(2):
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        holder = self._holder()
        if holder and holder.get("host") == me["host"] and not _alive(int(holder["pid"])):
          log.warning("taking over %s, left by process %s (no longer running) of this host",
                      self.path, holder["pid"])
          self.path.unlink(missing_ok=True)
          continue
        who = (f"process {holder.get('pid')} on {holder.get('host')} since "
               f"{holder.get('started')} ({holder.get('command')!r})" if holder else "another run")
        own = " (this process: close() the other Trainer first)" if holder and holder.get(
            "pid") == me["pid"] and holder.get("host") == me["host"] else ""
        return (f"{self.path.parent} is in use by {who}{own}. Wait for it to finish or give "
                f"another --workdir; if that run is gone (it was on another machine), delete "
                f"{self.path}")
      with os.fdopen(fd, "w") as f:
        json.dump(me, f)
      self._held = True
      return ""
    return f"could not take the lock {self.path}"

  def _holder(self) -> dict | None:
    try:
      return json.loads(self.path.read_text())
    except (OSError, ValueError):
      return None

  def release(self) -> None:
    if self._held:
      self.path.unlink(missing_ok=True)
      self._held = False

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
