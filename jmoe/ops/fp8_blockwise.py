"""Blockwise FP8 scaling as DeepSeek-V3 trained (`precision.fp8_recipe = "blockwise"`).

Activations and gradients get one float32 scale per 1 x 128 tile (a row's 128 consecutive values
along the contracted axis), weights one per 128 x 128 tile. A tile's scale maps its amax onto the
format's largest value, so one outlier costs precision only within its tile.

Because these scales vary along the contracted axis K, they cannot be applied to a GEMM's output:
a kernel must scale each 128-deep K slice's partial sum before adding it (block_k = 128, a
multiply of the accumulator per K step). A backend whose kernels do that (`BlockwiseKernels`:
moe.gemm=mosaic, jmoe/ops/fp8_mosaic.py) runs the forward and input-gradient GEMMs on the float8
operands and their scales, and the weight gradient in its 16-bit kernel on the dequantized
operands. Other backends compute the recipe's numerics in XLA: the operands are quantized
blockwise, dequantized to the compute dtype and multiplied by the backend's 16-bit grouped GEMM
(the values each GEMM multiplies are the recipe's up to one bf16 rounding of each, 2^-9
relative: a float8 value has 4 significant bits, its tile's scale 24; the speed is bf16's, not
FP8's). Differences from DeepSeek-V3's recipe, either way: the weight gradient reuses the
forward's 1 x 128 quantized activations and the input gradient's 1 x 128 quantized output
gradient (DeepSeek-V3 requantizes both along the rows, 128 x 1, for that GEMM) and multiplies
them in 16 bits. The dense GEMMs keep per-tensor current scaling under this recipe (XLA's FP8
GEMM takes one scale per operand).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jmoe.ops.fp8 import E4M3, FORMATS, amax, quantize, scale_for
from jmoe.ops.fp8_grouped import RaggedDot, _varying_like, at_this_layer
from jmoe.ops.rows import row_groups

BLOCK = 128


def _tiles(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, tuple[int, ...]]:
  """x zero-padded to whole tiles on `axes` and reshaped so that each of those axes splits into
  (tiles, BLOCK); also the tile axes' positions."""
  pad = [(0, -x.shape[a] % BLOCK if a in axes else 0) for a in range(x.ndim)]
  x = jnp.pad(x, pad)
  shape, tile_axes = [], []
  for a, size in enumerate(x.shape):
    if a in axes:
      tile_axes.append(len(shape))
      shape += [size // BLOCK, BLOCK]
    else:
      shape.append(size)
  return x.reshape(shape), tuple(tile_axes)


def quantize_blocks(x: jax.Array, axes: tuple[int, ...], dtype=E4M3,
                    scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(x_q, scale): x in float8 with one float32 scale per tile that is 128 long on each of `axes`
  (negative axes count from the end) and 1 on the others; scale has x's shape with each of those
  axes divided by 128 (rounded up: a partial tile at the end is a tile). `scale`: the tiles'
  scales as this returns them, to quantize with (from the tiles' amaxes if not given)."""
  axes = tuple(sorted(a % x.ndim for a in axes))
  tiled, tile_axes = _tiles(x, axes)
  within = tuple(a + 1 for a in tile_axes)
  scale = jnp.expand_dims(_tile_scales(tiled, tile_axes, dtype) if scale is None else scale,
                          within)
  x_q = quantize(tiled, scale, dtype).reshape(
      tuple(-(-x.shape[a] // BLOCK) * BLOCK if a in axes else x.shape[a] for a in range(x.ndim)))
  return x_q[tuple(slice(0, n) for n in x.shape)], jnp.squeeze(scale, within)


def block_scales(x: jax.Array, axes: tuple[int, ...], dtype=E4M3) -> jax.Array:
  """The tiles' scales `quantize_blocks` quantizes x with (from each tile's amax)."""
  axes = tuple(sorted(a % x.ndim for a in axes))
  return _tile_scales(*_tiles(x, axes), dtype)


def _tile_scales(tiled: jax.Array, tile_axes: tuple[int, ...], dtype) -> jax.Array:
  """Each tile's scale from its amax, for x as `_tiles` splits it."""
  return scale_for(amax(tiled, axis=tuple(a + 1 for a in tile_axes)), dtype)


def dequantize_blocks(x_q: jax.Array, scale: jax.Array, axes: tuple[int, ...],
                      dtype=jnp.float32) -> jax.Array:
  """x_q x its tile's scale, in `dtype` (the inverse of `quantize_blocks` up to the rounding)."""
  axes = tuple(sorted(a % x_q.ndim for a in axes))
  tiled, tile_axes = _tiles(x_q.astype(jnp.float32), axes)
  scale = jnp.expand_dims(scale, tuple(a + 1 for a in tile_axes))
  out = (tiled * scale).reshape(
      tuple(-(-x_q.shape[a] // BLOCK) * BLOCK if a in axes else x_q.shape[a]
            for a in range(x_q.ndim)))
  return out[tuple(slice(0, n) for n in x_q.shape)].astype(dtype)


def blockwise_round_trip(x: jax.Array, axes: tuple[int, ...], dtype=E4M3) -> jax.Array:
  """x through blockwise float8 and back, in x's dtype."""
  return dequantize_blocks(*quantize_blocks(x, axes, dtype), axes, x.dtype)


@dataclasses.dataclass(frozen=True)
class BlockwiseKernels:
  """A backend's kernels for blockwise-scaled operands. `dot(a_q [X, K], a_scale [X, K/128],
  b_q [E, N, K], b_scale [E, N/128, K/128], group_sizes_E)` -> [X, N] in bf16: each expert's
  rows times its b (both K-major), every 128-deep K slice's products scaled by its row's and
  its tile's scales; rows past the groups may be left unwritten. `contract16`: the backend's
  16-bit weight-gradient contraction (x_XD, y_XF, group_sizes_E) -> [E, D, F]."""
  dot: Callable[..., jax.Array]
  contract16: RaggedDot


def blockwise_grouped(gemm, grad_format: str = "e5m2", kernels: BlockwiseKernels | None = None):
  """The grouped GEMM `gemm` (x_XD, w_EDF, group_sizes_E) -> y_XF on blockwise-quantized
  operands: x in 1 x 128 tiles along D, w in 128 x 128 tiles of each expert's [D, F], the output
  gradient in 1 x 128 tiles along F (in `grad_format`). Zeros past the groups, as `gemm`. With
  `kernels`, the forward and input gradient run on the float8 operands in those kernels.
  `quantized`: x's tiles as `quantize_row_blocks` makes them, made before x's rows were gathered
  (as in `jmoe.ops.fp8_grouped.grouped_fp8`)."""
  grad_dtype = FORMATS[grad_format]

  @jax.custom_vjp
  def grouped(x_XD, w_EDF, group_sizes_E, quantized):
    return _fwd(x_XD, w_EDF, group_sizes_E, quantized)[0]

  def _fwd(x_XD, w_EDF, group_sizes_E, quantized):
    x_q, x_scale = quantize_row_blocks(x_XD) if quantized is None else quantized
    w_scale, x_scale = at_this_layer(block_scales(w_EDF, (1, 2)), x_scale)
    w_q, _ = quantize_blocks(w_EDF, (1, 2), scale=w_scale)
    if kernels is None:
      y = gemm(dequantize_blocks(x_q, x_scale, (1,), x_XD.dtype),
               dequantize_blocks(w_q, w_scale, (1, 2), x_XD.dtype), group_sizes_E)
    else:
      y = _in_groups(kernels.dot(x_q, x_scale, jnp.swapaxes(w_q, 1, 2),
                                 jnp.swapaxes(w_scale, 1, 2), group_sizes_E),
                     group_sizes_E).astype(x_XD.dtype)
    # The weights' tile scales are kept, not their float8 copy (one more weight-sized buffer
    # per layer): the backward pass quantizes the weights again with them.
    return y, (x_q, x_scale, w_EDF, w_scale, group_sizes_E)

  def _bwd(residuals, dy_XF):
    x_q, x_scale, w_EDF, w_scale, group_sizes_E = residuals
    # The scales tied to dy, which only the backward pass has, so that XLA neither merges the
    # dequantized operands with the forward's identical ones nor makes them early: either way
    # every layer's would be held from the forward pass to the backward (as in
    # jmoe/ops/fp8_grouped.py).
    (x_scale, w_scale), dy_XF = jax.lax.optimization_barrier(((x_scale, w_scale), dy_XF))
    dtype = dy_XF.dtype
    x_XD = dequantize_blocks(x_q, x_scale, (1,), dtype)
    w_q = quantize_blocks(w_EDF, (1, 2), scale=w_scale)[0]
    if kernels is None:
      w_deq = dequantize_blocks(w_q, w_scale, (1, 2), dtype)
      dy_XF = blockwise_round_trip(dy_XF, (1,), grad_dtype)
      _, vjp = jax.vjp(lambda x, w: gemm(x, w, group_sizes_E), x_XD, w_deq)
      dx_XD, dw_EDF = vjp(dy_XF)
      return dx_XD, dw_EDF.astype(w_EDF.dtype), None, None
    dy_q, dy_scale = quantize_blocks(_in_groups(dy_XF, group_sizes_E), (1,), grad_dtype)
    dx_XD = _in_groups(kernels.dot(dy_q, dy_scale, w_q, w_scale, group_sizes_E), group_sizes_E)
    dw_EDF = kernels.contract16(x_XD, dequantize_blocks(dy_q, dy_scale, (1,), dtype),
                                group_sizes_E)
    dw_EDF = jnp.where((group_sizes_E > 0)[:, None, None], dw_EDF, 0)  # no rows: no gradient
    return dx_XD.astype(dtype), dw_EDF.astype(w_EDF.dtype), None, None

  grouped.defvjp(_fwd, _bwd)
  return lambda x_XD, w_EDF, group_sizes_E, quantized=None: grouped(
      x_XD, _varying_like(w_EDF, x_XD), group_sizes_E, quantized)


def quantize_row_blocks(x_XD: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(x_q, scale_XB): x in E4M3 in 1 x 128 tiles along its rows, as `blockwise_grouped`
  quantizes its input."""
  return quantize_blocks(x_XD, (1,))


def _in_groups(y_XN: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
  """y with the rows past the groups set to zero (a kernel may leave them unwritten)."""
  in_groups_X1 = (row_groups(group_sizes_E, y_XN.shape[0]) < group_sizes_E.shape[0])[:, None]
  return jnp.where(in_groups_X1, y_XN, jnp.zeros((), y_XN.dtype))
