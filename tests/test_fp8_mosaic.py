"""The Mosaic FP8 grouped GEMMs on CPU: the row-tile table, the group-aligned layout of the
weight gradient, and what reaches the kernels, with stand-in kernels that compute the kernels'
contract in XLA (and leave NaN where a kernel leaves memory unwritten); the kernels themselves
through Pallas' Mosaic-GPU interpreter (their logic: tiles, pipelines, partial stores; the
interpreter sums in float32 exactly, so the tensor cores' own accumulation is checked only on
Hopper, by scripts/check_gpu.py --fp8) and lowered for Hopper (Mosaic's layout inference and
lowering run; the GPU compiler's register allocation does not)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmoe.ops.fp8_mosaic_kernels as kernels
from jmoe.config import ConfigError
from jmoe.ops import mosaic_gemm
from jmoe.ops.fp8 import recipe_from_config
from jmoe.ops.fp8_grouped import grouped_fp8
from jmoe.ops.fp8_mosaic import group_aligned_columns, mosaic_fp8_kernels, row_tiles
from jmoe.ops.grouped_gemm import GEMM_BACKENDS, grouped_gemm
from helpers import grouped_contract, opaque, sixteen_bit, tiny_config, weight_copies_grown

F8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
SIZES = [[5, 0, 9, 3, 7], [0, 0, 24, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]


def covered_rows(table, block_m):
  """{row: expert} from a row-tile table, checking that no row is covered twice."""
  rows = {}
  for expert, block, first, count in np.asarray(table).T:
    assert 0 <= first and first + count <= block_m
    for r in range(block * block_m + first, block * block_m + first + count):
      assert r not in rows
      rows[r] = expert
  return rows


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("block_m", [4, 8])
def test_row_tiles_cover_each_experts_rows_once(sizes, block_m):
  table = row_tiles(jnp.asarray(sizes), 30, block_m)
  assert table.shape == (4, -(-30 // block_m) + len(sizes) - 1) and table.dtype == jnp.int32
  ends = np.cumsum(sizes)
  want = {r: e for e, (s, t) in enumerate(zip(ends - sizes, ends)) for r in range(s, t)}
  assert covered_rows(table, block_m) == want  # rows past the groups: in no tile


@pytest.mark.parametrize("sizes", SIZES)
def test_group_aligned_columns_hold_each_expert_in_whole_blocks(sizes):
  block_k = 4
  source, blocks = group_aligned_columns(jnp.asarray(sizes), 30, block_k)
  source, blocks = np.asarray(source), np.asarray(blocks)
  assert source.shape[0] % block_k == 0 and source.shape[0] >= 30 + 5 * (block_k - 1)
  ends = np.cumsum(sizes)
  for e, (start, end) in enumerate(zip(ends - sizes, ends)):
    first, count = blocks[:, e]
    cols = source[first * block_k:(first + count) * block_k]
    assert count == -(-sizes[e] // block_k)
    np.testing.assert_array_equal(cols[:sizes[e]], np.arange(start, end))
    assert np.all(cols[sizes[e]:] == 30)  # the gap: zero columns
  owned = sum(blocks[1]) * block_k
  assert np.all(source[owned:] == 30)


def fake_rows(a, b, table, *, block_m, block_n, block_k, steps, grid_block_n, out_dtype,
              promote=False):
  """ragged_rows' contract in XLA; rows no tile covers come back NaN (unwritten memory)."""
  assert a.dtype in F8 and b.dtype in F8 and a.shape[1] == b.shape[2]  # both K-major
  assert a.shape[0] % 8 == 0 and a.shape[1] % block_k == 0 and b.shape[1] % block_n == 0
  assert b.shape[1] // block_n % grid_block_n == 0 and steps >= 1
  assert table.dtype == jnp.int32 and table.shape[0] == 4
  expert, block, first, count = table
  rows_TB = block[:, None] * block_m + first[:, None] + jnp.arange(block_m)
  rows_TB = jnp.where(jnp.arange(block_m) < count[:, None], rows_TB, a.shape[0])
  expert_M = jnp.full((a.shape[0],), -1).at[rows_TB].set(
      jnp.broadcast_to(expert[:, None], rows_TB.shape), mode="drop")
  y_MEN = jnp.einsum("mk,enk->men", a.astype(jnp.float32), b.astype(jnp.float32))
  y_MN = jnp.take_along_axis(y_MEN, jnp.maximum(expert_M, 0)[:, None, None], 1)[:, 0]
  return jnp.where(expert_M[:, None] >= 0, y_MN, jnp.nan).astype(out_dtype)


def fake_contract(a, b, blocks, *, block_m, block_n, block_k, steps, grid_block_n, out_dtype):
  """aligned_contract's contract in XLA: whole column blocks per expert, no mask inside them."""
  assert a.dtype in F8 and b.dtype in F8 and a.shape[1] == b.shape[1]  # both contract over P
  assert a.shape[0] % block_m == 0 and b.shape[0] % block_n == 0 and a.shape[1] % block_k == 0
  block_P = jnp.arange(a.shape[1]) // block_k
  owned_EP = (block_P >= blocks[0][:, None]) & (block_P < (blocks[0] + blocks[1])[:, None])
  return jnp.einsum("dp,fp,ep->edf", a.astype(jnp.float32), b.astype(jnp.float32),
                    owned_EP.astype(jnp.float32)).astype(out_dtype)


def fake_contract16(x, y, sizes):
  """mosaic_gemm.ragged_contract's contract in XLA: 16-bit operands, float32 sums, a bf16
  result; experts with no rows unwritten (NaN)."""
  assert x.dtype == y.dtype == jnp.bfloat16 and x.shape[0] % 8 == 0
  return grouped_contract(x, y, sizes).astype(jnp.bfloat16)


def loop_reference(x, w, sizes):
  ends = np.cumsum(sizes)
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  y = np.zeros((x.shape[0], w.shape[2]))
  for e, (start, end) in enumerate(zip(ends - sizes, ends)):
    y[start:end] = x[start:end] @ w[e]
  return y


def rel(a, b):
  return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


@pytest.mark.parametrize("sizes", SIZES[:3])
def test_mosaic_fp8_gemm_with_stand_in_kernels_against_a_float32_loop(sizes):
  """Odd widths (D 40, F 200) exercise the padding; 3 rows past the groups."""
  sizes = np.asarray(sizes) * 2 + (np.arange(5) == 1)  # 25..50 rows
  rows = int(sizes.sum()) + 3
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (rows, 40))
  w = jax.random.normal(keys[1], (5, 40, 200))
  dy = jax.random.normal(keys[2], (rows, 200))
  gemm = grouped_fp8(mosaic_fp8_kernels(fake_rows, fake_contract))
  y, vjp = jax.vjp(lambda x, w: gemm(x, w, jnp.asarray(sizes)), x, w)
  dx, dw = vjp(dy)
  used = int(sizes.sum())
  dy_used = np.where(np.arange(rows)[:, None] < used, dy, 0)
  # FP8 rounding: a few percent; a wrong scale or expert: far more
  assert rel(y[:used], loop_reference(x, w, sizes)[:used]) < 0.05
  assert rel(dx[:used], loop_reference(dy_used, np.swapaxes(w, 1, 2), sizes)[:used]) < 0.12
  ends = np.cumsum(sizes)
  for e, (start, end) in enumerate(zip(ends - sizes, ends)):
    want = np.asarray(x[start:end], np.float64).T @ np.asarray(dy[start:end], np.float64)
    if end > start:
      assert rel(dw[e], want) < 0.12, e
    else:
      np.testing.assert_array_equal(dw[e], 0)
  np.testing.assert_array_equal(y[used:], 0)  # NaN from the stand-in, zeroed by the caller
  np.testing.assert_array_equal(dx[used:], 0)
  assert np.all(np.isfinite(dw))


def test_fp8_with_mosaic_runs_the_mosaic_kernels(monkeypatch):
  """precision.gemm=fp8 with moe.gemm=mosaic: the float8 kernels, not the bf16 ones, under the
  backend's own flags."""
  monkeypatch.setattr(kernels, "ragged_rows", fake_rows)
  monkeypatch.setattr(kernels, "aligned_contract", fake_contract)
  backend = grouped_gemm("mosaic", "e5m2", weight_gradient="fp8")
  assert backend.fp8 is GEMM_BACKENDS["mosaic"].fp8 is not None
  assert not backend.portable and not backend.keeps_varying_axes
  x, w, dy = jnp.ones((24, 128)), jnp.ones((3, 128, 64)), jnp.ones((24, 64))
  y, vjp = jax.vjp(lambda x, w: backend(x, w, jnp.asarray([8, 0, 12])), x, w)
  dx, dw = vjp(dy)
  np.testing.assert_allclose(y[:20], 128, rtol=1e-2)
  np.testing.assert_allclose(dx[:20], 64, rtol=1e-2)
  np.testing.assert_allclose(dw[0], 8, rtol=1e-2)
  np.testing.assert_allclose(dw[2], 12, rtol=1e-2)
  np.testing.assert_array_equal(dw[1], 0)
  assert y.dtype == x.dtype and dw.dtype == w.dtype


def test_the_blockwise_recipe_with_mosaic_runs_the_blockwise_kernel(monkeypatch):
  """precision.fp8_recipe=blockwise with moe.gemm=mosaic: the forward and the input gradient
  call the row kernel with tile scales (interpreted here), the weight gradient the 16-bit
  contraction."""
  calls = []
  real = kernels.ragged_rows

  def rows(a, b, table, scales=None, **kw):
    calls.append(("rows", a.dtype, scales is not None))
    return real(a, b, table, scales, **kw)

  def contract16(x, y, sizes):
    calls.append(("contract16", x.dtype, y.dtype))
    return fake_contract16(x, y, sizes)

  monkeypatch.setattr(kernels, "ragged_rows", rows)
  monkeypatch.setattr(mosaic_gemm, "ragged_contract", contract16)
  backend = grouped_gemm("mosaic", "e5m2", True)
  x, w, dy = jnp.ones((24, 128), jnp.bfloat16), jnp.ones((3, 128, 64)), jnp.ones((24, 64))
  y, vjp = jax.vjp(lambda x, w: backend(x, w, jnp.asarray([8, 0, 12])), x, w)
  dx, dw = vjp(dy.astype(jnp.bfloat16))
  assert calls == [("rows", jnp.float8_e4m3fn, True), ("rows", jnp.float8_e5m2, True),
                   ("contract16", jnp.bfloat16, jnp.bfloat16)]
  np.testing.assert_array_equal(y[:20], 128)
  np.testing.assert_array_equal(y[20:], 0)
  np.testing.assert_array_equal(dx[:20], 64)
  np.testing.assert_array_equal(dw[0], 8)
  np.testing.assert_array_equal(dw[1], 0)


def test_kernels_module_imports_without_a_gpu():
  assert callable(kernels.ragged_rows) and callable(kernels.aligned_contract)


def gpu_check():
  import pathlib
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
  try:
    import check_gpu_fp8
  finally:
    sys.path.pop(0)
  return check_gpu_fp8


@pytest.mark.parametrize("promote_from_k, promoted", [(None, [False, False]),
                                                     (256, [True, False]), (0, [True, True])])
def test_the_kernels_pass_the_gpu_check_in_the_gpu_interpreter(monkeypatch, promote_from_k,
                                                               promoted):
  """The kernels, interpreted, through scripts/check_gpu_fp8.py's kernel case and its end-to-end
  case (FP8 weight gradient: every kernel, no 16-bit one): three empty experts and 62 rows past
  the groups; a contraction of 640 (5 K steps, one more than the 4 in flight) in the forward and
  a 192-wide output (64-wide tiles), the input gradient's contraction padded from 192 to 256;
  three experts' rows in the first row block, the last expert's over 4 blocks. With the row
  kernels' sums promoted to float32 every K step too (the carried sum): in both calls, and in
  the forward alone, as `long` picks the calls by their contraction (here from 256). The
  interpreter's float32 sums leave the output's bf16 rounding as the whole error (1.66e-3 of
  3e-3 allowed)."""
  check = gpu_check()
  monkeypatch.setitem(check.SHAPES, "small", (6, 640, 192))
  c = check.quantized_case("small", "empty", 500, 2)
  sizes = c["sizes"]
  assert list(sizes) == [0, 39, 39, 0, 360, 0]
  got = check.kernel_case(c, promote_from_k)
  assert got["ok"] and got["promoted"] == promoted, got
  assert max(got["out"], got["dx"], got["dw_worst_expert"]) < 0.7 * check.FP8_TOLERANCE, got
  if promote_from_k is None:
    got = check.grouped_case(c, "fp8")
    assert got["ok"], got


@pytest.mark.parametrize("promote_from_k", [None, 0])
def test_a_wrong_kernel_fails_the_gpu_check_in_the_gpu_interpreter(monkeypatch, promote_from_k):
  """The same case fails with a kernel that stops one K step short (the interpreter runs what
  the kernel says, not what it should)."""
  check = gpu_check()
  monkeypatch.setitem(check.SHAPES, "small", (6, 640, 192))
  c = check.quantized_case("small", "empty", 500, 2)
  real = kernels.ragged_rows

  def short(a, b, table, *, block_k, **kw):  # the contraction's last K step left out
    return real(a[:, :-block_k], b[..., :-block_k], table, block_k=block_k, **kw)

  monkeypatch.setattr(kernels, "ragged_rows", short)
  got = check.kernel_case(c, promote_from_k)
  assert not got["ok"] and got["out"] > 10 * check.FP8_TOLERANCE, got


def test_the_blockwise_kernel_passes_the_gpu_check_in_the_gpu_interpreter(monkeypatch):
  """The row kernel with DeepSeek-V3's tile scales, interpreted, through scripts/check_gpu_fp8.py's
  blockwise case (tiles 2^-4 to 2^4 apart in magnitude; the forward's 5 K blocks, the input
  gradient's 2, the second partial); the same kernel reading each row's scale from the next K
  block fails it."""
  check = gpu_check()
  monkeypatch.setitem(check.SHAPES, "small", (6, 640, 192))
  c = check.quantized_case("small", "empty", 500, 2)
  got = check.blockwise_case(c)
  assert got["ok"], got
  assert max(got["out"], got["dx"]) < 0.7 * check.FP8_TOLERANCE, got
  real = kernels.ragged_rows

  def next_blocks_scales(a, b, table, scales, **kw):
    return real(a, b, table, (jnp.roll(scales[0], -1, axis=0), scales[1]), **kw)

  monkeypatch.setattr(kernels, "ragged_rows", next_blocks_scales)
  got = check.blockwise_case(c)
  assert not got["ok"] and got["out"] > 10 * check.FP8_TOLERANCE, got


def test_the_kernels_have_no_races_in_the_gpu_interpreter():
  """Pallas' GPU interpreter with its race detector (happens-before over the simulated threads,
  TMA units and barriers) finds no race in any kernel: the row kernel, promoted and with
  blockwise scales (whose row-scale reads need a fence before the TMA refills their slot:
  without it the detector reports races), and the weight gradient's."""
  import functools
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # (no public accessor)
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jmoe.ops.fp8_mosaic import (fp8_aligned_contract, fp8_blockwise_ragged_dot,
                                   fp8_ragged_dot)
  checked = plgpu.InterpretGPUParams(detect_races=True)
  rows = functools.partial(kernels.ragged_rows, interpret=checked)
  keys = jax.random.split(jax.random.key(3), 2)
  x = jax.random.normal(keys[0], (300, 384)).astype(jnp.float8_e4m3fn)
  w = jax.random.normal(keys[1], (3, 256, 384)).astype(jnp.float8_e4m3fn)
  sizes = jnp.asarray([100, 0, 190])
  runs = {"rows": lambda: fp8_ragged_dot(x, w, sizes, rows),
          "promoted": lambda: fp8_ragged_dot(x, w, sizes, rows, promote=True),
          "blockwise": lambda: fp8_blockwise_ragged_dot(x, jnp.ones((300, 3)), w,
                                                        jnp.ones((3, 2, 3)), sizes, rows),
          "contract": lambda: fp8_aligned_contract(
              x, x[:, :256], sizes, functools.partial(kernels.aligned_contract,
                                                      interpret=checked))}
  for name, run in runs.items():
    jax.block_until_ready(run())
    assert gpu_callbacks._races is not None and not gpu_callbacks._races.races_found, name


@pytest.mark.parametrize("promote", ["never", "long", "always"])
def test_fp8_promote_chooses_which_row_kernel_calls_promote_their_sums(monkeypatch, promote):
  """precision.fp8_promote: `never` no row-kernel call, `long` (the default) those contracting
  over PROMOTE_FROM_K or more, `always` every one; through moe.gemm=mosaic's FP8 GEMM, whose
  forward and input gradient both contract over the longer side here."""
  from jmoe.ops.fp8_mosaic import PROMOTE_FROM_K
  seen = []

  def rows(a, b, table, **kw):
    seen.append((a.shape[1], kw.get("promote", False)))
    return fake_rows(a, b, table, **kw)

  monkeypatch.setattr(kernels, "ragged_rows", rows)
  gemm = grouped_gemm("mosaic", "e5m2", False, "fp8", promote)
  for k in (PROMOTE_FROM_K - 128, PROMOTE_FROM_K):
    x, w = jnp.ones((8, k), jnp.bfloat16), jnp.ones((2, k, k), jnp.bfloat16)
    y = jax.jit(gemm)(x, w, jnp.asarray([3, 5]))
    np.testing.assert_array_equal(y, k)
  want = {"never": [False, False], "long": [False, True], "always": [True, True]}[promote]
  assert seen == list(zip((PROMOTE_FROM_K - 128, PROMOTE_FROM_K), want))
  assert tiny_config(precision=dict(gemm="fp8", fp8_promote=promote)).precision.fp8_promote == (
      promote)
  assert recipe_from_config(tiny_config(precision=dict(gemm="fp8")).precision).promote == "long"


def test_fp8_promote_refuses_other_values():
  with pytest.raises(ConfigError, match="precision.fp8_promote"):
    tiny_config(precision=dict(gemm="fp8", fp8_promote="sometimes"))


@pytest.mark.parametrize("f8", F8)
def test_the_kernels_lower_for_hopper(f8):
  """Both kernels, and the row kernel with promoted sums and with blockwise scales, through
  Mosaic GPU's lowering for CUDA on this CPU host (Mosaic's layout inference and lowering run):
  a Mosaic custom call in the lowered program, for either float8 format."""
  import functools
  blocks = dict(block_m=128, block_n=128, block_k=128, steps=4, grid_block_n=2,
                interpret=False)
  shape = jax.ShapeDtypeStruct
  rows = jax.jit(functools.partial(kernels.ragged_rows, **blocks)).trace(
      shape((1024, 512), f8), shape((4, 256, 512), jnp.float8_e4m3fn),
      shape((4, 11), jnp.int32)).lower(lowering_platforms=("cuda",))
  contract = jax.jit(functools.partial(kernels.aligned_contract, **blocks)).trace(
      shape((256, 1536), f8), shape((512, 1536), f8),
      shape((2, 4), jnp.int32)).lower(lowering_platforms=("cuda",))
  promoted = jax.jit(functools.partial(kernels.ragged_rows, **blocks, promote=True)).trace(
      shape((1024, 512), f8), shape((4, 256, 512), jnp.float8_e4m3fn),
      shape((4, 11), jnp.int32)).lower(lowering_platforms=("cuda",))
  blockwise = jax.jit(functools.partial(kernels.ragged_rows, **blocks)).trace(
      shape((1024, 512), f8), shape((4, 256, 512), jnp.float8_e4m3fn), shape((4, 11), jnp.int32),
      (shape((4, 1024), jnp.float32), shape((4, 2, 4), jnp.float32))).lower(
          lowering_platforms=("cuda",))
  for lowered in (rows, contract, promoted, blockwise):
    assert "custom_call @mosaic_gpu" in lowered.as_text()


def stand_in_case(monkeypatch):
  """(scripts/check_gpu_fp8.py, a case of it) with the stand-in kernels in place of the Mosaic
  ones: 6 experts of 256 x 192, empty ones among them, rows past the groups."""
  check = gpu_check()
  monkeypatch.setattr(kernels, "ragged_rows", fake_rows)
  monkeypatch.setattr(kernels, "aligned_contract", fake_contract)
  monkeypatch.setattr(mosaic_gemm, "ragged_contract", fake_contract16)
  monkeypatch.setitem(check.SHAPES, "small", (6, 256, 192))
  return check, check.quantized_case("small", "empty", 500, 2)


def test_the_gpu_check_passes_correct_kernels_and_fails_a_wrong_scale(monkeypatch):
  """scripts/check_gpu_fp8.py's cases with the stand-in kernels (float32 accumulation, one bf16
  rounding: what the kernels do) pass, well inside FP8_TOLERANCE; a kernel whose output is 2x
  on one expert's rows, or whose weight gradient misses a column block, fails."""
  check, c = stand_in_case(monkeypatch)
  assert not c["sizes"].all() and c["sizes"].sum() < 500  # empty experts, rows past the groups
  good = check.kernel_case(c)
  assert good["ok"], good
  assert max(good["out"], good["dx"], good["dw_worst_expert"]) < 0.7 * check.FP8_TOLERANCE
  assert check.grouped_case(c, "bf16")["ok"] and check.grouped_case(c, "fp8")["ok"]

  def doubled_rows(a, b, table, **kw):  # expert 2's rows scaled twice
    y = fake_rows(a, b, table, **kw)
    rows = np.cumsum(c["sizes"])
    return y.at[int(rows[1]):int(rows[2])].multiply(2)

  def short_contract(a, b, blocks, **kw):  # the last column block of each expert dropped
    return fake_contract(a, b, blocks.at[1].set(jnp.maximum(blocks[1] - 1, 0)), **kw)

  monkeypatch.setattr(kernels, "ragged_rows", doubled_rows)
  assert not check.kernel_case(c)["ok"]
  monkeypatch.setattr(kernels, "ragged_rows", fake_rows)
  monkeypatch.setattr(kernels, "aligned_contract", short_contract)
  assert not check.kernel_case(c)["ok"]


def test_a_bf16_weight_gradient_takes_the_dequantized_input_and_the_gradient_as_it_comes():
  """precision.fp8_weight_gradient=bf16: the forward and input gradient stay in FP8, the weight
  gradient is the 16-bit contraction of x as the forward quantized it (dequantized) with dy
  unquantized: equal to that sum per expert, far closer to the exact one than FP8's."""
  from jmoe.ops.fp8 import E4M3, amax, quantize, scale_for
  seen = []

  def contract16(x, y, sizes):
    seen.append((x.dtype, y.dtype))
    return grouped_contract(x, y, sizes)

  sizes = np.asarray([30, 0, 45, 12, 9])
  rows = int(sizes.sum()) + 3
  keys = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(keys[0], (rows, 40))
  w = jax.random.normal(keys[1], (5, 40, 200))
  dy = jax.random.normal(keys[2], (rows, 200))
  kernels_ = mosaic_fp8_kernels(fake_rows, fake_contract, contract16)
  dws = {}
  for which in ("bf16", "fp8"):
    gemm = grouped_fp8(kernels_, weight_gradient=which)
    _, vjp = jax.vjp(lambda x, w: gemm(x, w, jnp.asarray(sizes)), x, w)
    dws[which] = np.asarray(vjp(dy)[1], np.float64)
  assert seen and all(d == (jnp.float32, jnp.float32) for d in seen)
  scale = scale_for(amax(x, axis=1, keepdims=True), E4M3)
  x_deq = np.asarray(quantize(x, scale, E4M3).astype(jnp.float32) * scale, np.float64)
  ends = np.cumsum(sizes)
  for e, (start, end) in enumerate(zip(ends - sizes, ends)):
    if end == start:
      np.testing.assert_array_equal(dws["bf16"][e], 0)
      continue
    exact = np.asarray(x[start:end], np.float64).T @ np.asarray(dy[start:end], np.float64)
    np.testing.assert_allclose(dws["bf16"][e], x_deq[start:end].T @ np.asarray(
        dy[start:end], np.float64), rtol=1e-5, atol=1e-4)
    assert rel(dws["bf16"][e], exact) < 0.5 * rel(dws["fp8"][e], exact), e


def test_auto_weight_gradient_goes_by_the_experts_mean_rows():
  """precision.fp8_weight_gradient=auto: the float8 weight gradient for experts of at least
  FP8_WEIGHT_GRADIENT_ROWS rows each under balanced routing (dispatch's static mean, not the
  rows buffer, which the all-gather dispatcher fills with other devices' rows), the 16-bit one
  below; the rows past per-expert blocks take the latter."""
  from jmoe.moe.dispatch import Rows
  from jmoe.moe.experts import ExpertCompute, ExpertWeights
  from jmoe.ops.fp8_grouped import FP8_WEIGHT_GRADIENT_ROWS as ROWS, weight_gradient_for
  assert [weight_gradient_for("auto", r) for r in (ROWS - 0.5, ROWS)] == ["bf16", "fp8"]
  assert weight_gradient_for("bf16", 1e9) == "bf16" and weight_gradient_for("fp8", 1) == "fp8"

  class Cfg:
    gemm, activation, swiglu_limit, swiglu_alpha, expert_blocks = "ragged_dot", "swiglu", 0, 0, 0

  auto = ExpertCompute.from_config(Cfg, "e5m2", False, "auto")
  assert auto.grouped is grouped_gemm("ragged_dot", "e5m2", False, "fp8", "long")
  assert auto.grouped_few_rows is grouped_gemm("ragged_dot", "e5m2", False, "bf16", "long")
  assert ExpertCompute.from_config(Cfg, "e5m2", False, "fp8").grouped_few_rows is None
  used = []
  gemm = lambda name: (lambda x, w, sizes, quantized=None: used.append(name) or x @ w[0])
  compute = dataclasses.replace(auto, grouped=gemm("fp8"), grouped_few_rows=gemm("bf16"))
  weights = ExpertWeights(w_in_ED2F=jnp.ones((2, 4, 2, 4)), w_out_EFD=jnp.ones((2, 4, 4)))
  for mean, want in ((ROWS - 1, "bf16"), (ROWS, "fp8")):
    rows = Rows(x_XD=jnp.ones((6, 4)), group_sizes_E=jnp.asarray([3, 3]),
                mean_rows_per_expert=mean)
    used.clear()
    compute(rows, weights, None)
    assert used == [want, want]


def test_the_float8_weight_copies_are_not_held_from_the_forward_pass_to_the_backward():
  """Each layer's weights are quantized in its forward pass and again in its backward pass;
  XLA must not keep the forward's float8 copy for the backward (it would, merging the two
  identical quantizations, or scheduling the backward's early): the step's temporaries would
  then grow by a weight copy per layer, about 4.5 GiB on the Qwen3-30B-A3B bench by its shapes.
  4 more layers with bf16 parameters: 5.0 copies' worth before, 1.0 now (the layers' own
  activations and buffer packing). With float32 ones, no more than the 16-bit GEMM holds."""
  gemm = grouped_fp8(mosaic_fp8_kernels(opaque(fake_rows), opaque(fake_contract),
                                        fake_contract16), weight_gradient="bf16")
  assert weight_copies_grown(gemm, more_layers=4) < 2
  assert (weight_copies_grown(gemm, more_layers=4, param_dtype=jnp.float32)
          < weight_copies_grown(opaque(sixteen_bit), more_layers=4, param_dtype=jnp.float32))


def test_the_gpu_checks_of_the_fused_swiglu_pass_and_fail_a_wrong_kernel(monkeypatch):
  """scripts/check_gpu_fp8.py's SwiGLU cases: with the stand-in GEMM kernels the fused op
  passes end to end (both weight gradients), the SwiGLU kernels (interpreted) match XLA's
  arithmetic exactly; a forward kernel with its scales off fails, and a backward kernel that
  writes up's gradient where gate's goes fails both."""
  import jmoe.ops.fp8_grouped as grouped
  import jmoe.ops.fp8_swiglu as fused
  check, c = stand_in_case(monkeypatch)
  for weight_gradient in ("bf16", "fp8"):
    got = check.gated_case(c, weight_gradient)
    assert got["ok"], got
  real, auto = fused.swiglu_grad_quantized, fused._path
  # the kernels' path (None), as on the GPU, through Pallas' interpreter
  monkeypatch.setattr(fused, "_path",
                      lambda h, path: "interpret" if path is None else auto(h, path))
  got = check.swiglu_case(c, reps=0)
  assert got["ok"] and got["dh_q_differing"] == got["folded_q_differing"] == 0, got
  assert got["forward_q_differing"] == got["forward_scale"] == 0, got
  # a forward kernel whose row scales are off by a rounding's worth of bits fails
  forward = fused._forward_call
  monkeypatch.setattr(fused, "_forward_call",
                      lambda *a, **k: (lambda q, s: (q, s * (1 + 2**-10)))(*forward(*a, **k)))
  assert not check.swiglu_case(c, reps=0)["ok"]
  monkeypatch.setattr(fused, "_forward_call", forward)

  def swapped(*args, path=None, **kwargs):  # the kernels' gate and up halves exchanged
    outs = real(*args, path=path, **kwargs)
    if path == "xla":
      return outs
    return tuple(None if v is None else jnp.roll(v, v.shape[1] // 2, axis=1) for v in outs)

  monkeypatch.setattr(fused, "swiglu_grad_quantized", swapped)
  assert not check.swiglu_case(c, reps=0)["ok"]
  monkeypatch.setattr(grouped, "swiglu_grad_quantized", swapped)
  jax.clear_caches()
  assert not check.gated_case(c, "fp8")["ok"]
