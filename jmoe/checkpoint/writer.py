"""How jmoe's checkpoints write jax.Arrays through Orbax: one layer and one expert per chunk, in
data files of 64 MiB, TensorStore's threads bounded, so that training keeps cores of its own
beside an asynchronous save, and replicas shared out only across processes.

TensorStore writes with two pools of threads: one copies and compresses the data, one writes the
files (on tmpfs and into the page cache, copies in the kernel: CPU work too). By default the first
has a thread per core and the second up to 128, and a large save keeps every core busy. Beside
training that starves the host thread that launches each step: on an H200 host of 16 cores
(2026-12-03, Qwen3-30B-A3B's bench, a 31.3 GiB state written to /dev/shm) steps ran 26% slower
while a save was written with TensorStore's defaults (6.3 s), 11% with both pools held to 14
threads (6.8 s), 4% with 7 (8.0 s), 2% with 4 (15.3 s): 1.2, 0.7, 0.3 and 0.3 s of training lost
per save. Without compression the write is shorter but costs more (3.9 s and 57% slower steps
with TensorStore's defaults; 3.1 s and 22% with 7 threads).
A save written in the background (`checkpoint.async_save`: training goes on beside it, whether the
devices copy the state first or not) takes `checkpoint.write_threads` threads per pool (by
default 7 there: the two pools together leave two cores) and is compressed (zstd); one that
training waits for (a foreground save, the run's last, the one on a stop signal) takes three
threads per core in each pool (`waited_threads`) and is written uncompressed (unless
`checkpoint.compress_waited`), as nothing runs beside it: the 31.3 GiB state above took 3.9 s
uncompressed against 6.3 compressed (TensorStore's own pools), for 39% more room on disk.
Each array's zarr metadata names its codecs, so a reader needs no option, and steps written
either way share one directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

try:  # (Orbax's internals, for staged saves: `checkpoint.staging_gb` needs them)
  from orbax.checkpoint._src.serialization.types import TransferPriority
except ImportError:  # pragma: no cover - another Orbax
  TransferPriority = None
try:  # (and for writing a staged save's part beside the next part's transfer)
  from orbax.checkpoint._src.futures import future as orbax_future
  from orbax.checkpoint._src.serialization import jax_array_handlers as orbax_arrays
  from orbax.checkpoint._src.serialization import limits as orbax_limits
  from orbax.checkpoint._src.serialization import replica_slices as orbax_slices
  from orbax.checkpoint._src.serialization import types as orbax_types
  from orbax.checkpoint._src.serialization import worker_memory_utils as orbax_budget
except ImportError:  # pragma: no cover - another Orbax: its parts go one after another
  orbax_arrays = None

from jmoe.ops.params import LAYER_AXES


# Logical axes whose indices are stored one per chunk when they lead an array (a stacked
# variable's layers, then its experts): a reader of one layer, or of a block of experts, reads
# only their chunks (export-hf reads a checkpoint so).
CHUNKED_AXES = (*LAYER_AXES, "expert")

# The size TensorStore aims each of a checkpoint's data files at (Orbax's default: 2 GiB). Every
# data file is written by one thread, front to back, so a state in files of 2 GiB is written by
# a few threads: 64 MiB files took a 2.25 GiB state to tmpfs 2.2-2.8x faster on a 2-core machine
# (0.37 -> 1.04 GB/s compressed; 2026-12-03), and keep every core of a large host busy.
DATA_FILE_BYTES = 64 * 2**20


def part_save_args(tree: Any) -> Any:
  """Orbax save args for `tree` (model or train state): an nnx Variable's leading layer and expert
  axes (its `axes` metadata) are cut one index per chunk; other arrays are saved as Orbax
  chooses."""
  def one(leaf):
    if not isinstance(leaf, nnx.Variable):
      return ocp.SaveArgs()
    axes = leaf.get_metadata().get("axes") or ()
    lead = len(list(itertools.takewhile(lambda name: name in CHUNKED_AXES, axes)))
    return leaf.replace(ocp.SaveArgs(shard_axes=tuple(range(lead))))

  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_save(tree: Any) -> ocp.args.PyTreeSave:
  """Orbax's save argument for a train state or model `tree`: chunked by `part_save_args`, in
  data files of about DATA_FILE_BYTES."""
  return ocp.args.PyTreeSave(tree, save_args=part_save_args(tree),
                             ocdbt_target_data_file_size=DATA_FILE_BYTES)


def host_cores() -> int:
  """The cores this process may run on (a container's or `taskset`'s limit, not the host's)."""
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):  # (no affinity on this platform)
    return os.cpu_count() or 1


def write_threads(setting: int | None) -> int | None:
  """Threads for each of TensorStore's two pools: None for TensorStore's own (a write that
  nothing runs beside), `setting` when above 0, else half of the cores less one (the pools
  together leave two), at least 1."""
  if setting is None or setting > 0:
    return setting
  return max(1, (host_cores() - 2) // 2)


def waited_threads(setting: int | None) -> int | None:
  """Threads for each of TensorStore's two pools in a write the caller waits for (nothing runs
  beside it): `setting` when above 0, None for TensorStore's own (a copying thread per core),
  else three per core. A last save's write on an H100 host of 16 cores (2026-12-07, 24 GiB to
  /dev/shm, `scripts/save_rate.py --threads 16,32`) took 1.75 s with TensorStore's own pools
  and 1.43 s with 32 threads each; plain file writes of the same bytes ran at 25.1 GB/s from
  16 threads and 35.7 from 32: the host's cores are hyperthreads, and the copies into the page
  cache go faster with two at a time on each. The save in 1 GB parts (2026-12-08, another
  H100 host of 16 cores, `--gib 24 --threads 16,32,48,64 --repeats 2`) took 2.50-2.76 s with 16
  threads, 2.07-2.14 with 32, 1.95-1.97 with 48 and 2.00-2.07 with 64 (TensorStore copies
  jmoe's chunks before writing them: docs/CHECKPOINTS.md)."""
  if setting is None or setting > 0:
    return setting
  return 3 * host_cores()


def use_array_writer(threads: int | None = None, *, compressed: bool = True,
                     staged: bool = False, parts_bytes: int | None = None) -> None:
  """Registers jmoe's writer of jax.Arrays with Orbax: `ArrayWriter` with
  `write_threads(threads)`, `compressed`, `staged` and `parts_bytes`, and with replicas, each
  process holding one writes a share (`use_replica_parallel`) only when there are several
  processes. Within one process the shares would only cost a compiled slice of every replicated
  array at the first save (Orbax's default shares everywhere but on a platform named "gpu" or
  "cuda" in JAX_PLATFORMS)."""
  _register_array_writer(jax.process_count() > 1, write_threads(threads), compressed, staged,
                         parts_bytes)


@dataclasses.dataclass(frozen=True)
class SaveTimes:
  """Where a save the caller waited for (`save(..., waited=True)`, then `wait`) spent its time,
  in seconds from the call of `save`: until its arrays were on the host and until they were
  written (None where Orbax reported no array), until `wait` returned (Orbax's finishing: the
  step's metadata, its directory renamed, and the removal of steps past `keep`, which took
  `removing_s`)."""

  step: int
  gib: float  # the state's arrays, whole (the bytes the step's checkpoint holds uncompressed)
  on_host_s: float | None
  written_s: float | None
  finished_s: float
  removing_s: float

  def seconds(self) -> dict[str, float | None]:
    """Each phase's seconds (the `*_s` fields), rounded to 0.01 s, by field name."""
    return {k: None if v is None else round(v, 2)
            for k, v in dataclasses.asdict(self).items() if k.endswith("_s")}

  def summary(self) -> str:
    marks = [f"{what} after {s:.1f} s" for what, s in (("on the host", self.on_host_s),
                                                      ("written", self.written_s))
             if s is not None]
    if self.removing_s:
      marks.append(f"{self.removing_s:.1f} s of it removing steps past checkpoint.keep")
    size = f"{self.gib:.1f} GiB" if self.gib >= 1 else f"{self.gib * 1024:.1f} MiB"
    return (f"step {self.step} saved in {self.finished_s:.1f} s ({size}"
            f"{': ' if marks else ''}{', '.join(marks)})")


class SaveMarks:
  """When the arrays of the save under way last reached the host and were last written
  (`time.perf_counter()` seconds; None before any), as Orbax reports each batch of them to
  `TransferOrder`: the phases of a save's time (`Checkpointer.last_save`). jmoe's saves run one
  at a time, so one set of marks serves them all."""

  def __init__(self):
    self.clear()

  def clear(self) -> None:
    self.on_host: float | None = None
    self.written: float | None = None

  def times(self, step: int, started: float, gib: float, *, removing_s: float) -> SaveTimes:
    """The phases of the save of `step` (`gib`), called at `started`, now that it is finished."""
    since = lambda mark: None if mark is None else mark - started
    return SaveTimes(step=step, gib=gib, on_host_s=since(self.on_host),
                     written_s=since(self.written), finished_s=time.perf_counter() - started,
                     removing_s=removing_s)


MARKS = SaveMarks()


class TransferOrder:
  """When a save's arrays go to the host (Orbax's serialization callback): all of them before
  Orbax's `save` returns, or, `staged` (with a byte limit on the handler,
  `save_device_host_concurrent_gb`), in parts of at most that many bytes once `save` has
  returned, two parts on the host at most (`ArrayWriter._write_in_parts`): for states nothing
  changes while they are written (a save's own copy on the devices, or a save the caller waits
  for). Each batch's end on the host and end of writing are marked in `MARKS`."""

  def __init__(self, staged: bool):
    self.staged = staged

  def key_priority(self, keypath) -> TransferPriority:
    return (TransferPriority.ASYNCHRONOUS_DEPRIORITIZED if self.staged else
            TransferPriority.SYNCHRONOUS)

  def on_transfer_start(self, keypath) -> None:
    pass

  def on_transfer_end(self, keypath) -> None:
    MARKS.on_host = time.perf_counter()

  def on_write_start(self, keypath) -> None:
    pass

  def on_write_end(self, keypath) -> None:
    MARKS.written = time.perf_counter()


class ArrayWriter(ocp.type_handlers.ArrayHandler):
  """Orbax's writer of jax.Arrays with each of TensorStore's pools held to `threads` (None:
  TensorStore's own), and without zstd unless `compressed`. The jax.Arrays of a save share one
  TensorStore context (so one OCDBT database per process and step, as with Orbax's own writer):
  jmoe's train states hold jax.Arrays only, and its saves run one at a time. `staged`: the
  arrays go to the host in parts as the write goes on (`TransferOrder`), each part's transfer
  beside the write of the part before (`_write_in_parts`), so at most two parts are on the host
  at once (Orbax's own loop takes a part only once the one before is written: the devices' copy
  engine and the host's writer threads take turns). `parts_bytes`, where not staged: the arrays
  go to the host in parts of at most that many bytes all the same, and each part's write starts
  as soon as it is there, beside the writes of the parts before: for a save the caller waits
  for, whose whole state's host memory is at hand, so that its write does not wait for the last
  array's transfer (Orbax takes every array to the host before it writes the first)."""

  def __init__(self, *, threads: int | None, compressed: bool = True, staged: bool = False,
               parts_bytes: int | None = None, **kwargs):
    self.order = TransferOrder(staged)  # (whether staged: this order's, the one Orbax follows)
    super().__init__(callback=self.order, **kwargs)
    self.threads = threads
    self.compressed = compressed
    self.parts_bytes = parts_bytes
    self._context = None  # (Orbax's context for the last save's arrays, the bounded one)

  async def serialize(self, values, infos, args=None):
    for info in infos:
      info.use_compression = info.use_compression and self.compressed
    for info in infos if self.threads is not None else ():
      context = self._context
      if context is None or context[0] is not info.ts_context:
        context = self._context = (info.ts_context, ocp.type_handlers.get_ts_context(
            use_ocdbt=bool(info.is_ocdbt_checkpoint), file_io_concurrency_limit=self.threads,
            data_copy_concurrency_limit=self.threads))
      info.ts_context = context[1]
    part_bytes = self._part_bytes(values, infos)
    if part_bytes is None:
      return await super().serialize(values, infos, args)
    args = args or [ocp.SaveArgs()] * len(values)
    orbax_types.check_input_arguments(values, infos, args)
    orbax_arrays.check_array_values(values, infos, raise_error=True)
    futures = []
    if self._enable_write_sharding_file:
      futures.append(orbax_future.CommitFutureAwaitingContractedSignals(
          orbax_arrays._async_serialize_shardings(  # noqa: SLF001 - see the imports
              [value.sharding for value in values], infos, primary_host=self._primary_host),
          name="serialize_shardings"))
    futures.append(orbax_future.CommitFutureAwaitingContractedSignals(
        self._write_in_parts(values, infos, args, part_bytes), name="array_type_handler"))
    return futures

  def _part_bytes(self, values, infos) -> int | None:
    """The most bytes of a part when this save's arrays go to the host in parts (staged: Orbax's
    budget per process; else `parts_bytes`); None where Orbax writes them (neither, another
    Orbax, a dispatcher, random keys, which Orbax's writer stores with metadata of their own)."""
    if (orbax_arrays is None or self.has_dispatcher()
        or any(jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key) for value in values)):
      return None
    if self.order.staged:
      limiter = infos[0].device_host_byte_limiter if infos else None
      return limiter.max_bytes if isinstance(limiter, orbax_limits.LimitInFlightBytes) else None
    return self.parts_bytes

  async def _write_in_parts(self, arrays, infos, args, part_bytes: int) -> None:
    """Takes the arrays to the host in parts of at most `part_bytes`, in their order, and writes
    each part as soon as it is there: beside the writes of the parts before, or (staged) once
    the part before is written, a part being taken only once the one before the last is written
    (two on the host at most). The arrays' metadata is written once, for all of them, at the
    end (Orbax's store of it rewrites one file per process: parts written side by side would
    each drop the others')."""
    to_host = functools.partial(
        orbax_slices.transfer_arrays_to_host, replica_id=self._replica_id,
        use_replica_parallel=self._use_replica_parallel,
        min_slice_bytes_for_replica_parallel=self._min_slice_bytes_for_replica_parallel,
        max_replicas_for_replica_parallel=self._max_replicas_for_replica_parallel,
        enable_pinned_host_transfer=infos[0].enable_pinned_host_transfer)
    parts = orbax_budget.next_memory_budgeted_batch(
        list(zip(arrays, infos, args)), part_bytes,
        replica_id=None if self._use_replica_parallel else self._replica_id, dispatcher=None)
    writes = []
    try:
      for part in parts:
        part_arrays, part_infos, part_args = zip(*part)
        on_host = await asyncio.to_thread(to_host, part_arrays)
        for info in part_infos:
          self._callback.on_transfer_end(info.keypath)
        if writes and self.order.staged:
          await writes[-1]
        writes.append(asyncio.ensure_future(self._write_part(on_host, part_infos, part_args)))
      metadata = [m for written in await asyncio.gather(*writes) for m in written or ()]
      if self._array_metadata_store is not None:
        await self._array_metadata_store.write(
            checkpoint_dir=infos[0].parent_dir, array_metadatas=metadata,
            process_index=orbax_arrays.multihost.process_index())
    finally:
      for write in writes:
        if not write.done():
          write.cancel()

  async def _write_part(self, on_host, infos, args) -> list:
    """Writes one part's arrays; returns their metadata, for `_write_in_parts` to store."""
    metadata = await orbax_arrays._async_serialize_replica_slices(  # noqa: SLF001 - see the imports
        on_host, infos, args, primary_host=self._primary_host, metadata_key=self._metadata_key,
        array_metadata_store=None,
        enable_replica_parallel_separate_folder=self._enable_replica_parallel_separate_folder,
        use_replica_parallel=self._use_replica_parallel, ext_metadata={})
    for info in infos:
      self._callback.on_write_end(info.keypath)
    return metadata


_registered: tuple | None = None  # the writer's settings, once registered


def _register_array_writer(shared: bool, threads: int | None, compressed: bool,
                           staged: bool, parts_bytes: int | None) -> None:
  global _registered
  if _registered == (shared, threads, compressed, staged, parts_bytes):
    return
  absl_log = logging.getLogger("absl")
  level = absl_log.level
  absl_log.setLevel(logging.ERROR)  # (Orbax warns that its own writer is replaced)
  try:
    ocp.type_handlers.register_type_handler(
        jax.Array, ArrayWriter(threads=threads, compressed=compressed, staged=staged,
                               parts_bytes=parts_bytes, use_replica_parallel=shared),
        override=True)
    _registered = (shared, threads, compressed, staged, parts_bytes)
  finally:
    absl_log.setLevel(level)
