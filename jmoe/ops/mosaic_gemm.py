"""The grouped GEMM on NVIDIA Hopper: JAX's own Pallas Mosaic-GPU kernels, under one custom VJP.

  forward          y_XF = x_XD . w_EDF[e]     `ragged_dot_mgpu.ragged_dot`
  input gradient   dx_XD = dy_XF . w_EDF[e]^T  the same kernel, reading w transposed in the tile
                                               loads (no transposed copy of the weights)
  weight gradient  dw_EDF[e] = x_e^T . dy_e    `transposed_ragged_dot_mgpu.transposed_ragged_dot`

Each call takes a tile config (blocks, pipeline depth, grid swizzle) for its shape from
`mosaic_tiles.json` beside this file, written by `scripts/tune_gemm.py` on the GPU; a shape the
table lacks gets `default_tiles`, chosen from the kernels' constraints and the measured configs.
What the kernels require is met here: the contraction (for the weight gradient: D) a multiple of
its block and the output width a multiple of block_n x grid_block_n, the rows a multiple of 8
(else zero padding, which leaves the results exact), 16-bit operands (else XLA's ragged dot).
What they leave unwritten is set to zero: output and input-gradient rows past the groups, the
weight gradient of an expert with no rows.
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


SMEM_BYTES = 227 * 1024  # shared memory one block may use on Hopper (what Mosaic GPU checks)
# One warpgroup holds the float32 accumulator: block_m x block_n / 128 registers per thread, of
# the 255 a thread may have. 128 x 192 (192) ran best; 128 x 256 (256: spilled) collapsed to 76
# TFLOP/s (MEASURED.md).
ACC_ELEMENTS = 128 * 192


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
    D and F) without padding."""
    return self.padded(kind, k, n) == (k, n)

  def padded(self, kind: str, k: int, n: int) -> tuple[int, int]:
    """The smallest (k, n) at or above these that the config fits: the kernels want the
    contraction (drhs: D) a multiple of its block, and the output width a multiple of a whole
    swizzle band (block_n x grid_block_n; a part band is left untried)."""
    band = self.block_n * self.grid_block_n
    return round_up(k, self.block_m if kind == "drhs" else self.block_k), round_up(n, band)

  def smem_bytes(self, kind: str) -> int:
    """Shared memory the kernel asks for, from its source: each pipeline step holds one lhs and one
    rhs tile (ragged_dot: block_m x block_k and block_k x block_n; transposed_ragged_dot:
    block_k x block_m and block_k x block_n), 16-bit, `steps` of them; the output tile's
    block_m x block_n staging buffer is a later scope that reuses the same memory (64 x 256 with 5
    steps, 200 KiB of tiles plus 32 KiB of output, ran). 1 KiB for barriers and alignment."""
    del kind  # both kernels stage the same tile sizes
    tiles = self.steps * (self.block_m * self.block_k + self.block_k * self.block_n)
    return 2 * max(tiles, self.block_m * self.block_n) + 1024

  def runs(self, kind: str) -> bool:
    """Whether the config fits the SM: shared memory and accumulator registers."""
    return (self.smem_bytes(kind) <= SMEM_BYTES
            and self.block_m * self.block_n <= ACC_ELEMENTS)


def shape_key(kind: str, k: int, n: int) -> str:
  return f"{kind}:{k}x{n}"


@functools.cache
def _table() -> dict[str, Tiles]:
  """The tuned configs; other fields beside `tiles` (the sweep's figures) are not read."""
  if not TILES_FILE.is_file():
    return {}
  entries = json.loads(TILES_FILE.read_text())["tiles"]
  fields = {f.name for f in dataclasses.fields(Tiles)}
  return {key: Tiles(**{f: v for f, v in value.items() if f in fields})
          for key, value in entries.items()}


# ragged_dot's blocks in order of preference, each with its best pipeline depth (MEASURED.md and
# the Qwen3-30B-A3B sweep in docs/perf/records.jsonl). Each k step loads (block_m + block_n) x 64
# operands for block_m x block_n x 64 multiply-adds, so a tile's bound on the rate grows with
# block_m * block_n / (block_m + block_n): 77 for 128 x 192, 64 for 128 x 128, 51 for 64 x 256,
# 43 for 128 x 64. Measured in that order: 128 x 192 435 TFLOP/s against 128 x 128's 396 (up
# forward) and 429 against 64 x 256's 376 (down input gradient); 128 x 128 365 against 64 x 256's
# 351 (up input gradient). 64 x 256 won once (down forward, K 768: 274; 128 x 128 under 271.5).
RAGGED_BLOCKS = ((128, 192, 4), (128, 128, 4), (64, 256, 5), (128, 64, 4))
# The swizzle band: 4 output tiles side by side read each lhs row block once for the 4 (x is
# read n / (block_n x band) times). A narrower band before a smaller block: where measured the
# band moved little (64 x 256 on the down forward: band 1 and 5 steps 274, band 4 and 4 steps
# 271.5) and the block much (128 x 192 -> 128 x 128 on the up forward: -9%).
GRID_BLOCK_N = (4, 2, 1)
# transposed_ragged_dot's blocks with their rate bound relative to 128 x 128 (the measure above:
# 128 x 64 43/64, 64 x 64 32/64). 128 x 128 ran at 418 TFLOP/s on the up weight gradient, 57% of
# dense: at that bound, so smaller blocks are taken to scale with it.
CONTRACT_BLOCKS = ((128, 128, 1.0), (128, 64, 2 / 3), (64, 128, 2 / 3), (64, 64, 0.5))
# Padding D (or F) for the weight gradient copies x [rows, D] (or dy) into a wider buffer: about
# 4 x rows x D bytes against the GEMM's 2 x rows x D x F flops, i.e. 2 x 418 TFLOP/s / 4 TB/s / F
# = 209 / F of the GEMM's time. (Cutting the output's extra rows and columns off fuses into the
# masking that follows it: no extra pass.)
PAD_COPY = 209


def default_tiles(kind: str, k: int, n: int) -> Tiles:
  """A config for a shape the table lacks; it may need k and n padded (`Tiles.padded`, with
  zeros: exact).

  fwd / dlhs: the first block of RAGGED_BLOCKS that fits with the widest band of GRID_BLOCK_N,
  after padding k and n only to multiples of 64 (what every block takes). Padding further
  would pad the weights [E, K, N], a copy of about 4 x E x K x N bytes beside 2 x rows x K x N
  flops: 209 / (rows per expert) of the GEMM's time, 20-40% at 512-1024 rows per expert, more
  than any block choice gained in the sweep (at most 14%, above).
  drhs: the block of CONTRACT_BLOCKS with the least estimated time, padding work plus padding
  copies over the block's rate. GPT-OSS's 2880 x 2880: 128 x 128 padded to 2944 x 2944 costs
  1.045 (work) + 2 x 0.073 (copies) = 1.19 against 2.0 for 64 x 64 unpadded and 1.61 for
  128 x 64 with D padded; a 16-wide LoRA factor takes 128 x 64 (6.1: F padded to 64, not to 128's
  8x the work)."""
  if kind == "drhs":
    return _default_contract(k, n)
  k_pad, n_pad = round_up(k, 64), round_up(n, 64)
  for block_m, block_n, steps in RAGGED_BLOCKS:
    for grid_block_n in GRID_BLOCK_N:
      t = Tiles(block_m=block_m, block_n=block_n, block_k=64, steps=steps,
                grid_block_n=grid_block_n)
      if t.fits(kind, k_pad, n_pad):
        return t
  raise AssertionError("128 x 64 fits every multiple of 64")


def _default_contract(d: int, f: int) -> Tiles:
  def cost(block):
    block_m, block_n, rate = block
    d_pad, f_pad = round_up(d, block_m), round_up(f, block_n)
    copies = PAD_COPY / f * (d_pad > d) + PAD_COPY / d * (f_pad > f)
    return d_pad * f_pad / (d * f) / rate + copies

  block_m, block_n, _ = min(CONTRACT_BLOCKS, key=cost)  # ties: the earlier, larger block
  return Tiles(block_m=block_m, block_n=block_n, block_k=64, steps=4)


def tiles_for(kind: str, k: int, n: int) -> Tiles:
  """The tuned config for this shape if the table has one that fits it, else the default."""
  tuned = _table().get(shape_key(kind, k, n))
  return tuned if tuned is not None and tuned.fits(kind, k, n) else default_tiles(kind, k, n)


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def pad_axis(a: jax.Array, axis: int, size: int) -> jax.Array:
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
  k_pad, n_pad = tiles.padded("dlhs" if transpose_rhs else "fwd", k, n)
  if (k_pad, n_pad) != (k, n):  # zero columns of x and rows of w add nothing; extra outputs cut
    x_XK = pad_axis(x_XK, 1, k_pad)
    w = pad_axis(pad_axis(w, 2 if transpose_rhs else 1, k_pad), 1 if transpose_rhs else 2,
                  n_pad)
    return ragged(x_XK, w, group_sizes_E, transpose_rhs, tiles)[:, :n]
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
  d_pad, f_pad = tiles.padded("drhs", d, f)
  if (d_pad, f_pad) != (d, f):  # zero columns give zero rows and columns of x^T y, cut off
    out = ragged_contract(pad_axis(x_XD, 1, d_pad), pad_axis(y_XF, 1, f_pad), group_sizes_E,
                          tiles)
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
  padded = pad_axis(x_XD, 0, round_up(rows, ROW_MULTIPLE))  # extra rows: past the groups
  return _mosaic(padded, w_EDF, group_sizes_E.astype(jnp.int32))[:rows]


def on_hopper() -> bool:
  """Whether the default device is an NVIDIA GPU of compute capability 9.x (the kernels use
  Hopper's wgmma and tensor-copy instructions)."""
  if jax.default_backend() != "gpu":
    return False
  capability = str(getattr(jax.devices()[0], "compute_capability", ""))
  return capability.startswith("9")
