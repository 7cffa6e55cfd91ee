"""jmoe's Triton transpose for the FP8 GEMMs' operands (jmoe/ops/fp8_transpose.py), run through
Pallas' interpreter on CPU, against XLA's gather and transpose bit for bit. Its speed on the GPU
is timed by scripts/check_gpu_fp8.py --bench (the weight gradient, which it feeds)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmoe.ops.fp8 import E4M3, E5M2, quantize
from jmoe.ops.fp8_mosaic import group_aligned_columns
from jmoe.ops.fp8_transpose import transpose_experts, transpose_rows


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


def test_reads_the_rows_in_order_without_a_source():
  x = jax.random.normal(jax.random.key(1), (130, 257), jnp.bfloat16)
  same_bits(transpose_rows(x), x.T)


@pytest.mark.parametrize("out_dtype", [E4M3, E5M2])
def test_quantizes_as_jmoe_quantizes(out_dtype):
  """Divide by the scale, saturate, round to nearest even: the bits of jmoe.ops.fp8.quantize,
  with values past the format's range (a scale too small) clipped, not infinite."""
  x = jax.random.normal(jax.random.key(2), (200, 150), jnp.bfloat16) * 3
  source = jnp.asarray(np.r_[np.arange(0, 90), [200] * 38, np.arange(90, 200)], jnp.int32)
  for scale in (jnp.float32(0.013), jnp.float32(1e-4)):
    out = transpose_rows(x, source, scale, out_dtype)
    same_bits(out, gathered(quantize(x, scale, out_dtype), source))
  assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()


def test_each_expert_gets_its_own_scale():
  w = jax.random.normal(jax.random.key(3), (3, 96, 200), jnp.bfloat16)
  scales = jnp.asarray([0.01, 0.002, 0.5], jnp.float32)
  out = transpose_experts(w, scales, E4M3)
  same_bits(out, jnp.swapaxes(quantize(w, scales[:, None, None], E4M3), 1, 2))


def test_a_wrong_row_would_be_seen():
  """The comparison above is not vacuous: one row read from its neighbour differs."""
  x = jax.random.normal(jax.random.key(4), (64, 32), jnp.bfloat16)
  source = jnp.arange(64, dtype=jnp.int32)
  with pytest.raises(AssertionError):
    same_bits(transpose_rows(x, source), gathered(x, source.at[5].set(6)))
