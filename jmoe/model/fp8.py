"""FP8 GEMMs (`precision.gemm = "fp8"`), for NVIDIA Hopper's FP8 tensor cores.

XLA runs a GEMM in FP8 only when it is handed float8 operands: a "dequantize, then multiply" stays a
bf16 GEMM. So every FP8 GEMM here quantizes its operands with float32 scales (x ~ q * scale), hands
the float8 values to `dot_general` (or a grouped GEMM) with float32 accumulation, and multiplies the
output by the product of the scales. A custom VJP does the same for the two backward GEMMs, with the
incoming gradient quantized to E5M2 (wider range) or E4M3, as the recipe says.

Dense GEMMs (attention projections, dense MLP, shared experts, the MTP projection; not the router and
not the LM head) take one of two per-tensor recipes:
  current  each scale comes from the tensor's own absolute maximum (amax) at that moment
  delayed  each scale comes from the largest amax of the last `history` steps, kept per GEMM in an
           `Fp8History` variable [3, history] (input, weight, gradient) of the train state (so it
           is checkpointed). An empty history (a fresh run) gives scale 1, as in Transformer Engine.
           The step's amaxes leave the backward pass as the "gradient" of the history; the train
           step stores that instead of applying an optimizer update (jmoe/train/step.py).
Expert GEMMs always scale from current values, and finer than per tensor where it is free (all
scales are local to a device, so no collective is needed inside the expert-parallel region): each
row (token) of the input has its own scale and each expert's weight one; the gradient GEMMs rescale
likewise (see `grouped_fp8`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
_TINY = 1e-12  # an all-zero tensor gets this amax, so its scale is never zero


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
  delayed: bool = False  # per-tensor scales from an amax history (else from current values)
  history: int = 16  # the amax history's length, for delayed scaling
  grad_format: str = "e5m2"  # the gradients' float8 format (the forward operands are E4M3)
  experts: bool = True  # the expert GEMMs too
  dispatch: bool = False  # tokens cross the expert-parallel exchange as float8

  @property
  def grad_dtype(self):
    return FORMATS[self.grad_format]


def recipe_from_config(precision) -> Fp8Recipe | None:
  """The config's FP8 recipe, or None when the GEMMs run in the compute dtype."""
  if precision.gemm != "fp8":
    return None
  return Fp8Recipe(delayed=precision.fp8_recipe == "delayed", history=precision.fp8_amax_history,
                   grad_format=precision.fp8_grad_format, experts=precision.fp8_experts,
                   dispatch=precision.fp8_dispatch)


def scale_for(amax: jax.Array, dtype) -> jax.Array:
  """The float32 scale that maps `amax` onto the format's largest finite value."""
  return jnp.maximum(amax.astype(jnp.float32), _TINY) / float(jnp.finfo(dtype).max)


def amax(x: jax.Array, axis=None, keepdims=False) -> jax.Array:
  return jnp.max(jnp.abs(x), axis=axis, keepdims=keepdims).astype(jnp.float32)


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  """x / scale in float8, saturating at the format's largest value (delayed scales may be stale)."""
  limit = float(jnp.finfo(dtype).max)
  return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype)


# --- dense GEMMs: y = x . w, contracting x's last n axes with w's first n axes ---


def _contract(a, b, a_axes, b_axes, out_dtype):
  return jax.lax.dot_general(a, b, ((tuple(a_axes), tuple(b_axes)), ((), ())),
                             preferred_element_type=out_dtype)


def _history_scale(history_H: jax.Array, dtype) -> jax.Array:
  """Delayed scaling: from the largest amax of the history; 1 while the history is empty."""
  seen = jnp.max(history_H)
  return jnp.where(seen > 0, scale_for(seen, dtype), 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fp8_dot(x, w, history_3H, recipe: Fp8Recipe, n: int):
  """x . w contracting x's last `n` axes with w's first `n`, in FP8. `history_3H` is the amax
  history for delayed scaling (ignored by current scaling); its cotangent is its next value."""
  return _fp8_dot_fwd(x, w, history_3H, recipe, n)[0]


def _fp8_dot_fwd(x, w, history_3H, recipe, n):
  amax_x, amax_w = amax(x), amax(w)
  if recipe.delayed:
    scale_x, scale_w = _history_scale(history_3H[0], E4M3), _history_scale(history_3H[1], E4M3)
  else:
    scale_x, scale_w = scale_for(amax_x, E4M3), scale_for(amax_w, E4M3)
  x_q, w_q = quantize(x, scale_x, E4M3), quantize(w, scale_w, E4M3)
  y = _contract(x_q, w_q, range(x.ndim - n, x.ndim), range(n), x.dtype)
  y = y * (scale_x * scale_w).astype(x.dtype)
  # The backward pass needs only the float8 operands: half the bytes of bf16 activations.
  return y, (x_q, w_q, scale_x, scale_w, amax_x, amax_w, history_3H)


def _fp8_dot_bwd(recipe, n, residuals, dy):
  x_q, w_q, scale_x, scale_w, amax_x, amax_w, history_3H = residuals
  amax_dy = amax(dy)
  grad_dtype = recipe.grad_dtype
  scale_dy = (_history_scale(history_3H[2], grad_dtype) if recipe.delayed
              else scale_for(amax_dy, grad_dtype))
  dy_q = quantize(dy, scale_dy, grad_dtype)
  batch = dy.ndim - (w_q.ndim - n)  # dy = [x's leading axes..., w's trailing axes...]
  dx = _contract(dy_q, w_q, range(batch, dy.ndim), range(n, w_q.ndim), dy.dtype)
  dw = _contract(x_q, dy_q, range(batch), range(batch), dy.dtype)
  dx = dx * (scale_dy * scale_w).astype(dy.dtype)
  dw = dw * (scale_x * scale_dy).astype(dy.dtype)
  if recipe.delayed:  # the history's "gradient" is its next value
    new_3H = jnp.roll(history_3H, 1, axis=1).at[:, 0].set(jnp.stack([amax_x, amax_w, amax_dy]))
  else:
    new_3H = jnp.zeros_like(history_3H)
  return dx.astype(dy.dtype), dw.astype(dy.dtype), new_3H


fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


class Fp8History(nnx.Variable):
  """Delayed scaling's amax history of one GEMM: rows input, weight, gradient; newest first.
  Updated by the train step from the backward pass (not an optimizer update)."""


class Fp8Dot(nnx.Module):
  """One FP8 GEMM site: the recipe and, for delayed scaling, its amax history."""

  def __init__(self, recipe: Fp8Recipe):
    self.recipe = recipe
    self.history_3H = (Fp8History(jnp.zeros((3, recipe.history), jnp.float32), axes=(None, None))
                       if recipe.delayed else None)

  def __call__(self, x: jax.Array, w: jax.Array, n: int) -> jax.Array:
    """x . w contracting x's last `n` axes with w's first `n`, in FP8; returns x.dtype."""
    history_3H = (jnp.zeros((3, 1), jnp.float32) if self.history_3H is None
                  else self.history_3H[...])
    return fp8_dot(x, w.astype(x.dtype), history_3H, self.recipe, n)


def project(x: jax.Array, w: jax.Array, n: int, site: Fp8Dot | None) -> jax.Array:
  """x . w over x's last `n` axes and w's first `n`: in FP8 through `site`, else in x's dtype."""
  if site is not None:
    return site(x, w, n)
  return _contract(x, w.astype(x.dtype), range(x.ndim - n, x.ndim), range(n), None)


def fp8_site(recipe: Fp8Recipe | None) -> Fp8Dot | None:
  return None if recipe is None else Fp8Dot(recipe)


# --- grouped (expert) GEMMs ---

# (x_XK, w_EKN, group_sizes_E) -> y_XN, and (x_XK, y_XN, group_sizes_E) -> sum over each group's
# rows of x^T y, [E, K, N]; both take float8 operands and return bfloat16.
RaggedDot = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class RaggedKernels:
  dot: RaggedDot
  contract: RaggedDot


def row_groups(group_sizes_E: jax.Array, num_rows: int) -> jax.Array:
  """Each row's group, for rows sorted by group; rows past the groups get E (no group).

  Counts the group ends at or before each row: a scatter and a cumulative sum (a binary search
  would be a while loop, which XLA's SPMD partitioner mishandles inside shard_map under FSDP).
  """
  ends_E = jnp.cumsum(group_sizes_E)
  marks_X = jnp.zeros((num_rows,), jnp.int32).at[ends_E].add(1, mode="drop")
  return jnp.cumsum(marks_X)


def _take_rows(a_E, expert_X):
  return jnp.take(a_E, expert_X, axis=0, mode="fill", fill_value=0)


def grouped_fp8(kernels: RaggedKernels, grad_format: str = "e5m2"):
  """A grouped GEMM (x_XK, w_EKN, group_sizes_E) -> y_XN in FP8 with row-wise scaling.

  Forward: x with one scale per row, w one per expert; y = (x_q . w_q) * s_x[row] * s_w[e].
  Input gradient: dy per row, times the same quantized weight (transposed). Weight gradient:
  dw[e] = sum_r x[r]^T dy[r] = sum_r x_q[r]^T (dy[r] * s_x[r]), so the forward's row-quantized x is
  reused and its row scales fold into dy, which is then quantized with one scale.
  """
  grad_dtype = FORMATS[grad_format]

  @jax.custom_vjp
  def gemm(x_XK, w_EKN, group_sizes_E):
    return fwd(x_XK, w_EKN, group_sizes_E)[0]

  def fwd(x_XK, w_EKN, group_sizes_E):
    scale_X1 = scale_for(amax(x_XK, axis=1, keepdims=True), E4M3)
    scale_E11 = scale_for(amax(w_EKN, axis=(1, 2), keepdims=True), E4M3)
    x_q, w_q = quantize(x_XK, scale_X1, E4M3), quantize(w_EKN, scale_E11, E4M3)
    y_XN = kernels.dot(x_q, w_q, group_sizes_E)
    expert_X = row_groups(group_sizes_E, x_XK.shape[0])
    y_XN = y_XN.astype(jnp.float32) * scale_X1 * _take_rows(scale_E11[:, 0], expert_X)
    # Rows past the groups are zeros (a kernel may leave them unwritten).
    y_XN = jnp.where((expert_X < w_EKN.shape[0])[:, None], y_XN, 0)
    return y_XN.astype(x_XK.dtype), (x_q, scale_X1, w_q, scale_E11, group_sizes_E,
                                     jnp.zeros((), w_EKN.dtype))

  def bwd(residuals, dy_XN):
    x_q, scale_X1, w_q, scale_E11, group_sizes_E, w_zero = residuals
    expert_X = row_groups(group_sizes_E, x_q.shape[0])
    in_groups_X1 = (expert_X < w_q.shape[0])[:, None]
    dy_XN = jnp.where(in_groups_X1, dy_XN, 0)
    scale_dy_X1 = scale_for(amax(dy_XN, axis=1, keepdims=True), grad_dtype)
    dx_XK = kernels.dot(quantize(dy_XN, scale_dy_X1, grad_dtype), jnp.swapaxes(w_q, 1, 2),
                        group_sizes_E)
    dx_XK = dx_XK.astype(jnp.float32) * scale_dy_X1 * _take_rows(scale_E11[:, 0], expert_X)
    dx_XK = jnp.where(in_groups_X1, dx_XK, 0)
    folded_XN = dy_XN.astype(jnp.float32) * scale_X1
    scale_folded = scale_for(amax(folded_XN), grad_dtype)
    dw_EKN = kernels.contract(x_q, quantize(folded_XN, scale_folded, grad_dtype), group_sizes_E)
    dw_EKN = dw_EKN.astype(jnp.float32) * scale_folded
    dw_EKN = jnp.where((group_sizes_E > 0)[:, None, None], dw_EKN, 0)  # no rows: no gradient
    return dx_XK.astype(dy_XN.dtype), dw_EKN.astype(w_zero.dtype), None

  gemm.defvjp(fwd, bwd)

  def grouped(x_XK, w_EKN, group_sizes_E):
    return gemm(x_XK, _varying_like(w_EKN, x_XK), group_sizes_E)

  grouped.kernels = kernels
  return grouped


def _varying_like(w, x):
  """Inside shard_map: `w` made to vary over the axes `x` varies over, before a custom VJP, so that
  autodiff reduces w's gradient (a sum over this device's rows) over those axes."""
  extra = tuple(sorted(jax.typeof(x).manual_axis_type.varying
                       - jax.typeof(w).manual_axis_type.varying))
  return jax.lax.pcast(w, extra, to="varying") if extra else w


def batched_fp8(grad_format: str = "e5m2"):
  """Per-expert blocks (x_ECK, w_EKN) -> y_ECN in FP8 through XLA's batched GEMM (cuBLASLt).

  Scales: x per row (slot), w per expert; dy per row for the input gradient; for the weight
  gradient the row scales of x fold into dy, which gets one scale per expert. The forward hands
  the weight over as [E, N, K] (both operands K-major), the layout cuBLASLt's FP8 GEMM takes
  without a copy.
  """
  grad_dtype = FORMATS[grad_format]

  @jax.custom_vjp
  def gemm(x_ECK, w_EKN):
    return fwd(x_ECK, w_EKN)[0]

  def fwd(x_ECK, w_EKN):
    scale_EC1 = scale_for(amax(x_ECK, axis=2, keepdims=True), E4M3)
    scale_E11 = scale_for(amax(w_EKN, axis=(1, 2), keepdims=True), E4M3)
    x_q, w_q = quantize(x_ECK, scale_EC1, E4M3), quantize(w_EKN, scale_E11, E4M3)
    y_ECN = _contract_batched(x_q, jnp.swapaxes(w_q, 1, 2), 2, 2, x_ECK.dtype)
    y_ECN = (y_ECN.astype(jnp.float32) * scale_EC1 * scale_E11).astype(x_ECK.dtype)
    return y_ECN, (x_q, scale_EC1, w_q, scale_E11, jnp.zeros((), w_EKN.dtype))

  def bwd(residuals, dy_ECN):
    x_q, scale_EC1, w_q, scale_E11, w_zero = residuals
    scale_dy_EC1 = scale_for(amax(dy_ECN, axis=2, keepdims=True), grad_dtype)
    dx_ECK = _contract_batched(quantize(dy_ECN, scale_dy_EC1, grad_dtype), w_q, 2, 2,
                               dy_ECN.dtype)
    dx_ECK = dx_ECK.astype(jnp.float32) * scale_dy_EC1 * scale_E11
    folded_ECN = dy_ECN.astype(jnp.float32) * scale_EC1
    scale_folded_E11 = scale_for(amax(folded_ECN, axis=(1, 2), keepdims=True), grad_dtype)
    dw_EKN = _contract_batched(x_q, quantize(folded_ECN, scale_folded_E11, grad_dtype), 1, 1,
                               dy_ECN.dtype)
    dw_EKN = dw_EKN.astype(jnp.float32) * scale_folded_E11
    return dx_ECK.astype(dy_ECN.dtype), dw_EKN.astype(w_zero.dtype)

  gemm.defvjp(fwd, bwd)
  return lambda x_ECK, w_EKN: gemm(x_ECK, _varying_like(w_EKN, x_ECK))


def _contract_batched(a, b, a_axis: int, b_axis: int, out_dtype):
  """Batched over the leading axis, contracting a's `a_axis` with b's `b_axis`."""
  return jax.lax.dot_general(a, b, (((a_axis,), (b_axis,)), ((0,), (0,))),
                             preferred_element_type=out_dtype)
