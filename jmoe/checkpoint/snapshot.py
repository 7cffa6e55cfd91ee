"""Copies of a train state on its own devices, which let training go on while a save takes
them to the host: the next step may donate (overwrite) the state's arrays, not their copies.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


def device_copy(tree: Any, memory_stats: Callable = lambda device: device.memory_stats()
                ) -> Any | None:
  """`tree` with each of its arrays copied on the devices it lies on, or None where a device has
  no room for the copy beside its peak so far (a training step's): `room_for_copy`."""
  leaves, treedef = jax.tree.flatten(tree)
  if not room_for_copy(bytes_per_device(leaves), memory_stats):
    return None
  for at, program in copy_programs(leaves):
    for i, x in zip(at, program([leaves[i] for i in at])):
      leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


def bytes_per_device(leaves: list) -> dict[Any, int]:
  """The bytes the arrays among `leaves` (jax.Arrays or ShapeDtypeStructs with shardings; other
  leaves are passed over) hold on each of this process's devices."""
  needed: dict[Any, int] = {}
  for x in leaves:
    if isinstance(x, jax.Array):
      for shard in x.addressable_shards:
        needed[shard.device] = needed.get(shard.device, 0) + shard.data.nbytes
    elif isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
      nbytes = math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
      for device in x.sharding.addressable_devices:
        needed[device] = needed.get(device, 0) + nbytes
  return needed


def room_for_copy(needed: dict[Any, int], memory_stats: Callable, peak: int | None = None
                  ) -> bool:
  """Whether each device of `needed` (bytes per device) has room for a copy of that many bytes:
  its peak (`peak` bytes where given, a compiled step's; else its peak in use so far) and the copy
  must fit in 95% of its memory. A device without memory figures (the host's own) has none."""
  for device, nbytes in needed.items():
    stats = memory_stats(device) or {}
    if "bytes_limit" not in stats:
      return False
    held = peak if peak is not None else stats.get("peak_bytes_in_use",
                                                   stats.get("bytes_in_use", 0))
    if held + nbytes > 0.95 * stats["bytes_limit"]:
      return False
  return True


class CopyRoom:
  """The memory figures `device_copy` judges the room for a copy by, for a checkpointer that
  copies a state again at each save: once a copy has lived beside a step, a device's peak counts
  both, and the next save would find no room where the step alone left it (Mixtral's bench on an
  H200: 68.9 GiB the step and 50.1 its state's copy, of 141). Once `copied` is set, a device's
  peak before the first copy stands for the step's (or what is in use now, if more). Passed to
  `device_copy` as its `memory_stats`."""

  def __init__(self, memory_stats: Callable = lambda device: device.memory_stats()):
    self._stats = memory_stats
    self._peaks: dict[Any, int] = {}
    self.copied = False  # (set by the caller once a copy was taken)

  def __call__(self, device) -> dict | None:
    stats = self._stats(device)
    if not stats or "peak_bytes_in_use" not in stats:
      return stats
    if not self.copied or device not in self._peaks:
      self._peaks[device] = stats["peak_bytes_in_use"]
    return dict(stats, peak_bytes_in_use=max(self._peaks[device], stats.get("bytes_in_use", 0)))


def copy_programs(leaves: list) -> list[tuple[list[int], Callable[[list], list]]]:
  """For the arrays among `leaves` (jax.Arrays or ShapeDtypeStructs; other leaves are passed
  over), grouped by the devices they lie on (one program runs on one set of devices): each
  group's indices, in order, and `copy_program` for it."""
  groups: dict[frozenset, list[int]] = {}
  for i, x in enumerate(leaves):
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
      groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
  return [(at, copy_program([leaves[i] for i in at])) for at in groups.values()]


_programs: dict[tuple, Any] = {}  # (a function, a list of arrays' (shape, dtype, sharding, weak
_programs_lock = threading.Lock()  # type)s): the function compiled for such lists


def compiled_for(fn: Callable[[list], Any], arrays: list, **jit_options) -> Callable[[list], Any]:
  """`fn`, a function of a list of arrays, compiled for lists like `arrays` (jax.Arrays or
  ShapeDtypeStructs with their shardings), once per function and kind of list and kept: a
  program the loop runs at a save's step compiles beforehand, not on the step's time (0.1-0.4 s
  on a GPU host, with its queue empty). `jit_options` go to `jax.jit`; for a given `fn` they must
  follow from `arrays` (they are not part of the key)."""
  weak = lambda x: bool(getattr(x, "weak_type", False))
  key = (fn, tuple((tuple(x.shape), np.dtype(x.dtype), x.sharding, weak(x)) for x in arrays))
  with _programs_lock:
    found = _programs.get(key)
  if found is None:
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=weak(x))
                for x in arrays]
    found = jax.jit(fn, **jit_options).lower(abstract).compile()
    with _programs_lock:
      found = _programs.setdefault(key, found)
  return found


def _copies(arrays: list) -> list:
  return [jnp.copy(x) for x in arrays]


def copy_program(arrays: list) -> Callable[[list], list]:
  """The compiled program copying a list of arrays like `arrays` (jax.Arrays or
  ShapeDtypeStructs with their shardings, all on one set of devices) there, in one launch;
  compiled once per kind of list and kept. A copy compiled for each of a state's arrays when
  the first save needed them held that save (and the steps) up for 0.44 s on an H100 (a 17.4
  GiB state, 2026-12-06), so `Checkpointer.reserve_host_memory` compiles this while the train
  step compiles: the first save then returned in 9 ms."""
  return compiled_for(_copies, arrays, out_shardings=[x.sharding for x in arrays])
