"""jmoe's FP8 grouped-GEMM kernels for NVIDIA Hopper, on JAX's Pallas Mosaic-GPU primitives.

Hopper's FP8 wgmma reads both operands from shared memory with the contraction (K) contiguous,
so both kernels take K-major operands (either float8 format, mixed as the recipe gives them: E4M3
weights with E5M2 gradients) and accumulate in float32 registers (a wgmma accumulator),
then round once to the output dtype (bfloat16 or float32) on the way out:

  `ragged_rows`      out[rows of tile t] = a[rows] . b[e(t)]^T, a [M, K], b [E, N, K]
                     (forward: a = x_q, b = the weights' transposed copy [E, F, D]; input
                     gradient: a = dy_q, b = the weights [E, D, F] as they are)
  `promoted_rows`    ragged_rows with its sums promoted to float32 every K step (long
                     contractions), optionally with blockwise scales applied per K step
                     (precision.fp8_recipe=blockwise); warp-specialized
  `aligned_contract` out[e] = a[:, cols of e] . b[:, cols of e]^T, a [D, P], b [F, P], where
                     each expert's columns start on a multiple of block_k and the gaps hold
                     zeros (the layout `jmoe.ops.fp8_mosaic.group_aligned_columns` makes)

Which row tile or column range each output belongs to is computed in XLA (jmoe/ops/fp8_mosaic.py)
and read here as int32 scalars: the kernels carry no per-expert loop. Both are persistent: one
program per SM walks the output tiles in a snake order (`grid_block_n` tiles side by side) so
that neighbouring programs share operand tiles in L2.

scripts/check_gpu.py --fp8 (fp8_* cases) holds them to a float32 reference of the dequantized
operands, expert by expert; tests/test_fp8_mosaic.py runs them through Pallas' Mosaic-GPU
interpreter on CPU (`interpret`) and lowers them for CUDA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# The Pallas Mosaic-GPU imports are deferred to the calls: this module must import on CPU hosts.


# Programs of an interpreted kernel: a few, so that each walks several output tiles, as each SM
# does on the GPU (where tiles outnumber SMs), and the persistent loop's reuse of its shared
# memory from tile to tile is exercised too.
INTERPRETED_PROGRAMS = 3


def _launch(interpret) -> dict:
  """plgpu.kernel's launch arguments: warpgroup lowering; one program per SM compiled for the
  GPU, INTERPRETED_PROGRAMS through Pallas' GPU interpreter where the kernel is to be
  interpreted (`interpret`: True, or the interpreter's parameters, e.g. with its race detector
  on; None: on hosts without a GPU, as tests on CPU run it)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  launch = dict(compiler_params=plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if interpret:
    params = interpret if isinstance(interpret, plgpu.InterpretGPUParams) else (
        plgpu.InterpretGPUParams())
    return dict(launch, grid=(INTERPRETED_PROGRAMS,), interpret=params)
  return dict(launch, grid=(getattr(jax.devices()[0], "core_count", None) or 132,))


def _store_rows(out_smem, out_ref, row0, first, count, col0, block_n: int, widths,
                wait: bool = True) -> None:
  """out_smem's rows [first, first + count) to out_ref's rows from row0 + first, columns from
  col0: one TMA store of 2^i rows per set bit i of count (a TMA copy's shape is static).
  `wait`: until the stores have read out_smem (else the caller waits before reusing it)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  plgpu.commit_smem()
  offset = first
  for width in widths:  # descending powers of two: the binary digits of `count`
    take = count & width

    @pl.when(take != 0)
    def _copy(offset=offset, width=width):
      plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(offset, width)],
                              out_ref.at[pl.ds(row0 + offset, width), pl.ds(col0, block_n)])

    offset = offset + take
  if wait:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _powers_of_two(rows: int) -> list[int]:
  """Descending powers of two whose sums give every count from 1 to `rows`."""
  return [1 << i for i in reversed(range(max(1, rows).bit_length()))]


def ragged_rows(a_MK: jax.Array, b_ENK: jax.Array, table_4T: jax.Array,
                scales: tuple[jax.Array, jax.Array] | None = None, *, block_m: int,
                block_n: int, block_k: int, steps: int, grid_block_n: int,
                out_dtype=jnp.bfloat16, promote: bool = False,
                interpret=None) -> jax.Array:
  """[M, N]: for each row tile t (table_4T[:, t] = expert, row block, first row within the
  block, row count; count 0: nothing to do), the rows [block * block_m + first, + count) of
  a . b[expert]^T. Rows no tile covers are left unwritten (the caller zeroes them).
  `promote` or `scales`: `promoted_rows`, which sums in float32 every K step."""
  if promote or scales is not None:
    return promoted_rows(a_MK, b_ENK, table_4T, scales, block_m=block_m, block_n=block_n,
                         block_k=block_k, steps=steps, grid_block_n=grid_block_n,
                         out_dtype=out_dtype, interpret=interpret)
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  m, k = a_MK.shape
  _, n, k2 = b_ENK.shape
  assert k == k2 and k % block_k == 0 and n % block_n == 0, (a_MK.shape, b_ENK.shape)
  num_tiles, grid_n = table_4T.shape[1], n // block_n
  widths = _powers_of_two(min(block_m, m))

  def body(table_ref, a_ref, b_ref, out_ref):
    @plgpu.nd_loop((num_tiles * grid_n,), collective_axes="sm")
    def _tile(info):
      t, ni = plgpu.planar_snake(info.index[0], (num_tiles, grid_n), 1, grid_block_n)
      expert, block, first, count = (table_ref[i, t] for i in range(4))

      @pl.when(count > 0)
      def _work():
        def accumulate(acc_ref):
          step = lambda _, a_smem, b_smem: plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))
          plgpu.emit_pipeline(
              step, grid=(k // block_k,),
              in_specs=[plgpu.BlockSpec((block_m, block_k), lambda ki: (block, ki),
                                        delay_release=1),
                        plgpu.BlockSpec((block_n, block_k), lambda ki: (ni, ki),
                                        delay_release=1)],
              max_concurrent_steps=steps)(a_ref, b_ref.at[expert])
          return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((block_m, block_n)))

        def store(out_smem):
          out_smem[...] = acc.astype(out_smem.dtype)
          _store_rows(out_smem, out_ref, block * block_m, first, count, ni * block_n, block_n,
                      widths)

        pl.run_scoped(store, plgpu.SMEM((block_m, block_n), out_dtype))

  call = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), grid_names=("sm",),
      **_launch(interpret))
  return call(table_4T, a_MK, b_ENK)


def promoted_rows(a_MK: jax.Array, b_ENK: jax.Array, table_4T: jax.Array,
                  scales: tuple[jax.Array, jax.Array] | None = None, *, block_m: int,
                  block_n: int, block_k: int, steps: int, grid_block_n: int,
                  out_dtype=jnp.bfloat16, interpret=None) -> jax.Array:
  """`ragged_rows` with its sums promoted to float32 every K step: each step's products are
  summed by the tensor cores into an accumulator of their own, which is then added to the
  tile's float32 sum in registers, as DeepSeek-V3's kernels do: Hopper's FP8 wgmma adds into
  its accumulator with fewer bits than float32, an error that grows with the contraction
  (Mixtral's 14,336 and 28,672).

  Warp-specialized, meant to keep the tensor cores busy while a step's sum is added: one
  warpgroup issues the TMA loads, two compute warpgroups each take half of the tile's rows
  (block_m / 2 x block_n; the step's products and the sum take block_m x block_n / 128
  registers per thread together, by the arithmetic), so that one's wgmma can run while the
  other waits and adds. A tile's output stores run beside the next tile's steps.

  `scales` = (a_scale_KM [K / block_k, M], b_scale_ENK [E, ceil(N / 128), K / block_k]),
  float32: blockwise scaling, one scale per block_k-long piece of each row of a and per
  128 x block_k tile of each expert's b (block_k = 128: DeepSeek-V3's 1 x 128 and 128 x 128
  tiles); each step's products are multiplied by their row's and their tile's scales before
  they are added. The row scales come through the pipeline beside the operand tiles (a
  register layout is loaded from shared memory only); M a multiple of block_m then."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  m, k = a_MK.shape
  _, n, k2 = b_ENK.shape
  assert k == k2 and k % block_k == 0 and n % block_n == 0, (a_MK.shape, b_ENK.shape)
  assert block_m % 128 == 0, block_m  # two warpgroups of 64 rows (a wgmma's M) or more
  num_tiles, grid_n = table_4T.shape[1], n // block_n
  half = block_m // 2
  widths = _powers_of_two(half)
  if scales is not None:
    assert scales[0].shape == (k // block_k, m) and m % block_m == 0, (scales[0].shape, m)
    assert scales[1].shape == (b_ENK.shape[0], -(-n // 128), k // block_k), scales[1].shape
    assert 128 % block_n == 0 or block_n % 128 == 0, block_n

  def pipeline_for(block, ni, body, compute_context):
    in_specs = [plgpu.BlockSpec((block_m, block_k), lambda ki: (block, ki)),
                plgpu.BlockSpec((block_n, block_k), lambda ki: (ni, ki))]
    if scales is not None:
      in_specs.append(plgpu.BlockSpec((1, block_m), lambda ki: (ki, block)))
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k // block_k,), memory_registers=40, in_specs=in_specs,
        max_concurrent_steps=steps, wg_axis="wg", num_compute_wgs=2,
        compute_context=compute_context)

  def kernel(table_ref, a_ref, b_ref, *rest):
    *scale_refs, out_ref = rest
    operands = lambda expert: (a_ref, b_ref.at[expert], *scale_refs[:1])
    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline_for(0, 0, ignore, ignore).get_allocations(*operands(0)),
        out_smem=plgpu.SMEM((2, half, block_n), out_dtype), collective_axes="wg")
    def _scope(allocations, out_smem):
      wg = jax.lax.axis_index("wg")

      @plgpu.nd_loop((num_tiles * grid_n,), collective_axes="sm")
      def _tile(info):
        t, ni = plgpu.planar_snake(info.index[0], (num_tiles, grid_n), 1, grid_block_n)
        expert, block, first, count = (table_ref[i, t] for i in range(4))

        def step(index, a_smem, b_smem, *rest):
          *row_scale_smem, sum_ = rest
          rows = pl.ds(wg * half, half)
          if row_scale_smem:
            # Read before the wgmma is issued, so that neither read waits behind it; the fence
            # orders this read of the slot before the TMA that refills it once it is released.
            row_scale = plgpu.load(row_scale_smem[0].at[0, rows],
                                   layout=plgpu.Layout.WGMMA.reduce(1))
            tile_scale = scale_refs[1][expert, ni * block_n // 128, index[0]]
            plgpu.commit_smem()

          def products(acc_ref):
            plgpu.wgmma(acc_ref, a_smem.at[rows], b_smem.transpose((1, 0)))
            return acc_ref[...]  # waits for this warpgroup's wgmma

          part = pl.run_scoped(products, plgpu.ACC((half, block_n)))
          if row_scale_smem:
            part = part * jax.lax.broadcast_in_dim(row_scale * tile_scale, part.shape, [0])
          return sum_ + part

        def compute_context(run):
          zeros = plgpu.layout_cast(jnp.zeros((half, block_n), jnp.float32),
                                    plgpu.Layout.WGMMA)
          sum_ = run(zeros)
          # This warpgroup's rows of the tile: [wg * half, + half) within the row block.
          lo = jnp.clip(first - wg * half, 0, half)
          hi = jnp.clip(first + count - wg * half, 0, half)
          # The last tile's stores must have read out_smem before it is written again; they
          # ran beside this tile's steps.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          out_smem[wg] = sum_.astype(out_dtype)
          _store_rows(out_smem.at[wg], out_ref, block * block_m + wg * half, lo, hi - lo,
                      ni * block_n, block_n, widths, wait=False)

        @pl.when(count > 0)
        def _work():
          pipeline_for(block, ni, step, compute_context)(*operands(expert),
                                                         allocations=allocations)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, n), out_dtype), grid_names=("sm",),
      num_threads=3, thread_name="wg", **_launch(interpret))
  return call(table_4T, a_MK, b_ENK, *(scales or ()))


def aligned_contract(a_DP: jax.Array, b_FP: jax.Array, blocks_2E: jax.Array, *, block_m: int,
                     block_n: int, block_k: int, steps: int, grid_block_n: int,
                     out_dtype=jnp.bfloat16, interpret=None) -> jax.Array:
  """[E, D, F]: out[e] = a[:, c] . b[:, c]^T over expert e's columns c, which are the
  blocks_2E[1, e] column blocks (of block_k) from block blocks_2E[0, e]. An expert with no
  blocks gets zeros (the accumulator starts at zero). Every tile is written."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  d, p = a_DP.shape
  f, p2 = b_FP.shape
  assert p == p2 and p % block_k == 0 and d % block_m == 0 and f % block_n == 0, (
      a_DP.shape, b_FP.shape)
  num_experts, grid_m, grid_n = blocks_2E.shape[1], d // block_m, f // block_n

  def body(blocks_ref, a_ref, b_ref, out_ref):
    @plgpu.nd_loop((num_experts, grid_m * grid_n), collective_axes="sm")
    def _tile(info):
      expert = info.index[0]
      mi, ni = plgpu.planar_snake(info.index[1], (grid_m, grid_n), 1, grid_block_n)
      start, count = blocks_ref[0, expert], blocks_ref[1, expert]

      def accumulate(acc_ref):
        @pl.when(count > 0)
        def _pipeline():
          step = lambda _, a_smem, b_smem: plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))
          plgpu.emit_pipeline(
              step, grid=(count,),
              in_specs=[plgpu.BlockSpec((block_m, block_k), lambda ki: (mi, start + ki),
                                        delay_release=1),
                        plgpu.BlockSpec((block_n, block_k), lambda ki: (ni, start + ki),
                                        delay_release=1)],
              max_concurrent_steps=steps)(a_ref, b_ref)

        return acc_ref[...]

      acc = pl.run_scoped(accumulate, plgpu.ACC((block_m, block_n)))

      def store(out_smem):
        out_smem[...] = acc.astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            out_smem, out_ref.at[expert, pl.ds(mi * block_m, block_m), pl.ds(ni * block_n,
                                                                               block_n)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      pl.run_scoped(store, plgpu.SMEM((block_m, block_n), out_dtype))

  call = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((num_experts, d, f), out_dtype), grid_names=("sm",),
      **_launch(interpret))
  return call(blocks_2E, a_DP, b_FP)

