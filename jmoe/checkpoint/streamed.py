"""Model checkpoints written and read part by part, never whole in host memory.

A `StreamedArray` stands for an array that is never whole in memory: it knows its shape, its dtype
and the shape of its parts (a regular grid: one layer of a stacked variable, a block of experts),
and makes a part when that part is written. `save_streamed` hands a tree of them to Orbax, which
writes the checkpoint `jmoe.checkpoint.params.save_model` writes (OCDBT; one zarr chunk per part),
so every reader of model checkpoints reads it. At most two parts are in memory at a time: one being
made while the one before it is written. With several processes each makes and writes its share of
the parts (part i on process i % process_count), and Orbax joins what they wrote.

Reading is the other way round: a restore through `open_checkpointer` (with `OPENED` restore args)
reads nothing, and each array comes back as a `StoredArray` from which a region (a layer, a block
of experts) is read when asked. Only the chunks that hold the region are read: the checkpoints
jmoe writes keep one layer (and one expert) per chunk (jmoe.checkpoint.writer.part_save_args).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import pathlib
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.experimental import multihost_utils

from jmoe.checkpoint.disk import quiet_failed_writes
from jmoe.config import Config, ConfigError, to_dict
from jmoe.ops.lora import added, product

Region = tuple[slice, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class StreamedArray:
  """An array of `shape` in parts of `part_shape` (each axis divides evenly); `make(region)`
  returns the part at `region` (a slice per axis)."""

  shape: tuple[int, ...]
  dtype: np.dtype
  part_shape: tuple[int, ...]
  make: Callable[[Region], np.ndarray]

  def regions(self) -> Iterator[Region]:
    """Every part's region, in order."""
    counts = [n // p for n, p in zip(self.shape, self.part_shape)]
    for index in itertools.product(*map(range, counts)):
      yield tuple(slice(i * p, (i + 1) * p) for i, p in zip(index, self.part_shape))

  def part(self, region: Region) -> np.ndarray:
    value = np.asarray(self.make(region), self.dtype)
    if value.shape != self.part_shape:  # a bug in a mapping, not in the user's files
      raise AssertionError(f"the part at {region} has shape {value.shape}, not "
                           f"{self.part_shape}")
    return value


def part_shape(shape: Sequence[int], stacked: bool, blocked_axis: int | None, itemsize: int,
               target_bytes: int) -> tuple[int, ...]:
  """Parts of an array: one layer of it when `stacked` (axis 0), and along `blocked_axis` the
  largest block of whole rows (dividing the axis) that keeps a part within `target_bytes` (one
  row at least); the other axes whole."""
  out = [1 if stacked and axis == 0 else n for axis, n in enumerate(shape)]
  if blocked_axis is not None:
    row = math.prod(out) // out[blocked_axis] * itemsize
    n = shape[blocked_axis]
    out[blocked_axis] = max(d for d in range(1, n + 1) if n % d == 0 and
                            (d == 1 or d * row <= target_bytes))
  return tuple(out)


class _StreamedHandler(ocp.type_handlers.NumpyHandler):
  """Orbax's handler for `StreamedArray`s, saved as the numpy arrays they stand for. A part that
  cannot be made (a ConfigError: a tensor missing or damaged) stops the writing and is kept in
  `failed`, so that Orbax ends its save in step with the other processes and the caller raises
  it; what was written is then incomplete and must be thrown away."""

  def __init__(self):
    super().__init__()
    self.failed: list[ConfigError] = []

  async def serialize(self, values: Sequence[StreamedArray], infos, args=None):
    args = args or [ocp.SaveArgs()] * len(values)
    return [ocp.future.CommitFutureAwaitingContractedSignals(
        self._write(values, infos, args), name="jmoe_streamed")]

  async def _write(self, values: Sequence[StreamedArray], infos, args) -> None:
    index, count = ocp.multihost.process_index(), ocp.multihost.process_count()
    for value, info, arg in zip(values, infos, args):
      await info.await_path_creation()
      spec = ocp.type_handlers.get_json_tspec_write(
          info, use_ocdbt=info.is_ocdbt_checkpoint, global_shape=value.shape,
          local_shape=value.part_shape, dtype=value.dtype,
          process_index=index if info.is_ocdbt_checkpoint else None, arg=arg)
      spec.setdefault("dtype", value.dtype.name)  # (Orbax before 0.12.8 leaves it to the caller)
      if index == 0:  # writes the array's metadata; the others assume it
        await ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context)
      store = await ts.open(ts.Spec(spec), open=True, assume_metadata=True,
                            context=info.ts_context)
      writing = None
      for region in itertools.islice(value.regions(), index, None, count):
        try:  # made while the previous part is written
          part = await asyncio.to_thread(value.part, region)
        except ConfigError as e:
          self.failed.append(e)
          return
        if writing is not None:
          await writing
        writing = store[region].write(part, can_reference_source_data_indefinitely=True)
      if writing is not None:
        await writing


@dataclasses.dataclass(frozen=True, eq=False)
class StoredArray:
  """A saved array, opened: `read(region)` reads the region (an index per leading axis, slices
  allowed) from the files, as a numpy array."""

  store: ts.TensorStore
  source: pathlib.Path  # the checkpoint (Orbax item directory) it is in

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.store.shape)

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(self.store.dtype.numpy_dtype)

  def read(self, region: tuple[int | slice, ...] = ()) -> np.ndarray:
    return np.asarray(self.store[region].read().result())


def unreadable(stored: StoredArray, name: str, region: tuple, error: Exception) -> ConfigError:
  """The message for a region of `stored` (the array `name`) that cannot be read: the
  checkpoint is damaged (a training step's can be moved aside)."""
  where = ", ".join(f"{r.start}:{r.stop}" if isinstance(r, slice) else str(r) for r in region)
  step = stored.source.parent if stored.source.name == "state" else None
  remedy = (f"move {step} aside to use the checkpoint before it" if step
            else "convert or save it again")
  return ConfigError(f"{stored.source}: {name}[{where}] cannot be read ({type(error).__name__}: "
                     f"{str(error)[:200]}); the checkpoint is damaged: {remedy}")


FOLD_BYTES = 1 << 29  # the most float32 bytes of a weight's matrices folded at once


@dataclasses.dataclass(frozen=True, eq=False)
class FoldedArray:
  """A weight with its LoRA adapters folded in, W + scale A B (jmoe.ops.lora), read a region at
  a time as a `StoredArray` is. Each matrix (an index of the factors' leading axes: a layer, an
  expert) is folded whole whatever region is read, so that every reader (an export, a device's
  shard, a fingerprint) gets the same values."""

  weight: StoredArray | FoldedArray
  a: StoredArray
  b: StoredArray
  scale: float
  name: str  # the weight's, in messages

  @property
  def shape(self) -> tuple[int, ...]:
    return self.weight.shape

  @property
  def dtype(self) -> np.dtype:
    return self.weight.dtype

  @property
  def source(self) -> pathlib.Path:
    return self.weight.source

  def read(self, region: tuple[int | slice, ...] = ()) -> np.ndarray:
    region = tuple(region) + (slice(None),) * (len(self.shape) - len(region))
    lead = len(self.a.shape) + len(self.b.shape) - 2 - len(self.shape)
    if lead and isinstance(region[0], slice):  # a block of rows at a time
      start, stop, _ = region[0].indices(self.shape[0])
      rows = max(1, FOLD_BYTES // (4 * math.prod(self.shape[1:])))
      if stop - start > rows:
        out = None
        for i in range(start, stop, rows):
          part = self.read((slice(i, min(i + rows, stop)),) + region[1:])
          if out is None:
            out = np.empty((stop - start,) + part.shape[1:], part.dtype)
          out[i - start:i - start + len(part)] = part
        return out
    w = self._part(self.weight, self.name, region)
    a = self._part(self.a, f"{self.name}.lora.a", region[:lead])
    b = self._part(self.b, f"{self.name}.lora.b", region[:lead])
    kept = sum(isinstance(r, slice) for r in region[:lead])  # (an index drops its axis)
    return added(w, product(a, b, kept)[(slice(None),) * kept + region[lead:]], self.scale)

  @staticmethod
  def _part(stored: StoredArray | FoldedArray, name: str, region: tuple) -> np.ndarray:
    try:
      return stored.read(region)
    except ConfigError:
      raise
    except Exception as e:  # noqa: BLE001 - tensorstore's errors for a damaged chunk
      raise unreadable(stored, name, region, e) from None


class _OpeningHandler(ocp.type_handlers.NumpyHandler):
  """Orbax's handler for restoring an array as a `StoredArray`: opened, nothing read."""

  async def deserialize(self, infos, args=None) -> list[StoredArray]:
    opening = []
    for info in infos:
      await info.await_path_creation()
      spec = ocp.type_handlers.get_json_tspec_read(
          info, use_ocdbt=info.is_ocdbt_checkpoint,
          raise_array_data_missing_error=info.raise_array_data_missing_error)
      opening.append(ts.open(ts.Spec(spec), open=True, context=info.ts_context))
    return [StoredArray(store, pathlib.Path(info.parent_dir))
            for store, info in zip(await asyncio.gather(*opening), infos)]


OPENED = ocp.RestoreArgs(restore_type=StoredArray)  # restore args of an array to open


def open_checkpointer() -> ocp.Checkpointer:
  """An Orbax PyTree checkpointer that restores the arrays given `OPENED` as `StoredArray`s."""
  registry = ocp.type_handlers.create_type_handler_registry(  # (Orbax asks for jax.Array's)
      (StoredArray, _OpeningHandler()), (jax.Array, ocp.type_handlers.ArrayHandler()))
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(handler_impl=ocp.BasePyTreeCheckpointHandler(
      type_handler_registry=registry)))


def raise_everywhere(error: BaseException | None) -> None:
  """Raises on every process when any of them failed (`error` where it is this process's; every
  process calls this, so that none is left waiting for the others)."""
  failed = error is not None
  if ocp.multihost.process_count() > 1:
    failed = bool(np.any(multihost_utils.process_allgather(np.int32(failed))))
  if error is not None:
    raise error
  if failed:
    raise ConfigError("another process could not read or write its part of the model; its "
                      "message says what")


def save_streamed(directory: str | pathlib.Path, tree: dict[str, Any], config: Config) -> None:
  """Writes a (nested dict) tree of `StreamedArray`s as a model checkpoint with `config`, in
  the layout `jmoe.checkpoint.params.save_model` writes; every process calls it."""
  directory = pathlib.Path(directory).absolute()
  directory.mkdir(parents=True, exist_ok=True)
  streamed = _StreamedHandler()
  registry = ocp.type_handlers.create_type_handler_registry(
      (StreamedArray, streamed), (jax.Array, ocp.type_handlers.ArrayHandler()))  # (Orbax asks)
  # Orbax's check that every array has data would fail a save that a missing tensor stopped
  # (on the first process only, leaving the others waiting): the processes agree below instead.
  handler = ocp.PyTreeCheckpointHandler(handler_impl=ocp.BasePyTreeCheckpointHandler(
      type_handler_registry=registry, enable_post_merge_validation=False))
  with quiet_failed_writes(), ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(directory / "model", args=ocp.args.PyTreeSave(tree), force=True)
  raise_everywhere(streamed.failed[0] if streamed.failed else None)
  if ocp.multihost.process_index() == 0:
    (directory / "config.json").write_text(json.dumps(to_dict(config), indent=2))
