"""FP8 grouped GEMMs on Hopper through jmoe's Mosaic-GPU kernels: what XLA prepares around them.

  forward          y_XF = x_q . w_q[e]      x_q [X, D]; the weights' transposed copy [E, F, D]
  input gradient   dx_XD = dy_q . w_q[e]^T  dy_q [X, F]; the weights [E, D, F] as stored
  weight gradient  dw[e] = x_e^T . dy_e     x_q^T and dy_q^T in the group-aligned layout below

Hopper's FP8 wgmma takes both operands K-major (the contracted axis contiguous), hence the
transposed copies. The forward transposes the weights' FP8 copy at each use; making it once per
step would need the optimizer update to emit the FP8 weights (and their scales) beside the
master weights and the model to take them as inputs. The weight gradient contracts over rows,
whose expert boundaries fall anywhere: instead of masking columns inside the kernel, x_q^T and
dy_q^T are written with every expert's columns starting on a multiple of block_k and zeros in
the gaps (`group_aligned_columns` computes the order in XLA; the gather and transpose are one
Triton kernel, jmoe/ops/fp8_transpose.py), so every K step of the kernel belongs to one expert
and needs no mask. The price: up to E x (block_k - 1) extra zero columns per operand (E = 128,
block_k = 128: 16k columns beside, for example, 64k rows).

Scales stay outside the kernels (jmoe/ops/fp8_grouped.py multiplies the bf16 output by the row
and expert scales in XLA): the output's bf16 rounding is relative, 2^-9 of each value whatever
the scale, so scaling after rounding costs no accuracy beyond that one rounding.

Kernel and XLA side meet in `RaggedKernels` (`mosaic_fp8_kernels`); the kernel functions are
arguments so that tests on CPU can stand in their own and check what is passed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jmoe.ops.fp8_blockwise import BlockwiseKernels
from jmoe.ops.fp8_grouped import RaggedKernels
from jmoe.ops.fp8_transpose import transpose_rows
from jmoe.ops import mosaic_gemm
from jmoe.ops.mosaic_gemm import ROW_MULTIPLE, Tiles, one_call_per_batch, pad_axis, round_up
from jmoe.ops.rows import row_groups

FP8_BLOCK_K = 128  # 128 one-byte values: one 128-byte swizzled row of shared memory


# precision.fp8_promote=long: contractions from this long on run the row kernel with its sums
# promoted to float32 every K step (`promoted_rows`). On the H200 the forward of Mixtral's down
# projection (K = 14,336) was 3.32e-3 off the float32 sums of its operands where K = 2,048 gave
# 1.87e-3 (one bf16 rounding alone: 1.66e-3), the error of an accumulator with fewer bits than
# float32; Mixtral's up input gradient (K = 28,672) 4.19e-3 unpromoted and 1.66e-3 promoted
# (2026-12-05).
PROMOTE_FROM_K = 8192
PROMOTE_SETTINGS = {"never": None, "long": PROMOTE_FROM_K, "always": 0}  # -> promote_from_k


def promotes(k: int, promote_from_k: int | None) -> bool:
  """Whether a row-kernel call contracting over `k` promotes its sums (PROMOTE_SETTINGS' values;
  None: never)."""
  return promote_from_k is not None and k >= promote_from_k


def fp8_tiles(n: int) -> Tiles:
  """Tiles for an FP8 kernel whose output is `n` wide (padded to a multiple of 64): 128 x 128
  blocks (128 x 64 when n is no multiple of 128) over 128-deep K steps, 4 in flight (4 x 32 KiB
  of operand tiles, the bf16 output tile reuses them), and the widest band of 4, 2 or 1 tiles
  that divides the output's tiles. Not yet tuned on the GPU."""
  block_n = 128 if n % 128 == 0 else 64
  grid_n = round_up(n, 64) // block_n
  band = next(b for b in (4, 2, 1) if grid_n % b == 0)
  return Tiles(block_m=128, block_n=block_n, block_k=FP8_BLOCK_K, steps=4, grid_block_n=band)


def _with_tiles(kernel, tiles: Tiles, out_dtype):
  """`kernel` with its tile config (jmoe's FP8 kernels take Tiles' fields as keywords) and output
  dtype bound."""
  return functools.partial(kernel, **dataclasses.asdict(tiles), out_dtype=out_dtype)


def row_tiles(group_sizes_E: jax.Array, num_rows: int, block_m: int) -> jax.Array:
  """int32 [4, T] for the forward kernel, T = ceil(num_rows / block_m) + E - 1 (each expert
  boundary inside a row block adds one tile): per tile its expert, row block, first row within
  the block and row count. Tiles past the last get count 0. An expert's rows [s, s + n) cover
  the row blocks s // block_m to (s + n - 1) // block_m."""
  num_experts = group_sizes_E.shape[0]
  num_tiles = -(-num_rows // block_m) + num_experts - 1
  sizes_E = group_sizes_E.astype(jnp.int32)
  ends_E = jnp.cumsum(sizes_E)
  starts_E = ends_E - sizes_E
  first_block_E = starts_E // block_m
  blocks_E = jnp.where(sizes_E > 0, (ends_E - 1) // block_m - first_block_E + 1, 0)
  expert_T = row_groups(blocks_E, num_tiles)  # E for tiles past the last
  known_T = expert_T < num_experts
  expert_T = jnp.minimum(expert_T, num_experts - 1)
  tile_in_expert_T = jnp.arange(num_tiles) - (jnp.cumsum(blocks_E) - blocks_E)[expert_T]
  block_T = first_block_E[expert_T] + tile_in_expert_T
  row0_T = jnp.maximum(starts_E[expert_T], block_T * block_m)
  row1_T = jnp.minimum(ends_E[expert_T], (block_T + 1) * block_m)
  count_T = jnp.where(known_T, row1_T - row0_T, 0)
  return jnp.stack([expert_T, jnp.where(known_T, block_T, 0), row0_T - block_T * block_m,
                    count_T]).astype(jnp.int32)


def group_aligned_columns(group_sizes_E: jax.Array, num_rows: int, block_k: int
                          ) -> tuple[jax.Array, jax.Array]:
  """The weight gradient's layout: (source_P, blocks_2E). Column p of the aligned operand is row
  source_P[p] of the row-sorted one (num_rows: a zero gap column); expert e owns the
  blocks_2E[1, e] column blocks from block blocks_2E[0, e]. P = the smallest multiple of block_k
  that holds num_rows + E x (block_k - 1) columns, enough for any sizes summing to num_rows."""
  num_experts = group_sizes_E.shape[0]
  width = round_up(num_rows + num_experts * (block_k - 1), block_k)
  sizes_E = group_sizes_E.astype(jnp.int32)
  blocks_E = -(-sizes_E // block_k)
  aligned_ends_E = jnp.cumsum(blocks_E) * block_k
  aligned_starts_E = aligned_ends_E - blocks_E * block_k
  expert_P = jnp.minimum(row_groups(blocks_E * block_k, width), num_experts - 1)
  within_P = jnp.arange(width) - aligned_starts_E[expert_P]
  row_starts_E = jnp.cumsum(sizes_E) - sizes_E
  in_group_P = (within_P < sizes_E[expert_P]) & (jnp.arange(width) < aligned_ends_E[-1])
  source_P = jnp.where(in_group_P, row_starts_E[expert_P] + within_P, num_rows)
  return source_P.astype(jnp.int32), jnp.stack([aligned_starts_E // block_k, blocks_E])


def aligned_transpose(x_XD: jax.Array, source_P: jax.Array) -> jax.Array:
  """[D, P]: x's rows in the group-aligned column order, zeros in the gaps (jmoe's Triton
  kernel: XLA's gather fused with the transpose moved one-byte values at about 300 GB/s)."""
  return transpose_rows(x_XD, source_P)


def fp8_ragged_dot(x_XK: jax.Array, w_ENK: jax.Array, group_sizes_E: jax.Array,
                   kernel=None, out_dtype=jnp.bfloat16, promote: bool = False) -> jax.Array:
  """[X, N] = x . w[e]^T for each expert's rows (float8 operands, both K-major); rows past the
  groups unwritten. K and N are padded with zeros to the tiles (exact), rows to a multiple of 8.
  `promote`: the kernel's sums promoted to float32 every K step (`promoted_rows`)."""
  from jmoe.ops.fp8_mosaic_kernels import ragged_rows
  kernel = kernel or ragged_rows
  rows, k = x_XK.shape
  n = w_ENK.shape[1]
  tiles = fp8_tiles(n)
  k_pad, n_pad = round_up(k, tiles.block_k), round_up(n, tiles.block_n)
  x_XK = pad_axis(pad_axis(x_XK, 1, k_pad), 0, round_up(rows, ROW_MULTIPLE))
  w_ENK = pad_axis(pad_axis(w_ENK, 2, k_pad), 1, n_pad)
  table_4T = row_tiles(group_sizes_E, x_XK.shape[0], tiles.block_m)
  call = _with_tiles(kernel, tiles, out_dtype)
  if promote:
    call = functools.partial(call, promote=True)
  y = one_call_per_batch(lambda x, w, table: call(x, w, table))(x_XK, w_ENK, table_4T)
  return y[:rows, :n]


def fp8_blockwise_ragged_dot(x_XK: jax.Array, x_scale_XB: jax.Array, w_ENK: jax.Array,
                             w_scale_ECB: jax.Array, group_sizes_E: jax.Array, kernel=None,
                             out_dtype=jnp.bfloat16) -> jax.Array:
  """[X, N] = sum over K blocks b of (x[:, b] . w[e][:, b]^T) x_scale[:, b] w_scale[e, c, b]
  for each expert's rows, c the output column's 128-block: DeepSeek-V3's blockwise scaling
  (x_scale one per 1 x 128 piece of a row, B = ceil(K / 128); w_scale one per 128 x 128 tile,
  C = ceil(N / 128)), the scales applied in the kernel per K step; rows past the groups
  unwritten. K is padded with zeros to whole blocks (exact), rows to whole row tiles."""
  from jmoe.ops.fp8_mosaic_kernels import ragged_rows
  kernel = kernel or ragged_rows
  rows, k = x_XK.shape
  n = w_ENK.shape[1]
  tiles = fp8_tiles(n)
  k_pad, n_pad = round_up(k, tiles.block_k), round_up(n, tiles.block_n)
  rows_pad = round_up(rows, tiles.block_m)  # the row scales are read a whole row tile at once
  x_XK = pad_axis(pad_axis(x_XK, 1, k_pad), 0, rows_pad)
  w_ENK = pad_axis(pad_axis(w_ENK, 2, k_pad), 1, n_pad)
  x_scale_BX = pad_axis(x_scale_XB.astype(jnp.float32), 0, rows_pad).T
  table_4T = row_tiles(group_sizes_E, rows_pad, tiles.block_m)
  call = _with_tiles(kernel, tiles, out_dtype)
  y = one_call_per_batch(lambda x, w, table, sx, sw: call(x, w, table, (sx, sw)))(
      x_XK, w_ENK, table_4T, x_scale_BX, w_scale_ECB.astype(jnp.float32))
  return y[:rows, :n]


def fp8_aligned_contract(x_XD: jax.Array, y_XF: jax.Array, group_sizes_E: jax.Array,
                         kernel=None, out_dtype=jnp.bfloat16) -> jax.Array:
  """[E, D, F] = sum over each expert's rows of x^T y (float8 operands); zeros for an expert
  with no rows. D and F are padded with zeros to the tiles (exact), then cut."""
  from jmoe.ops.fp8_mosaic_kernels import aligned_contract
  kernel = kernel or aligned_contract
  d, f = x_XD.shape[1], y_XF.shape[1]
  tiles = Tiles(block_m=128, block_n=128, block_k=FP8_BLOCK_K, steps=4, grid_block_n=1)
  source_P, blocks_2E = group_aligned_columns(group_sizes_E, x_XD.shape[0], tiles.block_k)
  x_DP = pad_axis(aligned_transpose(x_XD, source_P), 0, round_up(d, tiles.block_m))
  y_FP = pad_axis(aligned_transpose(y_XF, source_P), 0, round_up(f, tiles.block_n))
  call = _with_tiles(kernel, tiles, out_dtype)
  out = one_call_per_batch(lambda a, b, blocks: call(a, b, blocks))(x_DP, y_FP, blocks_2E)
  return out[:, :d, :f]


def mosaic_fp8_kernels(rows_kernel=None, contract_kernel=None, contract16=None,
                       promote_from_k: int | None = None) -> RaggedKernels:
  """The Mosaic backend's float8 kernels in `RaggedKernels` form, (x_q, w_q [E, K, N], sizes)
  and (x_q, y_q, sizes): the forward's w_q is transposed to K-major here; the input gradient,
  handed w_q^T by `grouped_fp8`, gets w_q back (XLA cancels the two transposes); a weight
  gradient in bf16 runs the 16-bit Mosaic kernel (jmoe/ops/mosaic_gemm.py). The row kernels
  promote their sums for contractions of `promote_from_k` or more (None: never)."""
  promote = functools.partial(promotes, promote_from_k=promote_from_k)
  return RaggedKernels(
      dot=lambda x, w_EKN, sizes: fp8_ragged_dot(x, jnp.swapaxes(w_EKN, 1, 2), sizes,
                                                 rows_kernel, promote=promote(x.shape[1])),
      contract=lambda x, y, sizes: fp8_aligned_contract(x, y, sizes, contract_kernel),
      contract16=contract16 or _contract16)


def mosaic_blockwise_kernels(rows_kernel=None, contract16=None) -> BlockwiseKernels:
  """The Mosaic backend's kernels for the blockwise recipe: the row kernel with its scales
  applied per K step (`fp8_blockwise_ragged_dot`), the 16-bit contraction for the weight
  gradient."""
  return BlockwiseKernels(
      dot=lambda a, a_scale, b, b_scale, sizes: fp8_blockwise_ragged_dot(
          a, a_scale, b, b_scale, sizes, rows_kernel),
      contract16=contract16 or _contract16)


def _contract16(x_XD: jax.Array, y_XF: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
  """The 16-bit Mosaic contraction, rows padded to the kernel's multiple of 8 (zero rows,
  outside every group)."""
  rows = round_up(x_XD.shape[0], ROW_MULTIPLE)
  return mosaic_gemm.ragged_contract(pad_axis(x_XD, 0, rows), pad_axis(y_XF, 0, rows),
                                     group_sizes_E)
