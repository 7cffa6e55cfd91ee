"""FP8 expert GEMMs: grouped (over expert-sorted rows) and batched (over per-expert blocks).

Expert GEMMs always scale from current values, and finer than per tensor where it is free (all
scales are local to a device, so no collective is needed inside the expert-parallel region): each
row (token) of the input has its own scale and each expert's weight one; the gradient GEMMs rescale
likewise. Shapes are written for the up projection (D in, F out); the down projection swaps them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jmoe.ops.fp8 import E4M3, FORMATS, amax, quantize, quantize_rows, scale_for
from jmoe.ops.fp8_swiglu import swiglu_grad_amax, swiglu_grad_quantized, swiglu_quantized
from jmoe.ops.rows import row_groups, take_rows

# precision.fp8_weight_gradient=auto takes the float8 contraction when a device's experts have at
# least this many rows each under balanced routing, else the 16-bit one. Measured on an H200
# (docs/FP8.md): at 2,048 rows per expert (Mixtral's bench) the float8 weight gradient ran 1.5-1.6x
# the bf16 kernel and the step 8% faster; at 512 (Qwen3-30B-A3B's) its short K loops ran
# 0.95-1.10x and the step 2.3% slower. Two shapes: the threshold lies between them, not measured.
FP8_WEIGHT_GRADIENT_ROWS = 1024


def weight_gradient_for(setting: str, mean_rows_per_expert: float) -> str:
  """`precision.fp8_weight_gradient` resolved for experts of that many rows each: fp8 | bf16."""
  if setting != "auto":
    return setting
  return "fp8" if mean_rows_per_expert >= FP8_WEIGHT_GRADIENT_ROWS else "bf16"

# (x_XD, w_EDF, group_sizes_E) -> y_XF, and (x_XD, y_XF, group_sizes_E) -> sum over each group's
# rows of x^T y, [E, D, F]; both take float8 operands and return bfloat16.
RaggedDot = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class RaggedKernels:
  """A backend's float8 kernels: the forward grouped GEMM and the weight gradient's contraction;
  `contract16`, the backend's 16-bit contraction, for a weight gradient taken in bf16."""
  dot: RaggedDot
  contract: RaggedDot
  contract16: RaggedDot | None = None


def grouped_fp8(kernels: RaggedKernels, grad_format: str = "e5m2",
                weight_gradient: str = "fp8"):
  """A grouped GEMM (x_XD, w_EDF, group_sizes_E) -> y_XF in FP8 with row-wise scaling.

  Forward: x with one scale per row, w one per expert; y = (x_q . w_q) * s_x[row] * s_w[e].
  Input gradient: dy per row, times the same quantized weight (transposed), quantized again
  from w rather than kept from the forward (w is held anyway: the parameter itself where
  parameters are stored in the compute dtype, else its cast, as the 16-bit GEMM's backward holds
  it; a float8 copy would be one more weight-sized buffer per layer). Weight gradient in FP8:
  dw[e] = sum_r x[r]^T dy[r] = sum_r x_q[r]^T (dy[r] * s_x[r]), so the forward's row-quantized x is
  reused and its row scales fold into dy, which is then quantized with one scale.
  `weight_gradient="bf16"` (where the kernels have `contract16`): the same sum in the 16-bit
  kernel, over x_q dequantized (the values the forward multiplied) and dy as it comes.
  `quantized`: x's rows as `quantize_rows` makes them, (x_q, scale_X1), made before x's rows
  were gathered (each token once, not once per copy; the gather then moves one byte a value):
  the forward takes them instead of quantizing x, which it then does not read. `w_amax_E`: each
  expert's amax of w, made beforehand (the train step keeps it, jmoe/ops/fp8.py `WeightAmax`),
  so that the forward does not read w for it; None: read from w.
  """
  grad_dtype = FORMATS[grad_format]
  contract16 = kernels.contract16 if weight_gradient == "bf16" else None

  @jax.custom_vjp
  def gemm(x_XD, w_EDF, group_sizes_E, quantized, w_amax_E):
    return fwd(x_XD, w_EDF, group_sizes_E, quantized, w_amax_E)[0]

  def fwd(x_XD, w_EDF, group_sizes_E, quantized, w_amax_E):
    y_XF, rows_X, x_q, scale_X1, scale_E11 = _forward(kernels, x_XD, w_EDF, group_sizes_E,
                                                      quantized, w_amax_E)
    y_XF = jnp.where(rows_X.valid[:, None], y_XF.astype(jnp.float32) * rows_X.scale[:, None], 0)
    return y_XF.astype(x_XD.dtype), (x_q, scale_X1, w_EDF, scale_E11, group_sizes_E)

  def bwd(residuals, dy_XF):
    x_q, scale_X1, w_EDF, scale_E11, group_sizes_E = residuals
    (scale_E11, scale_X1), dy_XF = _in_backward(scale_E11, scale_X1, dy_XF)
    rows_X = _Rows.of(group_sizes_E, w_EDF.shape[0], scale_E11, scale_X1)
    dy_XF = jnp.where(rows_X.valid[:, None], dy_XF, 0)
    amax_dy_X1 = amax(dy_XF, axis=1, keepdims=True)
    scale_dy_X1 = scale_for(amax_dy_X1, grad_dtype)
    dy_q = quantize(dy_XF, scale_dy_X1, grad_dtype)
    if contract16 is not None:
      x_XD = (x_q.astype(jnp.float32) * scale_X1).astype(dy_XF.dtype)
      dw_EDF = contract16(x_XD, dy_XF, group_sizes_E).astype(jnp.float32)
    else:
      folded_XF = dy_XF.astype(jnp.float32) * scale_X1
      # amax(folded) from dy's row amaxes: a positive scale keeps each row's largest entry the
      # largest (rounding is monotonic), so this is exact and spares a pass over dy.
      scale_folded = scale_for(jnp.max(amax_dy_X1 * scale_X1), grad_dtype)
      dw_EDF = kernels.contract(x_q, quantize(folded_XF, scale_folded, grad_dtype),
                                group_sizes_E)
      dw_EDF = dw_EDF.astype(jnp.float32) * scale_folded
    return _gradients(kernels, dy_q, scale_dy_X1, dw_EDF, w_EDF, scale_E11, rows_X,
                      group_sizes_E, dy_XF.dtype)

  gemm.defvjp(fwd, bwd)

  def grouped(x_XD, w_EDF, group_sizes_E, quantized=None, w_amax_E=None):
    return gemm(x_XD, _varying_like(w_EDF, x_XD), group_sizes_E, quantized, w_amax_E)

  return grouped


def grouped_fp8_swiglu(kernels: RaggedKernels, grad_format: str = "e5m2",
                       weight_gradient: str = "fp8"):
  """The experts' first projection and SwiGLU in one: (x_XD, w_ED2F, group_sizes_E, quantized)
  -> (hidden, (hidden_q, its row scales [X, 1])), the hidden silu(gate) * up [X, F] in bf16
  and quantized per row for the down projection (its `quantized`), gate and up being the
  grouped GEMM's output's halves (w's first F columns and its last F), in FP8 as `grouped_fp8`
  runs it.

  One op over both spares passes over the hidden and its gradient. Forward: the hidden is
  made from h and quantized by one kernel (jmoe/ops/fp8_swiglu.py `swiglu_quantized`), never
  written in bf16 unless something reads it (the down projection reads the float8 rows).
  Backward: d(gate, up) is made, measured per row and quantized by that module's kernels from
  h as the kernel wrote it (kept from the forward pass, as XLA kept it for the 16-bit SwiGLU)
  and the hidden's gradient, without ever being written in bf16 (except for the 16-bit weight
  gradient, which reads it)."""
  grad_dtype = FORMATS[grad_format]
  contract16 = kernels.contract16 if weight_gradient == "bf16" else None

  @jax.custom_vjp
  def gemm(x_XD, w_ED2F, group_sizes_E, quantized, w_amax_E):
    return fwd(x_XD, w_ED2F, group_sizes_E, quantized, w_amax_E)[0]

  def fwd(x_XD, w_ED2F, group_sizes_E, quantized, w_amax_E):
    h_X2F, rows_X, x_q, scale_X1, scale_E11 = _forward(kernels, x_XD, w_ED2F, group_sizes_E,
                                                       quantized, w_amax_E)
    hidden_q, scale_hidden_X, hidden_XF = swiglu_quantized(h_X2F, rows_X.scale, rows_X.valid)
    return ((hidden_XF.astype(x_XD.dtype), (hidden_q, scale_hidden_X[:, None])),
            (x_q, scale_X1, w_ED2F, scale_E11, group_sizes_E, h_X2F))

  def bwd(residuals, d_out):
    d_XF = d_out[0]  # (the float8 rows pass on no gradient: the down projection's is d_XF's)
    x_q, scale_X1, w_ED2F, scale_E11, group_sizes_E, h_X2F = residuals
    (scale_E11, scale_X1), d_XF = _in_backward(scale_E11, scale_X1, d_XF)
    rows_X = _Rows.of(group_sizes_E, w_ED2F.shape[0], scale_E11, scale_X1)
    made = (h_X2F, rows_X.scale, d_XF, rows_X.valid)
    amax_dh_X = swiglu_grad_amax(*made)
    scale_dh_X = scale_for(amax_dh_X, grad_dtype)
    if contract16 is not None:
      dh_q, _, dh_X2F = swiglu_grad_quantized(*made, scale_dh_X, grad_dtype, with_bf16=True)
      x_XD = (x_q.astype(jnp.float32) * scale_X1).astype(d_XF.dtype)
      dw_ED2F = contract16(x_XD, dh_X2F, group_sizes_E).astype(jnp.float32)
    else:
      scale_folded = scale_for(jnp.max(amax_dh_X * scale_X1[:, 0]), grad_dtype)  # as above
      dh_q, folded_q, _ = swiglu_grad_quantized(*made, scale_dh_X, grad_dtype,
                                                fold=(scale_X1[:, 0], scale_folded))
      dw_ED2F = kernels.contract(x_q, folded_q, group_sizes_E).astype(jnp.float32)
      dw_ED2F = dw_ED2F * scale_folded
    return _gradients(kernels, dh_q, scale_dh_X[:, None], dw_ED2F, w_ED2F, scale_E11, rows_X,
                      group_sizes_E, d_XF.dtype)

  gemm.defvjp(fwd, bwd)

  def gated(x_XD, w_ED2F, group_sizes_E, quantized=None, w_amax_E=None):
    return gemm(x_XD, _varying_like(w_ED2F, x_XD), group_sizes_E, quantized, w_amax_E)

  return gated


@dataclasses.dataclass(frozen=True)
class _Rows:
  """Per row of an expert-sorted operand: its expert (E past the groups), whether it is in a
  group, and the scale of the forward's output row (x's row scale times its expert's weight
  scale)."""
  expert: jax.Array
  valid: jax.Array
  scale: jax.Array

  @classmethod
  def of(cls, group_sizes_E, num_experts, scale_E11, scale_X1) -> _Rows:
    expert_X = row_groups(group_sizes_E, scale_X1.shape[0])
    return cls(expert_X, expert_X < num_experts,
               scale_X1[:, 0] * take_rows(scale_E11[:, 0, 0], expert_X))


def _forward(kernels, x_XD, w_EDF, group_sizes_E, quantized, w_amax_E=None):
  """The forward GEMM: (y as the kernel wrote it, _Rows with y's row scales, x_q, x's row
  scales, w's expert scales), w's scales from `w_amax_E` where given."""
  x_q, scale_X1 = quantize_rows(x_XD) if quantized is None else quantized
  amax_E11 = (amax(w_EDF, axis=(1, 2), keepdims=True) if w_amax_E is None
              else w_amax_E.astype(jnp.float32)[:, None, None])
  scale_E11, scale_X1 = at_this_layer(scale_for(amax_E11, E4M3), scale_X1)
  y_XF = kernels.dot(x_q, quantize(w_EDF, scale_E11, E4M3), group_sizes_E)
  return (y_XF, _Rows.of(group_sizes_E, w_EDF.shape[0], scale_E11, scale_X1), x_q, scale_X1,
          scale_E11)


def _in_backward(scale_E11, scale_X1, dy):
  """The scales tied to dy, which only the backward pass has, by an optimization barrier, so
  that XLA neither merges the backward's quantization of the weight with the forward's
  identical one (CSE) nor schedules it early: either way every layer's float8 copy would be
  held from the forward pass to the backward (about 4.5 GiB on the Qwen3-30B-A3B bench, by its
  shapes). Only the scale goes through the barrier: the weight itself may still be read as a
  cast of the parameter, fused into the quantization, rather than kept. The row scales
  likewise, for x dequantized by the 16-bit weight gradient: untied, XLA computed it in the
  forward pass (in the kernel that gathers x_q's rows) and held every layer's bf16 copy until
  then (2 GiB on that bench, compiled for an H200)."""
  return jax.lax.optimization_barrier(((scale_E11, scale_X1), dy))


def _gradients(kernels, dy_q, scale_dy_X1, dw_EDF, w_EDF, scale_E11, rows_X, group_sizes_E,
               dtype):
  """(dx, dw, None, None, None) of a grouped FP8 GEMM from its quantized output gradient and its
  weight gradient (float32): the input gradient through the weight quantized again here."""
  w_q = quantize(w_EDF, scale_E11, E4M3)
  dx_XD = kernels.dot(dy_q, jnp.swapaxes(w_q, 1, 2), group_sizes_E)
  dx_XD = dx_XD.astype(jnp.float32) * scale_dy_X1 * take_rows(scale_E11[:, 0], rows_X.expert)
  dx_XD = jnp.where(rows_X.valid[:, None], dx_XD, 0)
  dw_EDF = jnp.where((group_sizes_E > 0)[:, None, None], dw_EDF, 0)  # no rows: no gradient
  return dx_XD.astype(dtype), dw_EDF.astype(w_EDF.dtype), None, None, None


def at_this_layer(weight_scale, rows_scale):
  """(weight_scale, rows_scale) through one optimization barrier, so that what the forward pass
  makes from the weight scale (the weights' float8 copy) waits for this call's rows. Without it
  XLA makes the copies of several layers in one kernel (they read one stacked parameter) as
  soon as the first of them is needed and holds the others until their layers run: on the
  Qwen3-30B-A3B bench compiled for an H200, two or three layers' copies at a time, and 1.9 GiB
  more of XLA's temporary memory than the bf16 step (scripts/compile_for_gpu.py)."""
  return jax.lax.optimization_barrier((weight_scale, rows_scale))


def _varying_like(w, x):
  """Inside shard_map: `w` made to vary over the axes `x` varies over, before a custom VJP, so that
  autodiff reduces w's gradient (a sum over this device's rows) over those axes."""
  extra = tuple(sorted(jax.typeof(x).manual_axis_type.varying
                       - jax.typeof(w).manual_axis_type.varying))
  return jax.lax.pcast(w, extra, to="varying") if extra else w


def batched_fp8(grad_format: str = "e5m2", contract=None):
  """Per-expert blocks (x_ECD, w_EDF) -> y_ECF in FP8 through XLA's batched GEMM (cuBLASLt;
  `contract(a, b, a_axis, b_axis, out_dtype)`, batched over the leading axis: tests stand in
  their own).

  Scales: x per row (slot), w per expert; dy per row for the input gradient; for the weight
  gradient the row scales of x fold into dy, which gets one scale per expert. The forward hands
  the weight over as [E, F, D] (both operands major in the contracted axis), the layout
  cuBLASLt's FP8 GEMM takes without a copy.
  """
  grad_dtype = FORMATS[grad_format]
  contract = contract or _contract

  @jax.custom_vjp
  def gemm(x_ECD, w_EDF):
    return fwd(x_ECD, w_EDF)[0]

  def fwd(x_ECD, w_EDF):
    scale_E11, scale_EC1 = at_this_layer(
        scale_for(amax(w_EDF, axis=(1, 2), keepdims=True), E4M3),
        scale_for(amax(x_ECD, axis=2, keepdims=True), E4M3))
    x_q, w_q = quantize(x_ECD, scale_EC1, E4M3), quantize(w_EDF, scale_E11, E4M3)
    y_ECF = contract(x_q, jnp.swapaxes(w_q, 1, 2), 2, 2, x_ECD.dtype)
    y_ECF = (y_ECF.astype(jnp.float32) * scale_EC1 * scale_E11).astype(x_ECD.dtype)
    return y_ECF, (x_q, scale_EC1, w_EDF, scale_E11)

  def bwd(residuals, dy_ECF):
    x_q, scale_EC1, w_EDF, scale_E11 = residuals
    # The weights quantized again by their scale tied to dy (as in `grouped_fp8`), not kept.
    scale_E11, dy_ECF = jax.lax.optimization_barrier((scale_E11, dy_ECF))
    w_q = quantize(w_EDF, scale_E11, E4M3)
    amax_dy_EC1 = amax(dy_ECF, axis=2, keepdims=True)
    scale_dy_EC1 = scale_for(amax_dy_EC1, grad_dtype)
    dx_ECD = contract(quantize(dy_ECF, scale_dy_EC1, grad_dtype), w_q, 2, 2, dy_ECF.dtype)
    dx_ECD = dx_ECD.astype(jnp.float32) * scale_dy_EC1 * scale_E11
    folded_ECF = dy_ECF.astype(jnp.float32) * scale_EC1
    scale_folded_E11 = scale_for(jnp.max(amax_dy_EC1 * scale_EC1, axis=1, keepdims=True),
                                 grad_dtype)  # (as in `grouped_fp8`)
    dw_EDF = contract(x_q, quantize(folded_ECF, scale_folded_E11, grad_dtype), 1, 1,
                      dy_ECF.dtype)
    dw_EDF = dw_EDF.astype(jnp.float32) * scale_folded_E11
    return dx_ECD.astype(dy_ECF.dtype), dw_EDF.astype(w_EDF.dtype)

  gemm.defvjp(fwd, bwd)
  return lambda x_ECD, w_EDF: gemm(x_ECD, _varying_like(w_EDF, x_ECD))


def _contract(a, b, a_axis: int, b_axis: int, out_dtype):
  """Batched over the leading axis, contracting a's `a_axis` with b's `b_axis`."""
  return jax.lax.dot_general(a, b, (((a_axis,), (b_axis,)), ((0,), (0,))),
                             preferred_element_type=out_dtype)
