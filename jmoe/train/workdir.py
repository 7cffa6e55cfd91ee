"""What a run owns in its workdir: a lock held for the run's life, and files replaced whole; and
the checks that a directory can be a run's workdir, made before anything is written there.

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
import tempfile
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from jmoe.hf.files import TOKENIZER_FILES
from jmoe.errors import ConfigError

log = logging.getLogger("jmoe")
LOCK = "run.lock"
# What a run writes in its workdir, and whether each is a directory.
OWN = {"config.json": False, "metrics.jsonl": False, LOCK: False, "checkpoints": True,
       "corrupt_checkpoints": True, "tensorboard": True,
       **{name: False for name in TOKENIZER_FILES}}
PROBE = ".jmoe-write-check."  # the start of the files a writability check makes and removes


def workdir_path(workdir: str | os.PathLike) -> pathlib.Path:
  """`workdir` as a path; an empty one (an unset shell variable) is refused, not taken for the
  current directory."""
  if not str(workdir).strip():
    raise ConfigError("--workdir is empty (an unset shell variable?): give the directory this "
                      "run writes to")
  return pathlib.Path(workdir)


def check_workdir(workdir: pathlib.Path) -> None:
  """Refuses, before anything is written, a workdir the run cannot or must not write in: a file
  or a path under one, a directory that is not a jmoe run's (a model, another program's
  config.json, files of its own), and a path the run writes to (config.json, checkpoints/, ...)
  that has the wrong kind or cannot be written."""
  shown = f"--workdir {workdir}" + ("" if workdir.is_absolute() else f" ({workdir.absolute()})")
  if not workdir.exists():
    if workdir.is_symlink():
      raise ConfigError(f"{shown} is a link to {os.readlink(workdir)}, which does not exist: "
                        f"create that directory, or give another --workdir")
    parent = next(p for p in workdir.absolute().parents if p.exists())
    if not parent.is_dir():
      raise ConfigError(f"{shown} lies under {parent}, which is a file: give a directory's path")
    _check_writable(parent, f"{shown} cannot be created in {parent}")
    return
  if not workdir.is_dir():
    raise ConfigError(f"{shown} is a file: give a new or empty directory, or a jmoe workdir to "
                      f"resume")
  _check_is_a_run(workdir, shown)
  _check_writable(workdir, f"{shown} cannot be written")
  for name, is_dir in OWN.items():
    path = workdir / name
    if not (path.exists() or path.is_symlink()) or name in TOKENIZER_FILES:
      continue  # (tokenizer files already there are kept as they are)
    if path.is_dir() != is_dir:
      raise ConfigError(f"{path} is {'not ' if is_dir else ''}a directory, where the run "
                        f"writes its {name}: move it away, or give another --workdir")
    if is_dir:
      _check_writable(path, f"{path} cannot be written")
    elif name == "metrics.jsonl":
      try:
        open(path, "r+b").close()  # appended to; opening it so changes nothing
      except OSError as e:
        raise ConfigError(f"{path} cannot be written ({e.strerror}): make it writable, or "
                          f"give another --workdir") from None


def _check_is_a_run(workdir: pathlib.Path, shown: str) -> None:
  """Refuses a directory that holds something other than a jmoe run's workdir: a run writes
  config.json there, and must not write over another program's."""
  config = workdir / "config.json"
  if (workdir / "model").is_dir() and config.is_file():
    raise ConfigError(f"{shown} is a model checkpoint (config.json and model/), not a training "
                      f"workdir: to train from it, give it as --config.checkpoint.load_params "
                      f"and give another --workdir")
  if config.exists():
    what = _foreign_config(config)
    if what:
      raise ConfigError(f"{shown} is not a jmoe workdir: its config.json {what}, and a run "
                        f"would write over it; give an empty or new --workdir")
    return
  try:
    foreign = sorted(p.name for p in workdir.iterdir()
                     if p.name not in OWN and not _temporary(p.name))
  except OSError as e:
    raise ConfigError(f"{shown} cannot be read ({e.strerror}): make it readable and writable, "
                      f"or give another --workdir") from None
  if foreign:
    more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
    raise ConfigError(f"{shown} is not empty and is not a jmoe workdir (it holds "
                      f"{', '.join(foreign[:3])}{more}, and no config.json of a jmoe run): give "
                      f"an empty or new --workdir")


def _foreign_config(path: pathlib.Path) -> str:
  """Why the config.json at `path` is not a jmoe run's, or "" when it is one."""
  try:
    saved = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    return (f"cannot be read as JSON ({type(e).__name__}), so it cannot be told a jmoe run's "
            f"(if it was one, delete it: the run writes it again)")
  if isinstance(saved, dict) and all(isinstance(saved.get(g), dict) for g in ("model", "train")):
    return ""
  if isinstance(saved, dict) and ("model_type" in saved or "architectures" in saved):
    return "is a Hugging Face model's"
  return "is not a jmoe run's"


def _temporary(name: str) -> bool:
  """A file a run left while writing: `write_atomic`'s, or `_check_writable`'s."""
  return name.startswith(".") and (name.endswith(".tmp") or name.startswith(PROBE))


def _check_writable(directory: pathlib.Path, what: str) -> None:
  """Creates and removes a file in `directory`: the run will write there."""
  try:
    fd, probe = tempfile.mkstemp(prefix=PROBE, dir=directory)
    os.close(fd)
    os.unlink(probe)
  except OSError as e:
    raise ConfigError(f"{what} ({e.strerror}): make it writable, or give another "
                      f"--workdir") from None


def make_workdir(workdir: pathlib.Path) -> pathlib.Path | None:
  """Creates `workdir` (with missing parents); the outermost directory it made, or None when
  `workdir` was there."""
  path = workdir.absolute()
  missing = [p for p in (path, *path.parents) if not p.exists()]
  try:
    workdir.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"--workdir {workdir} cannot be created ({e.strerror}): give a directory "
                      f"you can write to") from None
  return missing[-1] if missing else None


def remove_made(workdir: pathlib.Path, made: pathlib.Path | None) -> None:
  """Removes the directories `make_workdir` made, if nothing was put in them."""
  if made is None:
    return
  path = workdir.absolute()
  for directory in (path, *path.parents):
    try:
      directory.rmdir()
    except OSError:
      return
    if directory == made:
      return


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
      try:
        with os.fdopen(fd, "w") as f:
          json.dump(me, f)
      except OSError as e:  # a full disk: the empty lock would look held by "another run"
        self.path.unlink(missing_ok=True)
        return (f"could not write the lock {self.path} ({e.strerror or e}): free some space "
                f"there, or give another --workdir")
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


def not_written(error: OSError, path: pathlib.Path) -> ConfigError:
  """The message for a file of the workdir (`path`, unless the error names one) that could not
  be written: a full disk, or the workdir changed under the run."""
  return ConfigError(f"{error.filename or path} cannot be written ({error.strerror}): free or "
                     f"fix it, then run the same command again (it resumes from the latest "
                     f"checkpoint in {path}, or starts over where none was saved)")
