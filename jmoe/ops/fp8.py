"""FP8 GEMMs (`precision.gemm = "fp8"`), for NVIDIA Hopper's FP8 tensor cores.

XLA runs a GEMM in FP8 only when it is handed float8 operands: a "dequantize, then multiply" stays a
bf16 GEMM. So every FP8 GEMM here quantizes its operands with float32 scales (x ~ q * scale), hands
the float8 values to `dot_general` (or a grouped GEMM) with float32 accumulation, and multiplies the
output by the product of the scales. A custom VJP does the same for the two backward GEMMs, with the
incoming gradient quantized to E5M2 (wider range) or E4M3, as the recipe says.

Dense GEMMs (attention projections, dense MLP, shared experts, the MTP projection; not the router
and not the LM head) take one of two per-tensor recipes (`precision.fp8_recipe`):
  current  each scale comes from the tensor's own absolute maximum (amax) at that moment
  delayed  each scale comes from the largest amax of the last `history` steps, kept per GEMM in an
           `Fp8History` variable [3, Z] (input, weight, gradient) of the train state (so it
           is checkpointed). An empty history (a fresh run) gives scale 1, as in Transformer Engine.
           The step's amaxes leave the backward pass as the "gradient" of the history; the train
           step stores that instead of applying an optimizer update (jmoe/train/step.py).
  blockwise the dense GEMMs as `current`; the expert GEMMs on DeepSeek-V3's tile scales
Expert GEMMs scale from current values, per row and per expert (jmoe/ops/fp8_grouped.py), or
per tile with `blockwise` (jmoe/ops/fp8_blockwise.py).
"""

from __future__ import annotations

import dataclasses
import functools
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
  experts: bool = True  # the routed experts' GEMMs
  dense: bool = False  # the dense GEMMs: attention, dense MLPs, shared experts (not the head)
  # expert GEMMs on 1 x 128 / 128 x 128 tile scales (jmoe/ops/fp8_blockwise.py); the dense GEMMs
  # then scale from current values per tensor
  blockwise: bool = False
  dispatch: bool = False  # tokens cross the expert-parallel exchange as float8
  weight_gradient: str = "auto"  # the expert GEMMs' weight gradient: auto | bf16 | fp8
  promote: str = "long"  # the expert kernels' sums promoted to float32: never | long | always
  # the expert weights' amax computed by the train step after each update and kept for the next
  # step's forward pass (`WeightAmax`), instead of read from the weights at each use
  kept_weight_amax: bool = False

  @property
  def grad_dtype(self):
    return FORMATS[self.grad_format]


def recipe_from_config(precision, train_state: bool = False) -> Fp8Recipe | None:
  """The config's FP8 recipe, or None when the GEMMs run in the compute dtype. `train_state`:
  for the model of a train state, whose step keeps the expert weights' amax
  (`precision.fp8_weight_amax=kept`); any other model reads it from the weights."""
  if precision.gemm != "fp8":
    return None
  return Fp8Recipe(delayed=precision.fp8_recipe == "delayed",
                   blockwise=precision.fp8_recipe == "blockwise",
                   history=precision.fp8_amax_history, grad_format=precision.fp8_grad_format,
                   experts=precision.fp8_experts, dense=precision.fp8_dense,
                   dispatch=precision.fp8_dispatch,
                   weight_gradient=precision.fp8_weight_gradient,
                   promote=precision.fp8_promote,
                   kept_weight_amax=train_state and precision.fp8_weight_amax == "kept")


def scale_for(amax: jax.Array, dtype) -> jax.Array:
  """The float32 scale that maps `amax` onto the format's largest finite value."""
  return jnp.maximum(amax.astype(jnp.float32), _TINY) / float(jnp.finfo(dtype).max)


def amax(x: jax.Array, axis=None, keepdims=False) -> jax.Array:
  return jnp.max(jnp.abs(x), axis=axis, keepdims=keepdims).astype(jnp.float32)


def stored_amax(x: jax.Array, axis=None, keepdims=False) -> jax.Array:
  """`amax` of x's values as its dtype stores them, taken on their bits (sign cleared, the
  largest bit pattern: the largest magnitude) so that XLA cannot take it from a wider value x
  was rounded from (it may drop a rounding inside a fusion, `xla_allow_excess_precision`). The
  train step keeps the expert weights' amaxes so (jmoe/moe/layer.py), from inside the optimizer
  update that rounds them: there, as for a parameter stored in the compute dtype, it is the
  amax the forward pass finds. (The forward pass itself takes `amax`: on the bits XLA kept
  each layer's cast of a float32 weight until the backward pass, reading them.)"""
  bits = {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  magnitude = jax.lax.bitcast_convert_type(x, bits) & bits(jnp.iinfo(bits).max >> 1)
  top = jnp.max(magnitude, axis=axis, keepdims=keepdims)
  return jax.lax.bitcast_convert_type(top, x.dtype).astype(jnp.float32)


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  """x / scale in float8, saturating at the format's largest value (delayed scales may be stale)."""
  limit = float(jnp.finfo(dtype).max)
  return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype)


def quantize_rows(x_XD: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(x_q, scale_X1): x in E4M3 with one float32 scale per row, as the grouped FP8 GEMMs
  quantize their input (jmoe/ops/fp8_grouped.py)."""
  scale_X1 = scale_for(amax(x_XD, axis=1, keepdims=True), E4M3)
  return quantize(x_XD, scale_X1, E4M3), scale_X1


# --- dense GEMMs: y = x . w, contracting x's last n axes with w's first n axes ---


def _contract(a, b, a_axes, b_axes, out_dtype):
  return jax.lax.dot_general(a, b, ((tuple(a_axes), tuple(b_axes)), ((), ())),
                             preferred_element_type=out_dtype)


def _history_scale(history_Z: jax.Array, dtype) -> jax.Array:
  """Delayed scaling: from the largest amax of the history; 1 while the history is empty."""
  seen = jnp.max(history_Z)
  return jnp.where(seen > 0, scale_for(seen, dtype), 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fp8_dot(x, w, history_3Z, recipe: Fp8Recipe, n: int):
  """x . w contracting x's last `n` axes with w's first `n`, in FP8. `history_3Z` is the amax
  history for delayed scaling (ignored by current scaling); its cotangent is its next value."""
  return _fp8_dot_fwd(x, w, history_3Z, recipe, n)[0]


def _fp8_dot_fwd(x, w, history_3Z, recipe, n):
  amax_x, amax_w = amax(x), amax(w)
  if recipe.delayed:
    scale_x, scale_w = _history_scale(history_3Z[0], E4M3), _history_scale(history_3Z[1], E4M3)
  else:
    scale_x, scale_w = scale_for(amax_x, E4M3), scale_for(amax_w, E4M3)
  x_q, w_q = quantize(x, scale_x, E4M3), quantize(w, scale_w, E4M3)
  y = _contract(x_q, w_q, range(x.ndim - n, x.ndim), range(n), x.dtype)
  y = y * (scale_x * scale_w).astype(x.dtype)
  # The backward pass needs only the float8 operands: half the bytes of bf16 activations.
  return y, (x_q, w_q, scale_x, scale_w, amax_x, amax_w, history_3Z)


def _fp8_dot_bwd(recipe, n, residuals, dy):
  x_q, w_q, scale_x, scale_w, amax_x, amax_w, history_3Z = residuals
  amax_dy = amax(dy)
  grad_dtype = recipe.grad_dtype
  scale_dy = (_history_scale(history_3Z[2], grad_dtype) if recipe.delayed
              else scale_for(amax_dy, grad_dtype))
  dy_q = quantize(dy, scale_dy, grad_dtype)
  batch = dy.ndim - (w_q.ndim - n)  # dy = [x's leading axes..., w's trailing axes...]
  dx = _contract(dy_q, w_q, range(batch, dy.ndim), range(n, w_q.ndim), dy.dtype)
  dw = _contract(x_q, dy_q, range(batch), range(batch), dy.dtype)
  dx = dx * (scale_dy * scale_w).astype(dy.dtype)
  dw = dw * (scale_x * scale_dy).astype(dy.dtype)
  if recipe.delayed:  # the history's "gradient" is its next value
    new_3Z = jnp.roll(history_3Z, 1, axis=1).at[:, 0].set(jnp.stack([amax_x, amax_w, amax_dy]))
  else:
    new_3Z = jnp.zeros_like(history_3Z)
  return dx.astype(dy.dtype), dw.astype(dy.dtype), new_3Z


fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


class Fp8History(nnx.Variable):
  """Delayed scaling's amax history of one GEMM: rows input, weight, gradient; newest first.
  Updated by the train step from the backward pass (not an optimizer update)."""


class WeightAmax(nnx.Variable):
  """An expert weight's amax per expert (float32), for the FP8 forward pass to scale the weight
  without reading it once more. Computed by the train step from the weights it has just
  updated (and from the weights a run starts with): derived from the parameters, so never
  saved in a checkpoint (jmoe/moe/layer.py `keep_weight_amax`)."""


class Fp8Dot(nnx.Module):
  """One FP8 GEMM site: the recipe and, for delayed scaling, its amax history."""

  def __init__(self, recipe: Fp8Recipe):
    self.recipe = recipe
    self.history_3Z = (Fp8History(jnp.zeros((3, recipe.history), jnp.float32), axes=(None, None))
                       if recipe.delayed else None)

  def __call__(self, x: jax.Array, w: jax.Array, n: int) -> jax.Array:
    """x . w contracting x's last `n` axes with w's first `n`, in FP8; returns x.dtype."""
    history_3Z = (jnp.zeros((3, 1), jnp.float32) if self.history_3Z is None
                  else self.history_3Z[...])
    return fp8_dot(x, w.astype(x.dtype), history_3Z, self.recipe, n)


def project(x: jax.Array, w: jax.Array, n: int, site: Fp8Dot | None) -> jax.Array:
  """x . w over x's last `n` axes and w's first `n`: in FP8 through `site`, else in x's dtype."""
  if site is not None:
    return site(x, w, n)
  return _contract(x, w.astype(x.dtype), range(x.ndim - n, x.ndim), range(n), None)


def fp8_site(recipe: Fp8Recipe | None) -> Fp8Dot | None:
  """The FP8 GEMM of a dense projection, or None where it stays in the compute dtype."""
  return None if recipe is None or not recipe.dense else Fp8Dot(recipe)
