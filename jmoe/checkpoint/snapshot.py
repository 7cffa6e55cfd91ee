"""Copies of a train state on its own devices, which let training go on while a save takes
them to the host: the next step may donate (overwrite) the state's arrays, not their copies.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.checkpoint import pinned


def device_copy(tree: Any, memory_stats: Callable = lambda device: device.memory_stats(), *,
                whole: bool = False) -> Any | None:
  """`tree` with each of its arrays copied on the devices it lies on, as far as they have room
  for the copies beside their peak so far (a training step's): `copy_split`. The arrays whose
  copies do not fit are put in page-locked host memory by the same program, so that the next
  step, which may overwrite them, waits only for that part of the state to reach the host. None
  where no copy fits, or some do not and the devices have no page-locked host memory (or
  `whole`: a copy of every array on the devices is wanted)."""
  leaves, treedef = jax.tree.flatten(tree)
  to_host = copy_split(leaves, memory_stats)
  if to_host is None or (whole and to_host):
    return None
  for at, program in copy_programs(leaves, to_host):
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


def room_left(devices: Iterable, memory_stats: Callable, peak: int | None = None
              ) -> dict[Any, float]:
  """The bytes each of `devices` has room for beside its peak (`peak` bytes where given, a
  compiled step's; else its peak in use so far) within 95% of its memory; 0 for a device without
  memory figures (the host's own)."""
  left = {}
  for device in devices:
    stats = memory_stats(device) or {}
    if "bytes_limit" not in stats:
      left[device] = 0
      continue
    held = peak if peak is not None else stats.get("peak_bytes_in_use",
                                                   stats.get("bytes_in_use", 0))
    left[device] = 0.95 * stats["bytes_limit"] - held
  return left


def copy_split(leaves: list, memory_stats: Callable, peak: int | None = None
               ) -> frozenset[int] | None:
  """Which of the arrays among `leaves` (jax.Arrays, or ShapeDtypeStructs with shardings) a
  save's copy puts in page-locked host memory rather than on their devices: the indices of those
  whose copies do not fit in `room_left` (each array taken in order, and copied on the devices
  where it fits beside those copied before it). An empty set: every copy fits; None: none
  fits, or some do not and the devices have no page-locked host memory to put them in."""
  arrays = [i for i, x in enumerate(leaves) if pinned.placed(x)]
  sizes = {i: bytes_per_device([leaves[i]]) for i in arrays}
  left = room_left({d for i in arrays for d in sizes[i]}, memory_stats, peak)
  to_host = set()
  for i in arrays:
    if all(nbytes <= left[device] for device, nbytes in sizes[i].items()):
      for device, nbytes in sizes[i].items():
        left[device] -= nbytes
    else:
      to_host.add(i)
  if to_host and (len(to_host) == len(arrays) or
                  not pinned.has_pinned_host([leaves[i] for i in arrays])):
    return None
  return frozenset(to_host)


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


def copy_programs(leaves: list, to_host: frozenset[int] = frozenset()
                  ) -> list[tuple[list[int], Callable[[list], list]]]:
  """For the arrays among `leaves` (jax.Arrays or ShapeDtypeStructs; other leaves are passed
  over), grouped by the devices they lie on (one program runs on one set of devices): each
  group's indices, in order, and `copy_program` for it, putting the arrays whose indices are in
  `to_host` in page-locked host memory (`copy_split`)."""
  groups: dict[frozenset, list[int]] = {}
  for i, x in enumerate(leaves):
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
      groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
  return [(at, copy_program([leaves[i] for i in at], [i in to_host for i in at]))
          for at in groups.values()]


_programs: dict[tuple, Any] = {}  # (a function, a list of arrays' (shape, dtype, sharding, weak
_programs_lock = threading.Lock()  # type)s, the outputs' shardings): the function compiled


def compiled_for(fn: Callable[[list], Any], arrays: list, out_shardings: list | None = None
                 ) -> Callable[[list], Any]:
  """`fn`, a function of a list of arrays, compiled for lists like `arrays` (jax.Arrays or
  ShapeDtypeStructs with their shardings), with `out_shardings` for its outputs where given
  (else XLA's choice), once per function, kind of list and outputs' shardings, and kept: a
  program the loop runs at a save's step compiles beforehand, not on the step's time (0.1-0.4 s
  on a GPU host, with its queue empty)."""
  weak = lambda x: bool(getattr(x, "weak_type", False))
  key = (fn, tuple((tuple(x.shape), np.dtype(x.dtype), x.sharding, weak(x)) for x in arrays),
         None if out_shardings is None else tuple(out_shardings))
  with _programs_lock:
    found = _programs.get(key)
  if found is None:
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=weak(x))
                for x in arrays]
    options = {} if out_shardings is None else dict(out_shardings=list(out_shardings))
    found = jax.jit(fn, **options).lower(abstract).compile()
    with _programs_lock:
      found = _programs.setdefault(key, found)
  return found


def _copies(arrays: list) -> list:
  return [jnp.copy(x) for x in arrays]


def copy_program(arrays: list, to_host: list[bool] | None = None) -> Callable[[list], list]:
  """The compiled program copying a list of arrays like `arrays` (jax.Arrays or
  ShapeDtypeStructs with their shardings, all on one set of devices) there, or to page-locked
  host memory where `to_host` says so, in one launch; compiled once per kind of list and kept.
  A copy compiled for each of a state's arrays when the first save needed them held that save
  (and the steps) up for 0.44 s on an H100 (a 17.4 GiB state, 2026-12-06), so
  `Checkpointer.reserve_host_memory` compiles this while the train step compiles: the first
  save then returned in 9 ms."""
  to_host = to_host or [False] * len(arrays)
  return compiled_for(_copies, arrays, [
      x.sharding.with_memory_kind(pinned.PINNED) if host else x.sharding
      for x, host in zip(arrays, to_host)])
