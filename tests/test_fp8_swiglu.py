"""SwiGLU's backward pass with its FP8 quantization (jmoe/ops/fp8_swiglu.py) and the experts' first
projection fused with SwiGLU (`grouped_fp8_swiglu`): the Triton kernels, run in Pallas'
interpreter, against their XLA form bit for bit; that form against autodiff; the fused op
against the projection and SwiGLU run apart."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmoe.moe.experts import ExpertWeights, expert_ffn, gated_activation
from jmoe.ops.activations import swiglu
from jmoe.ops.fp8 import E4M3, E5M2, scale_for
from jmoe.ops.fp8_grouped import grouped_fp8, grouped_fp8_swiglu
from jmoe.ops.fp8_swiglu import (round_to_bf16, swiglu_grad_amax, swiglu_grad_quantized,
                                 swiglu_quantized, xla_swiglu_grad)
from jmoe.ops.grouped_gemm import GEMM_BACKENDS, grouped_gemm
from helpers import grouped_contract, tiny_config


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def operands(rows, f, invalid=3, seed=0):
  """h [rows, 2F] as a kernel wrote it (NaN in the rows past the groups, which a kernel may
  leave unwritten), row scales, the hidden's gradient, and which rows are valid."""
  keys = jax.random.split(jax.random.key(seed), 3)
  h = (jax.random.normal(keys[0], (rows, 2 * f)) * 3).astype(jnp.bfloat16)
  h = h.at[rows - invalid:].set(jnp.nan)
  scale = jax.random.uniform(keys[1], (rows,), minval=0.5, maxval=2.0)
  d = (jax.random.normal(keys[2], (rows, f)) * 1e-3).astype(jnp.bfloat16)
  return h, scale, d, jnp.arange(rows) < rows - invalid


@pytest.mark.parametrize("rows,f", [(37, 300), (16, 768)])
def test_forward_kernel_matches_its_xla_form_and_quantizes_as_the_down_projection(rows, f):
  """`swiglu_quantized` in Pallas' interpreter: every float8 byte and row scale of the hidden
  equal XLA's; those are the down projection's own quantization of the bf16 hidden
  (`quantize_rows`), which it returns; rows past the groups are zeros."""
  from jmoe.ops.fp8_grouped import quantize_rows
  h, scale, _, valid = operands(rows, f)
  (q, s, hidden), (q_xla, s_xla, hidden_xla) = (
      swiglu_quantized(h, scale, valid, path=p) for p in ("interpret", "xla"))
  bits = lambda v: np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8))
  np.testing.assert_array_equal(bits(q), bits(q_xla))
  np.testing.assert_array_equal(s, s_xla)
  q_rows, s_rows = quantize_rows(hidden)
  np.testing.assert_array_equal(bits(q), bits(q_rows))
  np.testing.assert_array_equal(s, s_rows[:, 0])
  assert hidden.dtype == jnp.bfloat16 and np.all(np.asarray(q, np.float32)[rows - 3:] == 0)
  # the hidden is silu(gate) * up
  g, u = (np.asarray(h[:rows - 3, i * f:(i + 1) * f], np.float32) * np.asarray(scale)[
      :rows - 3, None] for i in (0, 1))
  want = g / (1 + np.exp(-g)) * u
  assert rel(np.asarray(hidden[:rows - 3], np.float32), want) < 4e-3


@pytest.mark.parametrize("rows,f,dtype", [(37, 300, E5M2), (16, 768, E4M3)])
def test_kernels_match_their_xla_form_bit_for_bit(rows, f, dtype):
  """In Pallas' interpreter, on rows and columns that fill no whole tile (37 rows of 300) and on
  Qwen3-30B-A3B's F (768, 256-wide tiles): every row amax, every float8 byte of dh quantized
  per row and of dh folded under one scale, and dh in bf16, equal XLA's; rows past the groups
  (NaN in h) give zeros."""
  made = operands(rows, f)
  amaxes = [swiglu_grad_amax(*made, path=p) for p in ("xla", "interpret")]
  np.testing.assert_array_equal(*amaxes)
  assert np.all(amaxes[0][rows - 3:] == 0) and np.all(amaxes[0][:rows - 3] > 0)
  q_scale = scale_for(amaxes[0], dtype)
  fold = (made[1], scale_for(jnp.max(amaxes[0] * made[1]), dtype))
  outs = [swiglu_grad_quantized(*made, q_scale, dtype, fold=fold, with_bf16=True, path=p)
          for p in ("xla", "interpret")]
  for ours, xla in zip(outs[1], outs[0]):
    assert ours.dtype == xla.dtype
    np.testing.assert_array_equal(jax.lax.bitcast_convert_type(ours, jnp.uint8 if
                                  ours.dtype.itemsize == 1 else jnp.uint16),
                                  jax.lax.bitcast_convert_type(xla, jnp.uint8 if
                                  xla.dtype.itemsize == 1 else jnp.uint16))
  dh_q = np.asarray(outs[1][0].astype(jnp.float32))
  assert np.all(dh_q[rows - 3:] == 0)
  # each valid row's largest value lands on the format's largest: the row scale is its own
  assert np.allclose(np.abs(dh_q[:rows - 3]).max(axis=1), float(jnp.finfo(dtype).max))


def test_the_xla_form_is_swiglus_derivative():
  """dh against autodiff of silu(gate) * up in float32 on the same bf16 gate and up."""
  h, scale, d, valid = operands(40, 64)
  dh = xla_swiglu_grad(h, scale, d, valid)
  g = jnp.where(valid[:, None], round_to_bf16(h.astype(jnp.float32) * scale[:, None]), 0)
  _, vjp = jax.vjp(lambda g, u: jax.nn.silu(g) * u, g[:, :64], g[:, 64:])
  want = jnp.concatenate(vjp(jnp.where(valid[:, None], d, 0).astype(jnp.float32)), axis=1)
  np.testing.assert_allclose(dh, want, rtol=1e-5, atol=1e-9)


def test_round_to_bf16_is_round_to_nearest_even():
  x = jax.random.normal(jax.random.key(1), (4096,)) * 10.0 ** jax.random.uniform(
      jax.random.key(2), (4096,), minval=-20, maxval=20)
  ties = jnp.asarray([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], jnp.float32)  # halfway cases
  for v in (x, ties):
    np.testing.assert_array_equal(round_to_bf16(v), v.astype(jnp.bfloat16).astype(jnp.float32))


KERNELS = GEMM_BACKENDS["ragged_dot"].fp8


@pytest.mark.parametrize("weight_gradient", ["fp8", "bf16"])
def test_fused_projection_and_swiglu_against_float32_and_them_apart(weight_gradient):
  """`grouped_fp8_swiglu` and `grouped_fp8` followed by SwiGLU against float32 autodiff of the
  unquantized FFN, on an expert with no rows and rows past the groups: the forwards agree
  within a bf16 rounding of h (they apply the row and expert scales in another order); the
  fused gradients are within FP8's own error (tests/test_fp8.py's tolerances) and no worse than
  apart, where dh was quantized from bf16 values made op by op. (The two differ by a few
  percent where an element's float32 and bf16 values round to neighbouring float8 values.)
  Zeros past the groups and for the empty expert."""
  sizes = jnp.asarray([5, 0, 9, 3, 7])
  keys = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(keys[0], (30, 32)).astype(jnp.bfloat16)
  w = (jax.random.normal(keys[1], (5, 32, 48)) * 32 ** -0.5).astype(jnp.bfloat16)
  d = jax.random.normal(keys[2], (30, 24)).astype(jnp.bfloat16)
  # the 16-bit weight gradient through a float32 stand-in for a kernel's contraction
  kernels = dataclasses.replace(KERNELS, contract16=grouped_contract)
  fused = grouped_fp8_swiglu(kernels, "e5m2", weight_gradient)
  apart = grouped_fp8(kernels, "e5m2", weight_gradient)
  exact = GEMM_BACKENDS["ragged_dot"]
  runs = []
  for fn, args in ((lambda x, w: fused(x, w, sizes)[0], (x, w)),
                   (lambda x, w: swiglu(*jnp.split(apart(x, w, sizes), 2, axis=1)), (x, w)),
                   (lambda x, w: swiglu(*jnp.split(exact(x, w, sizes), 2, axis=1)),
                    (x.astype(jnp.float32), w.astype(jnp.float32)))):
    y, vjp = jax.vjp(fn, *args)
    runs.append((y, *vjp(d.astype(y.dtype))))
  used = int(sizes.sum())
  (y, dx, dw), (y_apart, dx_apart, dw_apart), (y_ref, dx_ref, dw_ref) = runs
  # The fused op rounds the hidden to bf16 once (XLA's bf16 SwiGLU rounds silu(gate), then the
  # product): a bf16 rounding's worth apart, and no farther from float32.
  assert rel(y[:used], y_apart[:used]) < 6e-3
  assert rel(y[:used], y_ref[:used]) <= rel(y_apart[:used], y_ref[:used])
  # silu(gate) * up carries both halves' FP8 errors: above one GEMM's 5%
  assert rel(y[:used], y_ref[:used]) < 0.08
  for ours, theirs, want in ((dx[:used], dx_apart[:used], dx_ref[:used]), (dw, dw_apart, dw_ref)):
    assert 1e-3 < rel(ours, want) < 0.12
    assert rel(ours, want) < 1.1 * rel(theirs, want)
  np.testing.assert_array_equal(y[used:], 0)
  np.testing.assert_array_equal(dx[used:], 0)
  np.testing.assert_array_equal(dw[1], 0)


def test_expert_ffn_takes_the_fused_op_for_swiglu_only():
  """In FP8 the experts' SwiGLU FFN runs the fused op, and gives what the projection and SwiGLU
  apart give; GPT-OSS's clamped SwiGLU (and biases) run them apart."""
  calls = []
  gemm = grouped_gemm("ragged_dot", "e5m2", weight_gradient="fp8")
  spy = dataclasses.replace(gemm, swiglu=lambda *a: calls.append(1) or gemm.swiglu(*a))
  sizes = jnp.asarray([6, 2, 0, 8])
  keys = jax.random.split(jax.random.key(5), 3)
  x = jax.random.normal(keys[0], (20, 16)).astype(jnp.bfloat16)
  weights = ExpertWeights(
      w_in_ED2F=(jax.random.normal(keys[1], (4, 16, 2, 24)) * 0.25).astype(jnp.bfloat16),
      w_out_EFD=(jax.random.normal(keys[2], (4, 24, 16)) * 0.2).astype(jnp.bfloat16))
  y = expert_ffn(x, sizes, weights, spy, swiglu)
  assert calls == [1]
  y_apart = expert_ffn(x, sizes, weights, dataclasses.replace(gemm, swiglu=None), swiglu)
  assert rel(y[:16], y_apart[:16]) < 1e-2
  clamped = gated_activation(tiny_config(moe=dict(activation="clamped_swiglu")).moe)
  expert_ffn(x, sizes, weights, spy, clamped)
  assert calls == [1]


@pytest.mark.parametrize("remat", ["full", "attention_moe_experts"])
def test_fp8_model_with_remat_equals_it_without(remat):
  """The fused op under recomputation (the whole layer again, or the experts' hidden saved by
  name from the fused op's output): the same loss and gradients as without."""
  from flax import nnx
  from helpers import build
  toks = jax.random.randint(jax.random.key(7), (2, 32), 0, 264)

  def loss_and_grads(remat):
    config = tiny_config(train=dict(remat=remat),
                         precision=dict(gemm="fp8", fp8_experts=True))
    model = build(config)

    def loss(m):
      logits, stats = m(toks)
      return jnp.mean(jax.nn.logsumexp(logits, -1)) + jnp.sum(stats.router.aux_loss)

    return nnx.value_and_grad(loss)(model)

  (l0, g0), (l1, g1) = loss_and_grads("none"), loss_and_grads(remat)
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5,
                               atol=1e-7)
