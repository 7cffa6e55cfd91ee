"""Removing checkpoints past `checkpoint.keep` with the files unlinked by several threads.

Orbax's deleter hands each directory of a step to one thread, and a checkpoint's data files all
lie in one directory (OCDBT's `d/`), so one thread unlinked them all: on tmpfs, where removing a
file frees its pages, the step before a run's last save (Qwen3-30B-A3B's bench, 27 GiB) took
2.5 s of that 5.5 s save on an H200 host (2026-12-06; one thread: 2.8-3.2 s for 24 GiB in
scripts/save_rate.py, eight unlinking files in turn: 0.6-0.7 s). `StepRemover` is Orbax's
deleter with the removal itself done by `remove_in_parallel`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pathlib
import time

import orbax.checkpoint as ocp

try:  # (Orbax's internals: where they move, old steps are removed Orbax's own way)
  from orbax.checkpoint._src.path import deleter
except ImportError:  # pragma: no cover - another Orbax
  deleter = None

from jmoe.checkpoint.disk import remove_tree

log = logging.getLogger("jmoe")


def remove_in_parallel(path: pathlib.Path, threads: int) -> None:
  """Removes the directory `path`: its files unlinked by `threads` threads, then the directories.
  Files already gone are no failure; raises an OSError naming what could not be removed."""
  files = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]

  def unlink(file: str) -> str:
    try:
      os.unlink(file)
    except FileNotFoundError:
      pass
    except OSError as e:
      return f"{file}: {e.strerror or e}"
    return ""

  with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
    failed = [why for why in pool.map(unlink, files) if why]
  why = remove_tree(pathlib.Path(path))
  if failed or why:
    raise OSError(f"removing {path} failed: {(failed or [why])[0]}")


class StepRemover(deleter.StandardCheckpointDeleter if deleter else object):
  """Orbax's deleter of old steps (on the primary process, steps found by Orbax's own name
  format) with `remove_in_parallel` taking `threads` threads. `removing_s`: the seconds its
  removals took since it was last set to 0 (by the save they follow)."""

  def __init__(self, directory: pathlib.Path, *, threads: int, **kwargs):
    super().__init__(directory, **kwargs)
    self.threads = threads
    self.removing_s = 0.0

  def _delete_step_permanently(self, step: int, delete_target) -> None:
    started = time.perf_counter()
    remove_in_parallel(pathlib.Path(delete_target), self.threads)
    seconds = time.perf_counter() - started
    self.removing_s += seconds
    log.debug("checkpoints: removed step %d with %d threads in %.2f s", step, self.threads,
              seconds)


def use_step_remover(manager: ocp.CheckpointManager, threads: int) -> StepRemover | None:
  """Gives `manager` a `StepRemover` in place of its own deleter (Orbax's private
  `_checkpoint_deleter`, its standard kind), or None where it has another: that one then stays."""
  own = getattr(manager, "_checkpoint_deleter", None)
  if deleter is None or type(own) is not deleter.StandardCheckpointDeleter:
    log.debug("checkpoints: Orbax's deleter is a %s; old steps are removed its way",
              type(own).__name__)
    return None
  remover = StepRemover(own._directory, threads=threads, name_format=own._name_format,
                        primary_host=own._primary_host)
  manager._checkpoint_deleter = remover
  return remover
