"""Transposed (and gathered) float8 operands, written by a Pallas Triton kernel.

Hopper's FP8 wgmma reads both operands with the contracted axis contiguous, so the FP8 grouped
GEMMs (jmoe/ops/fp8_mosaic.py) need transposed copies: the weights [E, D, F] as [E, F, D] for the
forward, and for the weight gradient x and dy as [D, P] and [F, P] with the rows in the
group-aligned column order. XLA writes these as a fusion of a convert or a gather with a
transpose, which on one-byte values ran far below the memory rate (the gathers alone took 15.7%
of the FP8 Qwen3 step). Here a block of 128 rows x 128 columns is read row-wise (each row 128
contiguous values), turned in registers and shared memory by Triton, and written column-wise
(each output row 128 contiguous values), so both sides move whole cache lines.

  transpose_rows(x_RC, source_P, scale)  [C, P]: out[:, p] = x[source_P[p]] / scale in the
                                          output dtype (saturating), zeros where source_P[p]
                                          is past the rows; source_P None: the rows in order

The quantization matches jmoe.ops.fp8.quantize bit for bit (float32 divide, clip, round to
nearest even). Runs batched under `jax.vmap` (the weights, one expert per batch entry).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BLOCK = 128  # rows and columns of one program's tile


def transpose_rows(x_RC: jax.Array, source_P: jax.Array | None = None,
                   scale: jax.Array | None = None, out_dtype=None, *, block: int = BLOCK,
                   num_warps: int = 4, interpret: bool | None = None) -> jax.Array:
  """[C, P]: column p is row source_P[p] of x (a zero column where source_P[p] >= R), or row p
  when source_P is None (P = R); divided by `scale` (a float32 scalar or shape-[1] array) and
  rounded to `out_dtype`, saturating at its largest value, when a scale is given. `interpret`
  (default: on hosts without a GPU) runs the kernel through Pallas' interpreter, as tests do."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  rows, cols = x_RC.shape
  out_dtype = jnp.dtype(out_dtype or x_RC.dtype)
  gather = source_P is not None
  width = source_P.shape[0] if gather else rows
  limit = float(jnp.finfo(out_dtype).max) if jnp.issubdtype(out_dtype, jnp.floating) else None
  scale_1 = jnp.reshape(jnp.asarray(1.0 if scale is None else scale, jnp.float32), (1,))
  if not gather:
    source_P = jnp.zeros((1,), jnp.int32)  # unread
  # Triton's lowering makes no float8 constants (the zeros of the gaps): an unscaled float8
  # operand moves as its bytes (float8 zero is byte 0), and a scaled one is zeroed in float32.
  as_bytes = scale is None and jnp.dtype(x_RC.dtype).itemsize == 1 and out_dtype == x_RC.dtype
  if as_bytes:
    x_RC, kernel_dtype = jax.lax.bitcast_convert_type(x_RC, jnp.uint8), jnp.uint8
  else:
    kernel_dtype = out_dtype

  def kernel(source_ref, scale_ref, x_ref, out_ref):
    p_B = pl.program_id(0) * block + jnp.arange(block)
    c_B = pl.program_id(1) * block + jnp.arange(block)
    in_width_B = p_B < width
    if gather:
      row_B = plgpu.load(source_ref.at[jnp.where(in_width_B, p_B, 0)])
    else:
      row_B = p_B
    valid_B = in_width_B & (row_B < rows)
    row_B = jnp.where(valid_B, row_B, 0)  # gap columns read row 0, then write zeros
    c_mask_B = c_B < cols
    tile = plgpu.load(x_ref.at[row_B[:, None], jnp.where(c_mask_B, c_B, 0)[None, :]])
    if scale is not None:
      tile = tile.astype(jnp.float32) / scale_ref[0]
      if limit is not None:
        tile = jnp.clip(tile, -limit, limit)
    tile = jnp.where(valid_B[:, None], tile, jnp.zeros((), tile.dtype)).astype(kernel_dtype)
    plgpu.store(out_ref.at[c_B[:, None], p_B[None, :]], tile.T,
                mask=c_mask_B[:, None] & in_width_B[None, :])

  call = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((cols, width), kernel_dtype),
      grid=(pl.cdiv(width, block), pl.cdiv(cols, block)),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps), interpret=interpret,
      name="jmoe_transpose_rows")
  out_CP = call(source_P.astype(jnp.int32), scale_1, x_RC)
  return jax.lax.bitcast_convert_type(out_CP, out_dtype) if as_bytes else out_CP


def transpose_experts(w_EDF: jax.Array, scale_E: jax.Array, out_dtype, **kwargs) -> jax.Array:
  """[E, F, D]: each expert's weights quantized with its own scale and transposed."""
  one = functools.partial(transpose_rows, out_dtype=out_dtype, **kwargs)
  return jax.vmap(lambda w, s: one(w, None, s))(w_EDF, scale_E.reshape(-1))
