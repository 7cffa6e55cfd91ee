"""Blockwise FP8 scaling (precision.fp8_recipe=blockwise): tile quantization against a direct NumPy
computation, the grouped GEMM on blockwise operands against a float64 loop, and the config."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jmoe.config import ConfigError
from jmoe.ops.fp8 import recipe_from_config
from jmoe.ops.fp8_blockwise import (BlockwiseKernels, blockwise_grouped, dequantize_blocks,
                                    quantize_blocks)
from jmoe.ops.grouped_gemm import GEMM_BACKENDS, grouped_gemm
from helpers import grouped_contract, opaque, sixteen_bit, tiny_config, weight_copies_grown

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def numpy_blocks(x, tile, got_scale, dtype=E4M3):
  """(q, scale) of a 2-D array in tiles of `tile` = (rows, cols), partial tiles at the ends; q
  from `got_scale`, the scales under test, once those are checked to be the tiles' (XLA divides
  by the constant 448 as a multiply by its inverse: the last bit may differ)."""
  x = np.asarray(x, np.float32)
  limit = np.float32(ml_dtypes.finfo(dtype).max)
  rows, cols = -(-x.shape[0] // tile[0]), -(-x.shape[1] // tile[1])
  q, scale = np.zeros(x.shape, dtype), np.zeros((rows, cols), np.float32)
  for i in range(rows):
    for j in range(cols):
      part = x[i * tile[0]:(i + 1) * tile[0], j * tile[1]:(j + 1) * tile[1]]
      scale[i, j] = np.maximum(np.abs(part).max(), np.float32(1e-12)) / limit
      q[i * tile[0]:(i + 1) * tile[0], j * tile[1]:(j + 1) * tile[1]] = np.clip(
          part / np.float32(got_scale[i, j]), -limit, limit).astype(dtype)
  np.testing.assert_allclose(got_scale, scale, rtol=2e-7)
  return q, np.asarray(got_scale)


def test_activation_tiles_are_1_by_128_and_weight_tiles_128_by_128():
  keys = jax.random.split(jax.random.key(0), 2)
  x = jax.random.normal(keys[0], (5, 300)) * jnp.arange(1, 301)  # a partial tile at the end
  w = jax.random.normal(keys[1], (2, 200, 260))
  x_q, s_x = quantize_blocks(x, (1,))
  assert x_q.shape == (5, 300) and s_x.shape == (5, 3) and s_x.dtype == jnp.float32
  q, s = numpy_blocks(x, (1, 128), s_x)
  np.testing.assert_array_equal(np.asarray(x_q).astype(np.float32), q.astype(np.float32))
  np.testing.assert_array_equal(dequantize_blocks(x_q, s_x, (1,)),
                                q.astype(np.float32) * np.repeat(s, 128, axis=1)[:, :300])
  w_q, s_w = quantize_blocks(w, (1, 2), E5M2)
  assert w_q.shape == w.shape and s_w.shape == (2, 2, 3)
  for e in range(2):
    q, s = numpy_blocks(w[e], (128, 128), s_w[e], E5M2)
    np.testing.assert_array_equal(np.asarray(w_q[e]).astype(np.float32), q.astype(np.float32))
    full = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:200, :260]
    np.testing.assert_array_equal(dequantize_blocks(w_q, s_w, (1, 2))[e],
                                  q.astype(np.float32) * full)


def test_an_outlier_costs_precision_only_in_its_own_tile():
  x = np.array(jax.random.normal(jax.random.key(1), (4, 256)))
  x[0, 3] = 1e6  # E4M3 spans 2^17: values 1e6 times smaller fall below its smallest
  back = np.asarray(dequantize_blocks(*quantize_blocks(jnp.asarray(x), (1,)), (1,)))
  rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
  assert rel(back[1:], x[1:]) < 0.05 and rel(back[0, 128:], x[0, 128:]) < 0.05
  assert rel(back[0, 4:128], x[0, 4:128]) > 0.3  # its tile's small values flush to ~zero


def loop(x, w, sizes):
  ends = np.cumsum(sizes)
  y = np.zeros((x.shape[0], w.shape[2]))
  for e, (start, end) in enumerate(zip(ends - sizes, ends)):
    y[start:end] = x[start:end] @ w[e]
  return y


def round_trip(a, axes, dtype=E4M3):
  return np.asarray(dequantize_blocks(*quantize_blocks(jnp.asarray(a), axes, dtype), axes),
                    np.float64)


def test_blockwise_grouped_gemm_multiplies_the_recipes_values():
  sizes = np.array([50, 0, 70, 30])  # an empty expert, 10 rows past the groups
  keys = jax.random.split(jax.random.key(2), 3)
  x, w, dy = (jax.random.normal(k, s) for k, s in zip(keys, [(160, 200), (4, 200, 150),
                                                            (160, 150)]))
  gemm = blockwise_grouped(GEMM_BACKENDS["ragged_dot"].gemm, "e5m2")
  y, vjp = jax.vjp(lambda x, w: gemm(x, w, jnp.asarray(sizes)), x, w)
  dx, dw = vjp(dy)
  xq, wq = round_trip(x, (1,)), round_trip(w, (1, 2))
  dyq = round_trip(dy, (1,), E5M2)
  dyq[150:] = 0  # rows past the groups carry no gradient
  np.testing.assert_allclose(y, loop(xq, wq, sizes), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(dx, loop(dyq, np.swapaxes(wq, 1, 2), sizes), rtol=1e-5, atol=1e-4)
  ends = np.cumsum(sizes)
  for e, (start, end) in enumerate(zip(ends - sizes, ends)):
    np.testing.assert_allclose(dw[e], xq[start:end].T @ dyq[start:end], rtol=1e-5, atol=1e-4)
  assert np.abs(np.asarray(y) - loop(np.asarray(x), np.asarray(w), sizes)).max() > 1e-2  # FP8


def test_blockwise_kernels_multiply_the_recipes_values():
  """moe.gemm=mosaic's blockwise path: the forward and input gradient in jmoe's row kernel (run
  by Pallas' Mosaic-GPU interpreter) on the float8 tiles and their scales, the weight gradient
  in the 16-bit contraction (a float32 stand-in here) on the dequantized tiles: the same values
  as the recipe's loop up to the kernel's one bf16 rounding of its output; rows past the groups
  and an empty expert's gradient zero. Tiles of different magnitudes, two K blocks, a partial
  one and a partial output tile."""
  from jmoe.ops.fp8_mosaic import mosaic_blockwise_kernels
  sizes = np.array([50, 0, 70, 30])  # an empty expert, 10 rows past the groups
  keys = jax.random.split(jax.random.key(2), 3)
  x, w, dy = (jax.random.normal(k, s) for k, s in zip(keys, [(160, 200), (4, 200, 150),
                                                            (160, 150)]))
  x = x * jnp.repeat(2.0 ** jnp.arange(-2, 3), 32)[:160, None] * jnp.array([1.0] * 128 + [8.0] * 72)
  w = w * jnp.array([0.25] * 128 + [4.0] * 72)[None, :, None]
  gemm = blockwise_grouped(GEMM_BACKENDS["ragged_dot"].gemm, "e5m2",
                           mosaic_blockwise_kernels(contract16=grouped_contract))
  y, vjp = jax.vjp(lambda x, w: gemm(x, w, jnp.asarray(sizes)), x, w)
  dx, dw = vjp(dy)
  xq, wq = round_trip(x, (1,)), round_trip(w, (1, 2))
  dyq = round_trip(dy, (1,), E5M2)
  dyq[150:] = 0  # rows past the groups carry no gradient
  rel = lambda a, b: np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)
  assert rel(y[:150], loop(xq, wq, sizes)[:150]) < 3e-3
  assert rel(dx[:150], loop(dyq, np.swapaxes(wq, 1, 2), sizes)[:150]) < 3e-3
  np.testing.assert_array_equal(y[150:], 0)
  np.testing.assert_array_equal(dx[150:], 0)
  ends = np.cumsum(sizes)
  for e, (start, end) in enumerate(zip(ends - sizes, ends)):
    np.testing.assert_allclose(dw[e], xq[start:end].T @ dyq[start:end], rtol=1e-5, atol=1e-4)
  assert np.abs(np.asarray(y) - loop(np.asarray(x), np.asarray(w), sizes)).max() > 1e-2  # FP8


def test_blockwise_recipe_config():
  config = tiny_config(precision=dict(gemm="fp8", fp8_recipe="blockwise"),
                       moe=dict(expert_blocks=0))
  recipe = recipe_from_config(config.precision)
  assert recipe.blockwise and not recipe.delayed
  assert grouped_gemm("ragged_dot", "e5m2", True) is not grouped_gemm("ragged_dot", "e5m2")
  with pytest.raises(ConfigError, match="fp8_recipe=blockwise .*fp8_experts=true"):
    tiny_config(precision=dict(gemm="fp8", fp8_recipe="blockwise", fp8_experts=False),
                moe=dict(expert_blocks=0))
  with pytest.raises(ConfigError, match="moe.expert_blocks=0"):
    tiny_config(precision=dict(gemm="fp8", fp8_recipe="blockwise"), moe=dict(expert_blocks=1.25))


def test_a_blockwise_step_follows_bf16():
  from test_train import first_step
  moe, model = dict(expert_blocks=0, first_k_dense=0), dict(num_layers=1)
  base = dict(params="float32", compute="bfloat16")
  bf16, _ = first_step(tiny_config(model=model, precision=base, moe=moe), jax.devices()[:1])
  fp8, _ = first_step(tiny_config(model=model, moe=moe, precision=dict(
      base, gemm="fp8", fp8_recipe="blockwise")), jax.devices()[:1])
  np.testing.assert_allclose(fp8["loss"], bf16["loss"], rtol=1e-2)
  assert fp8["loss"] != bf16["loss"]


def test_the_weights_blockwise_copies_are_not_held_from_the_forward_pass_to_the_backward():
  """The backward pass quantizes and dequantizes the weights again rather than keeping the
  forward's float8 copy (or, merged with the forward's by XLA, its dequantized bf16 one) for
  every layer: 4 more layers grew the temporaries by 5.1 float8 weight copies that way, by none
  now (bf16 parameters; the 16-bit GEMM stands in opaque, as a GPU kernel reads its operands)."""
  assert weight_copies_grown(blockwise_grouped(opaque(sixteen_bit)), more_layers=4) < 1


def test_the_blockwise_kernels_path_holds_no_weight_copies_either():
  """With blockwise kernels (moe.gemm=mosaic) too, the backward pass quantizes the weights again
  from their kept tile scales: 4 more layers grow the temporaries by less than one float8
  weight copy (the kernels stand in opaque: a GPU kernel reads its operands from memory)."""
  def dot(a, a_scale, b, b_scale, sizes):
    a, a_scale, b, b_scale = jax.lax.optimization_barrier((a, a_scale, b, b_scale))
    a = dequantize_blocks(a, a_scale, (1,), jnp.bfloat16)
    b = dequantize_blocks(b, b_scale, (1, 2), jnp.bfloat16)
    return sixteen_bit(a, jnp.swapaxes(b, 1, 2), sizes)

  kernels = BlockwiseKernels(dot=dot, contract16=opaque(grouped_contract))
  assert weight_copies_grown(blockwise_grouped(opaque(sixteen_bit), kernels=kernels),
                             more_layers=4) < 1
