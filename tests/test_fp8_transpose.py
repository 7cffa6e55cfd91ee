"""jmoe's Triton transpose for the FP8 weight gradient's operands (jmoe/ops/fp8_transpose.py),
run through Pallas' interpreter on CPU, against XLA's gather and transpose bit for bit. On the
GPU: scripts/check_gpu_fp8.py (`fp8_transpose` cases, and the weight gradient it feeds)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmoe.ops.fp8 import E4M3, E5M2
from jmoe.ops.fp8_mosaic import group_aligned_columns
from jmoe.ops.fp8_transpose import transpose_rows, xla_transpose_rows


def same_bits(a, b):
  assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
  width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
  np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(a, width)),
                                np.asarray(jax.lax.bitcast_convert_type(b, width)))


def gathered(x, source):
  return jnp.take(x, source, axis=0, mode="fill", fill_value=0).T


@pytest.mark.parametrize("dtype", [jnp.bfloat16, E4M3, E5M2])
@pytest.mark.parametrize("sizes", [[70, 0, 129, 1, 100], [0, 300, 0, 0, 0], [0, 0, 0, 0, 0]])
def test_gathers_each_experts_rows_into_aligned_columns(dtype, sizes):
  """Rows in the weight gradient's group-aligned order, gap columns zero; 300 rows and 200
  columns leave partial tiles on every side of the 128 x 128 blocks."""
  x = jax.random.normal(jax.random.key(0), (300, 200), jnp.float32).astype(dtype)
  source, _ = group_aligned_columns(jnp.asarray(sizes), 300, 128)
  out = transpose_rows(x, source)
  same_bits(out, gathered(x, source))
  assert not np.any(np.asarray(out.astype(jnp.float32))[:, np.asarray(source) >= 300])


def test_negative_and_past_the_end_sources_give_zero_columns():
  x = jax.random.normal(jax.random.key(1), (130, 257), jnp.bfloat16)
  source = jnp.asarray([3, -1, 129, 130, 500, 0], jnp.int32)
  out = np.asarray(transpose_rows(x, source).astype(jnp.float32))
  np.testing.assert_array_equal(out[:, [0, 2, 5]], np.asarray(x.astype(jnp.float32))[[3, 129, 0]].T)
  assert not out[:, [1, 3, 4]].any()
  same_bits(xla_transpose_rows(x, source), transpose_rows(x, source))  # the fallback agrees


def test_operands_past_32_bit_offsets_and_empty_ones_take_xla(monkeypatch):
  """Pallas' Triton lowering would address elements past 2^31 at negative offsets, so larger
  operands (here: a limit lowered to 1,000 elements) and empty ones take XLA's gather."""
  import jmoe.ops.fp8_transpose as module
  x = jax.random.normal(jax.random.key(2), (40, 30), jnp.bfloat16)
  source = jnp.arange(40, dtype=jnp.int32)[::-1]
  traced = lambda: str(jax.make_jaxpr(lambda x, s: transpose_rows(x, s))(x, source))
  assert "pallas_call" in traced()
  monkeypatch.setattr(module, "MAX_ELEMENTS", 1000)
  assert "pallas_call" not in traced() and "gather" in traced()
  same_bits(transpose_rows(x, source), gathered(x, source))
  assert transpose_rows(x, source[:0]).shape == (30, 0)


def test_a_wrong_row_would_be_seen():
  """The comparison above is not vacuous: one row read from its neighbour differs."""
  x = jax.random.normal(jax.random.key(4), (64, 32), jnp.bfloat16)
  source = jnp.arange(64, dtype=jnp.int32)
  with pytest.raises(AssertionError):
    same_bits(transpose_rows(x, source), gathered(x, source.at[5].set(6)))


def test_the_gpu_check_compares_the_bytes(monkeypatch):
  """scripts/check_gpu_fp8.py's transpose case passes the kernel (interpreted here) and fails a
  kernel whose columns are one place off."""
  import pathlib
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
  try:
    import check_gpu_fp8 as check
  finally:
    sys.path.pop(0)
  case = check.quantized_case("odd", "empty", 300, 0)
  assert check.transpose_case(case)["ok"]
  import jmoe.ops.fp8_transpose as module
  right = module.transpose_rows
  monkeypatch.setattr(module, "transpose_rows", lambda x, s: jnp.roll(right(x, s), 1, axis=1))
  result = check.transpose_case(case)
  assert not result["ok"] and result["x_q_differing_bytes"] > 0
