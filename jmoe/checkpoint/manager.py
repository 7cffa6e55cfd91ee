"""Saves and restores training checkpoints under `<workdir>/checkpoints` with Orbax.

Each step's checkpoint holds three items:
    state/   the train state (step, parameters, optimizer state, router biases)
    data/    the input pipeline's position, as JSON
    run/     what a resume must find unchanged that the state does not hold (the model settings,
             and with LoRA the model under the adapters), as JSON
Saves are asynchronous: the state is copied on its devices (where they have room for a copy beside
the step's peak), `save` returns at once and training goes on while a thread of the checkpointer
copies that to the host and Orbax writes it in the background; the next save (or `wait`) waits for
both. Without room for the copy, or with several processes (Orbax's barriers between them are
device collectives, which must not run beside a step's), and for a save the caller waits for (a
run's last), `save` returns once the arrays are on the host (with `checkpoint.staging_gb`, a
save the caller waits for returns once written, its arrays taken to the host a part at a time,
as is a save's copy on the devices). Orbax writes a step in
`<step>.orbax-checkpoint-tmp` and renames it to `<step>` when complete, so a save cut short leaves
no half-written step behind. A save that fails, in the foreground or the background, removes its
temporary directory and raises a ConfigError naming the step, the directory and the cause at the
next `save` or `wait`; a run killed while saving leaves its temporary directory, which the next
run on the workdir removes (`remove_unfinished`) once it has found everything else in order.

Reading and restoring: `CheckpointReader` (jmoe/checkpoint/reader.py), which this extends.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import pathlib
import threading
import time
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jmoe.checkpoint import pinned, writer
from jmoe.checkpoint.disk import (UNFINISHED, _quiet_saves, finished_steps, remove_settled,
                                  remove_tree, unfinished_saves)
from jmoe.checkpoint.reader import CheckpointReader
from jmoe.checkpoint.remover import use_step_remover
from jmoe.checkpoint.save_thread import SaveThread
from jmoe.checkpoint.snapshot import (CopyRoom, bytes_per_device, copy_programs, copy_split,
                                      device_copy)
from jmoe.checkpoint.writer import use_array_writer
from jmoe.config import ConfigError
from jmoe.errors import os_error

log = logging.getLogger("jmoe")

# The longest a save's transfer to the host waits for the loop's `transfer_lead` steps.
TRANSFER_LEAD_S = 10.0


def _gib(leaves: list) -> float:
  """The GiB the arrays among `leaves` hold on the device that holds the most of them."""
  return max(bytes_per_device(leaves).values(), default=0) / 2**30


class Checkpointer(CheckpointReader):

  def __init__(self, directory: str | pathlib.Path, keep: int, *, async_save: bool = True,
               write_threads: int | None = 0, compress_waited: bool = False,
               pinned_transfer: bool | None = None, paced_transfer: bool = False,
               waited_write_threads: int | None = 0, transfer_lead: int = 0,
               staging_gb: float = 0.0, waited_parts_gb: float = 1.0):
    """`staging_gb` (`checkpoint.staging_gb`): above 0, a save whose state nothing changes while
    it is written (its own copy on the devices, or one the caller waits for) takes it to the host
    in parts of at most this many GB (1e9 bytes), each taken while the one before is written, and
    page-locked memory is reserved for two parts rather than the whole state; a save beside
    training without a copy still takes the whole state at once. `pinned_transfer`: whether a
    save copies the arrays to the host through page-locked memory (None: Orbax's choice, on a
    GPU yes), else into pageable memory. `paced_transfer`:
    a copy made on the devices goes to page-locked memory one array at a time, each waited for
    (else Orbax starts every array's transfer at once). Both for comparing the ways on a GPU
    (scripts/save_timeline.py). `waited_write_threads`: the threads of each of TensorStore's
    pools for a save the caller waits for (0: three per core, writer.waited_threads; None:
    TensorStore's own; scripts/save_rate.py). `waited_parts_gb`: a save the caller waits for,
    not staged, takes the state to the host in parts of this many GB and writes each as soon as
    it is there, beside the parts before (0: every array on the host before the first is
    written, Orbax's way; scripts/save_rate.py compares them).
    `transfer_lead`: a save whose state was copied on the devices starts taking the copy to
    the host once the loop has launched this many steps after it (`stepped`), so that the
    device has them queued while the transfer holds up the launch of the next ones (or after
    TRANSFER_LEAD_S at most, or at `wait`); 0: at once."""
    self.directory = pathlib.Path(directory).absolute()
    use_array_writer()  # (before Orbax's handlers are made: without it a later save's writer
    # wrote no array metadata, "No ArrayMetadata found", in the tests of 2026-12-03)
    self._write_threads = write_threads  # for writes beside training (0: writer.py's choice)
    self._waited_threads = waited_write_threads  # for writes the caller waits for
    self._compress_waited = compress_waited  # (writes beside training are always compressed)
    self._paced = paced_transfer
    self._lead = transfer_lead
    if staging_gb and writer.TransferPriority is None:
      raise ConfigError(f"checkpoint.staging_gb={staging_gb:g} needs the transfer priorities of "
                        f"orbax-checkpoint 0.12, which this Orbax ({ocp.__version__}) lacks: set "
                        f"it to 0, or install orbax-checkpoint 0.12")
    self._staging = staging_gb
    self._waited_parts = int(waited_parts_gb * 1e9) or None
    self._room = CopyRoom()  # (the devices' peak without this checkpointer's own copies)
    # Nothing is created before the first save (a refused run leaves no trace). Directories are
    # made in the foreground: made in the background, a failure to make one left Orbax's other
    # writer threads waiting for it for 20 minutes, and the process with them.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=False, enable_async_checkpointing=async_save,
        async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False))
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.PyTreeCheckpointHandler(
            save_concurrent_gb=96, enable_pinned_host_transfer=pinned_transfer,
            save_device_host_concurrent_gb=staging_gb or None),
                       "data": ocp.JsonCheckpointHandler(),
                       "run": ocp.JsonCheckpointHandler()})
    # (old steps removed by several threads: Orbax's deleter gave their data files one)
    self._remover = use_step_remover(self._manager, writer.write_threads(write_threads))
    self.unreadable: list[int] = []  # steps restore_latest passed over
    self._pending: int | None = None  # the step whose write may still be under way
    self._broken = False  # a save failed
    self._partial: set[int] = set()  # the steps whose failed saves' files were removed
    self._async = async_save
    self._thread: SaveThread | None = None  # the save taking a device copy to the host
    self._copies_noted = False
    self._reserving: threading.Thread | None = None  # page-locked host memory being reserved
    self._expected: list | None = None  # the state's leaves, until `expect_step`
    self._in_parts: bool | None = None  # page-locked memory was reserved for two parts only
    self._compiling: list[threading.Thread] = []  # the state's device copy being compiled
    self._timing: tuple[int, float, float] | None = None  # a waited save's (step, start, GiB)
    self.last_save: writer.SaveTimes | None = None  # the last waited save's, once waited for
    self._quiet = os.environ.get("JMOE_DEBUG", "") in ("", "0")
    if self._quiet:
      _quiet_saves(True)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def reserve_host_memory(self, state: Any) -> None:
    """Starts reserving the page-locked host memory the saves of `state` will copy into (GPU,
    asynchronous saves in one process), in a thread, and compiling the copy of it on the
    devices in another: called before the step compiles, so that the first save does not hold
    training up while the pages are locked (jmoe/checkpoint/pinned.py) or the copy compiles."""
    if not (self._async and jax.process_count() == 1 and jax.default_backend() == "gpu"):
      return
    leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
              if isinstance(x, jax.Array) else x for x in jax.tree.leaves(state)]
    self._expected = leaves
    if pinned.has_pinned_host(state):
      self._reserving = pinned.reserve_in_thread(state, 2 * self._staging * 1e9 or None)
      self._in_parts = bool(self._staging)
    self._compiling.append(self._compile_in_thread(leaves))

  @staticmethod
  def _compile_in_thread(leaves: list, to_host: frozenset[int] = frozenset()
                         ) -> threading.Thread:
    """Compiles the state's copy (`copy_programs(leaves, to_host)`) in a daemon thread, started;
    a failure only leaves it to the first save."""
    def compile_copy():
      try:
        copy_programs(leaves, to_host)
      except Exception as e:  # noqa: BLE001 - an optimisation; the first save compiles it
        log.debug("checkpoints: compiling the state's copy failed: %s", e)

    thread = threading.Thread(target=compile_copy, name="jmoe-copy-compile", daemon=True)
    thread.start()
    return thread

  def expect_step(self, step_bytes: int, memory_stats: Callable = lambda d: d.memory_stats()
                  ) -> None:
    """Told the compiled step's bytes per device (before the first step), prepares the saves
    beside training for the room the step leaves for the state's copy (`copy_split`, with
    `step_bytes` for the peak). Where only part of the copy fits, the program that copies that
    part and puts the rest in page-locked host memory is compiled now. Where not all of it fits
    and page-locked memory was reserved for two parts of a staged save only, the saves beside
    training will take the state (or the rest) to the host before the next step, so page-locked
    memory for all of it is reserved now, before training starts. Locked at the first such save
    instead, it held training up: about 5.5 s for 21 GiB on an H100 (Qwen3's bench,
    2026-12-07)."""
    leaves, in_parts = self._expected, self._in_parts
    self._expected = self._in_parts = None
    if leaves is None:
      return
    to_host = copy_split(leaves, memory_stats, peak=step_bytes)
    if to_host:
      log.info("checkpoints: the devices have room for %.1f of the state's %.1f GiB beside the "
               "step: saves beside training copy that part on the devices and put the rest in "
               "page-locked host memory before the next step",
               _gib([x for i, x in enumerate(leaves) if i not in to_host]), _gib(leaves))
      self._compiling.append(self._compile_in_thread(leaves, to_host))
    if to_host == frozenset() or not in_parts:
      return
    self.wait_reserved()
    if to_host is None:
      log.info("checkpoints: the devices lack room for the state's copy beside the step, so saves "
               "beside training take all of it to the host: reserving page-locked memory for all "
               "of it, not two parts")
    pinned.reserve(leaves)

  def wait_reserved(self) -> None:
    """Waits for what `reserve_host_memory` started (the first save waits for it too)."""
    for thread in (self._reserving, *self._compiling):
      if thread is not None:
        thread.join()
    self._reserving, self._compiling = None, []

  def copy_for_save(self, state: Any) -> Any | None:
    """A copy of `state` on its devices for a save beside training (`save(..., copied=True)`),
    queued behind the step that made `state`, so that the next step may be launched (and may
    overwrite `state`) before the save goes on; None where a save beside training takes no
    copy: saves not asynchronous, several processes, or no room beside the step's peak (the
    save must then be made before the next step). Waits for the previous save first, whose
    copy may still hold device memory."""
    if not self._async or jax.process_count() > 1:
      return None
    self.wait()
    self.wait_reserved()
    return self._device_copy(state)

  def _device_copy(self, state: Any) -> Any | None:
    copy = device_copy(state, self._room)
    self._room.copied |= copy is not None
    return copy

  def save(self, step: int, state: Any, data: dict[str, Any] | None = None,
           run: dict[str, Any] | None = None, *, waited: bool = False,
           copied: bool = False) -> None:
    """Starts saving `state`, the data position and `run` (what a resume checks) as step
    `step`; returns before the write ends (with async saves not `waited` for, before the arrays
    reach the host where the devices have room for a copy of them). A step that is already
    saved is left as it is. `waited`: the caller waits for this save (a run's last), so its
    write takes three threads per core (or `waited_write_threads`) and is compressed only with
    `compress_waited`, and it returns once written (its state taken to the host in parts as the
    write goes on: `staging_gb`, or else `waited_parts_gb`); else a write in the
    background is held to `write_threads` and compressed (jmoe/checkpoint/writer.py).
    `copied`: `state` is `copy_for_save`'s copy, taken to the host and written beside training.
    Raises a ConfigError if the previous save failed, or this one in the foreground."""
    if step in self._manager.all_steps():
      return
    self.wait()
    self.wait_reserved()  # (long done, unless the first save comes within seconds)
    beside = self._async and not waited  # (training goes on while this save is written)
    if self._remover is not None:  # (the step past `keep`, removed once this one is written)
      self._remover.threads = (writer.write_threads(self._write_threads) if beside else
                               writer.host_cores())
      self._remover.removing_s = 0.0
    writer.MARKS.clear()
    if waited:
      nbytes = sum(x.nbytes for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
      self._timing = (step, time.perf_counter(), nbytes / 2**30)
    # With several processes Orbax's save meets the others at barriers that are device
    # collectives, which must not run beside a step's from another thread: foreground there. A
    # save the caller waits for takes the state to the host as it is (a copy would only cost
    # time and memory).
    if copied:
      copy = state
    else:
      copy = self._device_copy(state) if beside and jax.process_count() == 1 else None
    # (a state nothing changes while it is written may go to the host in parts)
    staged = bool(self._staging) and (copy is not None or not beside)
    parts = None if beside or staged else self._waited_parts  # (written as they come)
    writing = dict(threads=self._write_threads if beside else
                   writer.waited_threads(self._waited_threads),
                   compressed=beside or self._compress_waited, staged=staged, parts_bytes=parts)
    use_array_writer(**writing)
    if beside and not self._copies_noted and jax.default_backend() != "cpu":
      self._copies_noted = True
      why = ("several processes save together" if jax.process_count() > 1 else
             "the devices lack room for a copy beside the step's peak")
      on_host = copy is not None and any(
          x.sharding.memory_kind == pinned.PINNED for x in jax.tree.leaves(copy)
          if isinstance(x, jax.Array))
      log.info("checkpoints: %s", "the state is copied on its devices and training goes on "
               "while the copy goes to the host" if copy is not None and not on_host else
               "the part of the state the devices have room for is copied there, training "
               "waits while the rest goes to the host, then goes on beside the copy's transfer"
               if on_host else f"training waits while the state goes to the host ({why})")
    items = dict(data=ocp.args.JsonSave(data or {}))
    if run:
      items["run"] = ocp.args.JsonSave(run)
    self._pending = step
    if copy is None:
      try:
        self._start(step, state, items)
      except Exception as e:  # noqa: BLE001 - whatever the file system says, named in one line
        raise self._failed(step, e) from None
      if staged or parts:  # (the state is read as the write goes on: done before returning)
        self.wait()
      return
    self._thread = SaveThread(functools.partial(self._start_copy, step, copy, items, writing),
                              lead=self._lead, limit_s=TRANSFER_LEAD_S, name=f"jmoe-save-{step}")

  def stepped(self) -> None:
    """Called by the training loop after it launches each step: counts them towards the pending
    save's `transfer_lead`."""
    if self._thread is not None:
      self._thread.stepped()

  def _start(self, step: int, state: Any, items: dict[str, Any]) -> None:
    """Orbax's save: returns once `state` is on the host, its write under way."""
    items = dict(state=writer.state_save(state), **items)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def _start_copy(self, step: int, state: Any, items: dict[str, Any],
                  writing: dict[str, Any]) -> None:
    """`_start` on a copy of the state made on its devices for this save (in its SaveThread),
    with the writer `save` chose (registered again: another Checkpointer made while the save
    was held back registers its own)."""
    use_array_writer(**writing)
    if self._paced and pinned.has_pinned_host(state):
      state = pinned.put_in_turn(state)
    self._start(step, state, items)

  def wait(self) -> None:
    """Waits for the save under way; raises a ConfigError if it failed."""
    step, self._pending = self._pending, None
    thread, self._thread = self._thread, None
    error = thread.join() if thread is not None else None
    if error is not None:
      raise self._failed(step, error) from None
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      raise self._failed(step, e) from None
    if self._timing is not None:
      removing_s = self._remover.removing_s if self._remover is not None else 0.0
      self.last_save = writer.MARKS.times(*self._timing, removing_s=removing_s)
      self._timing = None
      log.info("checkpoints: %s", self.last_save.summary())

  def _failed(self, step: int | None, error: Exception) -> ConfigError:
    """The message for the failed save of `step`, once what it wrote is removed."""
    self._broken = True
    self._timing = None
    left = self._remove_partial(step)
    kept = [s for s in finished_steps(self.directory) if s != step]
    cause = os_error(error)
    again = (f"there is free space in {self.directory} again"
             if cause is not None and cause.errno in (errno.ENOSPC, errno.EDQUOT) else
             f"{self.directory} is a writable directory again")
    earlier = (f"the checkpoint of step {max(kept)} is kept: once {again}, the same command "
               f"resumes from it" if kept else f"no earlier checkpoint is left in {self.directory}")
    reason = str(error).splitlines()[0][:300] if str(error) else ""
    # (An OSError says its cause first; TensorStore's, at the end of what may be cut off.)
    said = f"{cause.strerror}: " if cause is not None and cause is not error else ""
    return ConfigError(f"saving the checkpoint of step {step} in {self.directory} failed "
                       f"({said}{type(error).__name__}: {reason}), so training stopped; "
                       f"{earlier}{left}")

  def _remove_partial(self, step: int | None) -> str:
    """Removes what the failed save of `step` wrote: its temporary directory (a finished step's
    directory is never touched). "" or, when it could not be removed, a clause saying so."""
    if step is None:
      return ""
    self._partial.add(step)
    path = self.directory / f"{step}{UNFINISHED}"
    why = remove_tree(path)
    return f"; its partial files in {path} could not be removed ({why}): delete them" if why else ""

  def remove_unfinished(self) -> None:
    """Removes the temporary directories of saves that never finished (a run killed while
    saving): they are no checkpoint, and hold disk space. For the run that holds the workdir,
    once it has found everything else in order."""
    for path in unfinished_saves(self.directory) if jax.process_index() == 0 else []:
      log.warning("removing %s: the save of step %s did not finish (its run was stopped while "
                  "saving)", path, path.name.split(".")[0])
      why = remove_tree(path)
      if why:  # (in the way only if this run saves that step again; that save then says so)
        log.warning("%s cannot be removed (%s): delete it", path, why)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("jmoe_remove_unfinished")

  def close(self) -> None:
    """Waits for the save under way (raising if it failed) and lets go of Orbax's threads."""
    try:
      self.wait()
    finally:
      self._manager.close()
      # Writes of a failed save still in flight when it failed make its directory again as
      # they end (TensorStore makes the directories it writes in).
      for step in self._partial:
        remove_settled(self.directory / f"{step}{UNFINISHED}")
      # After a failed save the quiet stays on: the writes still in flight when it failed
      # report their own failures when they end, or when collected at the process's exit.
      if self._quiet and not self._broken:
        _quiet_saves(False)
        self._quiet = False
