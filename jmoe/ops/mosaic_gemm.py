"""The grouped GEMM on NVIDIA Hopper: JAX's own Pallas Mosaic-GPU kernels, under one custom VJP.

  forward          y_XF = x_XD . w_EDF[e]     `ragged_dot_mgpu.ragged_dot`
  input gradient   dx_XD = dy_XF . w_EDF[e]^T  the same kernel, reading w transposed in the tile
                                               loads (no transposed copy of the weights)
  weight gradient  dw_EDF[e] = x_e^T . dy_e    `transposed_ragged_dot_mgpu.transposed_ragged_dot`

Each call takes a tile config (blocks, pipeline depth, grid swizzle) for its shape from
`mosaic_tiles.json` beside this file, written by `scripts/tune_gemm.py` on the GPU; a shape the
table lacks gets a default that satisfies the kernels' requirements. What the kernels require is
met here: the contraction a multiple of block_k and the output width a multiple of block_n, the
rows a multiple of 8 (else zero padding), 16-bit operands (else XLA's ragged dot). What they leave
unwritten is set to zero: output and input-gradient rows past the groups, the weight gradient of
an expert with no rows.
scripts/check_gpu.py holds all three against a float32 reference, expert by expert.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib
from typing import Callable

import jax
import jax.numpy as jnp

log = logging.getLogger("jmoe")

TILES_FILE = pathlib.Path(__file__).with_name("mosaic_tiles.json")
KINDS = ("fwd", "dlhs", "drhs")


@dataclasses.dataclass(frozen=True)
class Tiles:
  """One kernel call's tile config. For `fwd` and `dlhs` (ragged_dot): block_m rows of x per tile,
  block_n output columns, block_k of the contraction per pipeline step, `steps` steps in flight,
  `grid_block_n` tiles along N per swizzle band. For `drhs` (transposed_ragged_dot): block_m of D,
  block_n of F, block_k rows per step."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  steps: int = 4
  grid_block_n: int = 1

  def fits(self, kind: str, k: int, n: int) -> bool:
    """Whether the kernel takes this config for contraction `k` and output width `n` (for drhs:
    D and F)."""
    if kind == "drhs":
      return k % self.block_m == 0 and n % self.block_n == 0
    return k % self.block_k == 0 and n % (self.block_n * self.grid_block_n) == 0


def shape_key(kind: str, k: int, n: int) -> str:
  return f"{kind}:{k}x{n}"


@functools.cache
def _table() -> dict[str, Tiles]:
  if not TILES_FILE.is_file():
    return {}
  entries = json.loads(TILES_FILE.read_text())["tiles"]
  return {key: Tiles(**value) for key, value in entries.items()}


def default_tiles(kind: str, k: int, n: int) -> Tiles | None:
  """A config the kernel takes for this shape, from the shapes of the tuning sweeps (None: no
  block size divides it; the caller pads)."""
  if kind == "drhs":
    for block_m in (128, 64):
      for block_n in (128, 64):
        t = Tiles(block_m=block_m, block_n=block_n, block_k=64, steps=4)
        if t.fits(kind, k, n):
          return t
    return None
  for block_n in (256, 192, 128, 64):
    for grid_block_n in (4, 2, 1):
      t = Tiles(block_m=128 if block_n < 256 else 64, block_n=block_n, block_k=64, steps=4,
                grid_block_n=grid_block_n)
      if t.fits(kind, k, n):
        return t
  return None


def tiles_for(kind: str, k: int, n: int) -> Tiles | None:
  """The tuned config for this shape, else the default."""
  tuned = _table().get(shape_key(kind, k, n))
  return tuned if tuned is not None and tuned.fits(kind, k, n) else default_tiles(kind, k, n)


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def _pad_axis(a: jax.Array, axis: int, size: int) -> jax.Array:
  if a.shape[axis] == size:
    return a
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, size - a.shape[axis])
  return jnp.pad(a, widths)


def one_call_per_batch(kernel: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """`kernel` (array arguments only) where vmap cannot batch it: the Mosaic kernels read their
  group sizes as a list of scalars, which a batched ref is not. Under vmap (pipeline stages run
  their layers vmapped over the stage axis, where each device holds one stage) the kernel runs
  once per batch element: directly for a batch of one, else in a loop."""

  @jax.custom_batching.custom_vmap
  def call(*args):
    return kernel(*args)

  @call.def_vmap
  def _batched(axis_size, in_batched, *args):
    args = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, batched in zip(args, in_batched)]
    if axis_size == 1:
      return call(*(a[0] for a in args))[None], True
    return jax.lax.map(lambda one: call(*one), tuple(args)), True

  return call


def ragged(x_XK: jax.Array, w: jax.Array, group_sizes_E: jax.Array, transpose_rhs: bool,
           tiles: Tiles | None = None) -> jax.Array:
  """x_XK . w[e] per group (w is [E, K, N], or [E, N, K] with `transpose_rhs`), [X, N]. The rows
  past the groups are left unwritten by the kernel."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
  k = x_XK.shape[1]
  n = w.shape[1] if transpose_rhs else w.shape[2]
  tiles = tiles or tiles_for("dlhs" if transpose_rhs else "fwd", k, n)
  if tiles is None:  # pad the contraction and the output width to what the blocks take
    k_pad, n_pad = _round_up(k, 64), _round_up(n, 64)
    x_XK = _pad_axis(x_XK, 1, k_pad)
    w = _pad_axis(_pad_axis(w, 2 if transpose_rhs else 1, k_pad), 1 if transpose_rhs else 2,
                  n_pad)
    return ragged(x_XK, w, group_sizes_E, transpose_rhs)[:, :n]
  kernel = functools.partial(
      ragged_dot_mgpu.ragged_dot, block_m=tiles.block_m, block_n=tiles.block_n,
      block_k=tiles.block_k, max_concurrent_steps=tiles.steps, grid_block_n=tiles.grid_block_n,
      transpose_rhs=transpose_rhs)
  return one_call_per_batch(lambda x, w, sizes: kernel(x, w, group_sizes=sizes))(
      x_XK, w, group_sizes_E)


def ragged_contract(x_XD: jax.Array, y_XF: jax.Array, group_sizes_E: jax.Array,
                    tiles: Tiles | None = None) -> jax.Array:
  """Sum over each group's rows of x^T y, [E, D, F] (an expert with no rows: unwritten)."""
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
  d, f = x_XD.shape[1], y_XF.shape[1]
  tiles = tiles or tiles_for("drhs", d, f)
  if tiles is None:
    d_pad, f_pad = _round_up(d, 64), _round_up(f, 64)
    out = ragged_contract(_pad_axis(x_XD, 1, d_pad), _pad_axis(y_XF, 1, f_pad), group_sizes_E)
    return out[:, :d, :f]
  kernel = functools.partial(
      transposed_ragged_dot_mgpu.transposed_ragged_dot, block_m=tiles.block_m,
      block_n=tiles.block_n, block_k=tiles.block_k, max_concurrent_steps=tiles.steps,
      grid_block_n=tiles.grid_block_n)
  return one_call_per_batch(lambda x, y, sizes: kernel(x, y, group_sizes=sizes))(
      x_XD, y_XF, group_sizes_E)


ROW_MULTIPLE = 8  # the kernels tile rows by 8


def _rows_in_groups(y, group_sizes_E):
  in_groups_X1 = (jnp.arange(y.shape[0]) < jnp.sum(group_sizes_E))[:, None]
  return jnp.where(in_groups_X1, y, jnp.zeros((), y.dtype))


@jax.custom_vjp
def _mosaic(x_XD, w_EDF, group_sizes_E):
  return _rows_in_groups(ragged(x_XD, w_EDF, group_sizes_E, False), group_sizes_E)


def _mosaic_fwd(x_XD, w_EDF, group_sizes_E):
  return _mosaic(x_XD, w_EDF, group_sizes_E), (x_XD, w_EDF, group_sizes_E)


def _mosaic_bwd(residuals, dy_XF):
  x_XD, w_EDF, group_sizes_E = residuals
  dy_XF = _rows_in_groups(dy_XF, group_sizes_E)
  dx_XD = _rows_in_groups(ragged(dy_XF, w_EDF, group_sizes_E, True), group_sizes_E)
  dw_EDF = ragged_contract(x_XD, dy_XF, group_sizes_E)
  dw_EDF = jnp.where((group_sizes_E > 0)[:, None, None], dw_EDF, jnp.zeros((), dw_EDF.dtype))
  return dx_XD, dw_EDF.astype(w_EDF.dtype), None


_mosaic.defvjp(_mosaic_fwd, _mosaic_bwd)


@functools.cache
def _not_16bit(dtype) -> None:
  log.warning("moe.gemm=mosaic takes bf16/fp16 operands; %s ones run through XLA's ragged_dot",
              dtype)


def mosaic_grouped_gemm(x_XD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array
                        ) -> jax.Array:
  """The grouped GEMM through the Mosaic-GPU kernels (16-bit operands; others through XLA)."""
  if x_XD.dtype not in (jnp.bfloat16, jnp.float16) or w_EDF.dtype != x_XD.dtype:
    _not_16bit(jnp.dtype(x_XD.dtype).name)
    return jax.lax.ragged_dot(x_XD, w_EDF, group_sizes_E)
  rows = x_XD.shape[0]
  padded = _pad_axis(x_XD, 0, _round_up(rows, ROW_MULTIPLE))  # extra rows: past the groups
  return _mosaic(padded, w_EDF, group_sizes_E.astype(jnp.int32))[:rows]


def on_hopper() -> bool:
  """Whether the default device is an NVIDIA GPU of compute capability 9.x (the kernels use
  Hopper's wgmma and tensor-copy instructions)."""
  if jax.default_backend() != "gpu":
    return False
  capability = str(getattr(jax.devices()[0], "compute_capability", ""))
  return capability.startswith("9")
