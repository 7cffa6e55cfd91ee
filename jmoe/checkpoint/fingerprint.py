"""A fingerprint of a model's values: what a LoRA run's checkpoints record of the frozen model
under their adapters, so that a resume, an export or a reader of the workdir can tell the same
weights (on any layout, placed on devices or read from files a region at a time) from others."""

from __future__ import annotations

import hashlib
import itertools
import math
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jmoe.checkpoint.streamed import FoldedArray, StoredArray, raise_everywhere, unreadable
from jmoe.config import ConfigError


def fingerprint(variables: nnx.State | dict) -> str:
  """A digest of the values of `variables` (a State, or its pure dict), bit for bit, that does
  not depend on how they are sharded: per array, two 32-bit sums of its elements' bits mixed with
  their positions (integer sums, whose order does not matter), hashed with the arrays' names,
  dtypes and shapes. Opened arrays (`StoredArray`, `FoldedArray`) are read a region at a time,
  and their regions' sums added up."""
  tree = nnx.to_pure_dict(variables) if isinstance(variables, nnx.State) else variables
  named = [(jax.tree_util.keystr(path, simple=True, separator="/"), x)
           for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
  opened = [(name, x) for name, x in named if hasattr(x, "read")]
  sums = (iter(_opened_sums(opened) if opened else []),
          iter(jax.device_get(_bit_sums([x for _, x in named if not hasattr(x, "read")]))))
  digest = hashlib.sha256()
  for name, x in named:
    a, b = next(sums[0] if hasattr(x, "read") else sums[1])
    digest.update(f"{name} {np.dtype(x.dtype).name}{list(x.shape)} {int(a)} {int(b)};".encode())
  return digest.hexdigest()[:16]


FINGERPRINT_BYTES = 1 << 28  # the most bytes of an opened array read at once to fingerprint it


def _opened_sums(arrays: list[tuple[str, StoredArray | FoldedArray]]) -> list[tuple[int, int]]:
  """`_bit_sums` of opened arrays (name, array), each read a region at a time; with several
  processes, each reads its share of the arrays and they exchange the sums."""
  index, count = jax.process_index(), jax.process_count()
  sums, error = np.zeros((len(arrays), 2), np.uint32), None
  try:
    for i, (name, stored) in enumerate(arrays):
      if i % count == index:
        sums[i] = _stored_sums(name, stored)
  except Exception as e:  # noqa: BLE001 - raised below, once every process knows
    error = e
  raise_everywhere(error)
  if count > 1:  # (each array's sums come from one process; the others gave zeros)
    sums = np.asarray(multihost_utils.process_allgather(sums)).astype(np.uint64).sum(0)
  return [(int(a) % 2**32, int(b) % 2**32) for a, b in sums]


def _stored_sums(name: str, stored: StoredArray | FoldedArray) -> tuple[int, int]:
  """`_bit_sums` of an opened array, its regions read one at a time."""
  a = b = 0
  for region in _regions(stored.shape, np.dtype(stored.dtype).itemsize, FINGERPRINT_BYTES):
    try:
      values = stored.read(region)
    except ConfigError:
      raise
    except Exception as e:  # noqa: BLE001 - tensorstore's errors for a damaged chunk
      raise unreadable(stored, name, region, e) from None
    starts = np.array([r.start for r in region] + [0] * (len(stored.shape) - len(region)),
                      np.uint32)
    part_a, part_b = jax.device_get(_region_sums(values, starts, tuple(stored.shape)))
    a, b = (a + int(part_a)) % 2**32, (b + int(part_b)) % 2**32
  return a, b


def _regions(shape: tuple[int, ...], itemsize: int, limit: int) -> Iterator[tuple[slice, ...]]:
  """Regions (a slice per leading axis) that cover an array of `shape` in order, each within
  `limit` bytes where one element of the innermost axis they split allows."""
  axis = next((k for k in range(len(shape)) if math.prod(shape[k:]) * itemsize <= limit),
              len(shape))  # the outermost axis whose whole rows fit; axes before it one by one
  if axis == 0:
    yield ()
    return
  split = axis - 1
  rows = max(1, limit // (math.prod(shape[axis:]) * itemsize))
  for index in itertools.product(*map(range, shape[:split])):
    for start in range(0, shape[split], rows):
      yield (tuple(slice(i, i + 1) for i in index)
             + (slice(start, min(start + rows, shape[split])),))


def _mix(v_N: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finalizer: every input bit reaches every output bit."""
  v_N = (v_N ^ (v_N >> 16)) * jnp.uint32(0x85EBCA6B)
  v_N = (v_N ^ (v_N >> 13)) * jnp.uint32(0xC2B2AE35)
  return v_N ^ (v_N >> 16)


def _sums(x: jax.Array, starts: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The two sums of `x`, the region of an array of `shape` that begins at `starts`."""
  x = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
  unsigned = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
  bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)  # 8 bytes: [..., 2]
  if bits.ndim > x.ndim:
    starts, shape = jnp.append(starts, jnp.uint32(0)), tuple(shape) + (2,)
  index, stride = jnp.zeros(bits.shape, jnp.uint32), 1  # the element's position, mod 2^32
  for axis in reversed(range(bits.ndim)):
    position = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) + starts[axis]
    index += position * jnp.uint32(stride % 2**32)
    stride *= shape[axis]
  mixed = _mix(bits ^ _mix(index ^ jnp.uint32(0x9E3779B9)))
  return jnp.stack([jnp.sum(mixed, dtype=jnp.uint32),
                    jnp.sum(_mix(mixed ^ jnp.uint32(0x27D4EB2F)), dtype=jnp.uint32)])


@jax.jit
def _bit_sums(arrays: list[jax.Array]) -> list[jax.Array]:
  return [_sums(x, jnp.zeros(x.ndim, jnp.uint32), x.shape) for x in arrays]


_region_sums = jax.jit(_sums, static_argnums=2)
