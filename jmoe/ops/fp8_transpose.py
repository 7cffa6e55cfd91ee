"""Transposed and gathered operands for the FP8 weight gradient, written by a Pallas Triton kernel.

Hopper's FP8 wgmma reads both operands with the contracted axis contiguous, so the FP8 weight
gradient (jmoe/ops/fp8_mosaic.py) needs x_q and dy_q as [D, P] and [F, P], with the rows in the
group-aligned column order. XLA writes that as a gather fused with a transpose, which on one-byte
values ran at 280-310 GB/s on an H200 (15.7% of the FP8 Qwen3 step). Here a block of 128 rows x
128 columns is read row-wise (each row 128 contiguous values), turned by Triton, and written
column-wise (each output row 128 contiguous values): 1.1-2.1 TB/s.

  transpose_rows(x_RC, source_P)      [C, P]: out[:, p] = x[source_P[p]], zeros where
                                      source_P[p] is outside [0, R)
  xla_transpose_rows(x_RC, source_P)  the same through XLA's gather and transpose: the
                                      fallback, and the reference the checks hold it to

One-byte values move as their bytes (Triton's lowering makes no float8 constants, and float8
zero is byte 0), so the result is x's values bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 128  # rows and columns of one program's tile
# Pallas' Triton lowering addresses an array of up to 2^32 bytes with 32-bit offsets, which
# Triton takes as signed: elements past 2^31 would be read or written at negative offsets.
# Larger operands take XLA's gather and transpose (correct, slower).
MAX_ELEMENTS = 2**31 - 1


def transpose_rows(x_RC: jax.Array, source_P: jax.Array, *, block: int = BLOCK,
                   num_warps: int = 4, interpret: bool | None = None) -> jax.Array:
  """[C, P]: column p is row source_P[p] of x, a zero column where that is outside [0, R).
  `interpret` (default: on hosts without a GPU) runs the kernel through Pallas' interpreter."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  rows, cols = x_RC.shape
  width = source_P.shape[0]
  if not rows * cols * width or max(rows * cols, cols * width) > MAX_ELEMENTS:
    return xla_transpose_rows(x_RC, source_P)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  dtype = x_RC.dtype
  as_bytes = jnp.dtype(dtype).itemsize == 1
  if as_bytes:
    x_RC = jax.lax.bitcast_convert_type(x_RC, jnp.uint8)

  def kernel(source_ref, x_ref, out_ref):
    p_B = pl.program_id(0) * block + jnp.arange(block)
    c_B = pl.program_id(1) * block + jnp.arange(block)
    in_width_B = p_B < width
    row_B = plgpu.load(source_ref.at[jnp.where(in_width_B, p_B, 0)])
    valid_B = in_width_B & (row_B >= 0) & (row_B < rows)
    row_B = jnp.where(valid_B, row_B, 0)  # gap columns read row 0, then write zeros
    c_mask_B = c_B < cols
    tile = plgpu.load(x_ref.at[row_B[:, None], jnp.where(c_mask_B, c_B, 0)[None, :]])
    tile = jnp.where(valid_B[:, None], tile, jnp.zeros((), tile.dtype))
    plgpu.store(out_ref.at[c_B[:, None], p_B[None, :]], tile.T,
                mask=c_mask_B[:, None] & in_width_B[None, :])

  call = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((cols, width), x_RC.dtype),
      grid=(pl.cdiv(width, block), pl.cdiv(cols, block)),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps), interpret=interpret,
      name="jmoe_transpose_rows")
  out_CP = call(source_P.astype(jnp.int32), x_RC)
  return jax.lax.bitcast_convert_type(out_CP, dtype) if as_bytes else out_CP


def xla_transpose_rows(x_RC: jax.Array, source_P: jax.Array) -> jax.Array:
  """`transpose_rows` through XLA: a gather (zeros outside [0, R)) and a transpose."""
  valid_P = (source_P >= 0) & (source_P < x_RC.shape[0])
  return jnp.take(x_RC, jnp.where(valid_P, source_P, x_RC.shape[0]), axis=0, mode="fill",
                  fill_value=0).T
