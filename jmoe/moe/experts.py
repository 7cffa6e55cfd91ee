"""Expert compute: the SwiGLU FFN of every expert as grouped GEMMs over expert-sorted rows.

A grouped GEMM multiplies row block e of x_XD (group_sizes_E[e] rows) by w_EDF[e]. Rows past
sum(group_sizes_E) belong to no expert and give zeros. Backends share this one signature:
  tokamax     tokamax's Mosaic GPU kernel (NVIDIA Hopper and newer; the `gpu` extra)
  ragged_dot  XLA's `jax.lax.ragged_dot` (any platform; on GPUs it expands to dense work)
  dense       a reference einsum over all experts with a row-to-expert mask (exact, E times the work)
`auto` picks tokamax on GPUs where it imports, and ragged_dot elsewhere.

With `precision.gemm = "fp8"` each backend runs its GEMMs on float8 operands with row-wise scales
(`jmoe.model.fp8.grouped_fp8`), from the float8 kernels in `FP8_KERNELS`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jmoe.model.fp8 import RaggedKernels, batched_fp8, grouped_fp8, row_groups

log = logging.getLogger("jmoe")

GroupedGemm = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _ragged_dot(x_XD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
  return jax.lax.ragged_dot(x_XD, w_EDF, group_sizes_E)


def _members(group_sizes_E, num_rows):
  """[X, E]: whether row x belongs to expert e's group."""
  ends_E = jnp.cumsum(group_sizes_E)
  rows_X1 = jnp.arange(num_rows)[:, None]
  return (rows_X1 >= ends_E - group_sizes_E) & (rows_X1 < ends_E)


def _dense(x_XD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
  y_XEF = jnp.einsum("xd,edf->xef", x_XD, w_EDF)
  return jnp.einsum("xef,xe->xf", y_XEF,
                    _members(group_sizes_E, x_XD.shape[0]).astype(y_XEF.dtype))


def _tokamax_kernel(x_XD, w_EDF, group_sizes_E):
  import tokamax
  return tokamax.ragged_dot(x_XD, w_EDF, group_sizes_E, implementation="mosaic")


@jax.custom_vjp
def _tokamax(x_XD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
  # The kernel leaves what no row of a group touches unwritten: output rows past the groups, and
  # in the backward pass the input gradient of those rows and the weight gradient of an expert
  # with no rows. Zeros are selected there, so the contract holds and no garbage reaches the
  # optimizer.
  return _rows_in_groups(_tokamax_kernel(x_XD, w_EDF, group_sizes_E), group_sizes_E)


def _rows_in_groups(y_XF, group_sizes_E):
  in_groups_X1 = (jnp.arange(y_XF.shape[0]) < jnp.sum(group_sizes_E))[:, None]
  return jnp.where(in_groups_X1, y_XF, jnp.zeros_like(y_XF))


def _tokamax_fwd(x_XD, w_EDF, group_sizes_E):
  y_XF, vjp = jax.vjp(lambda x, w: _tokamax_kernel(x, w, group_sizes_E), x_XD, w_EDF)
  return _rows_in_groups(y_XF, group_sizes_E), (vjp, group_sizes_E)


def _tokamax_bwd(residuals, dy_XF):
  vjp, group_sizes_E = residuals
  dx_XD, dw_EDF = vjp(_rows_in_groups(dy_XF, group_sizes_E))
  dw_EDF = jnp.where((group_sizes_E > 0)[:, None, None], dw_EDF, jnp.zeros_like(dw_EDF))
  return _rows_in_groups(dx_XD, group_sizes_E), dw_EDF, None


_tokamax.defvjp(_tokamax_fwd, _tokamax_bwd)


def tracks_varying_axes(gemm: GroupedGemm) -> bool:
  """Whether the backend's gradients keep shard_map's varying-axes types. tokamax's custom VJP
  drops them, so shard_map must run it with that check off."""
  return gemm is not _tokamax


GEMM_BACKENDS: dict[str, GroupedGemm] = {"tokamax": _tokamax, "ragged_dot": _ragged_dot,
                                         "dense": _dense}


@functools.cache
def auto_gemm() -> str:
  """tokamax on GPUs (where it imports), XLA's ragged_dot elsewhere."""
  if jax.default_backend() != "gpu":
    return "ragged_dot"
  try:
    import tokamax  # noqa: F401
  except ImportError as e:
    log.warning("moe.gemm=auto: tokamax does not import (%s), so the experts use XLA's "
                "ragged_dot, which is slow on GPUs; install jmoe[gpu]", e)
    return "ragged_dot"
  return "tokamax"


# Float8 kernels: the forward grouped GEMM and the weight gradient's ragged contraction, with
# float8 operands and bfloat16 results.
_RAGGED_CONTRACT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def _ragged_dot_f8(x_XK, w_EKN, group_sizes_E):
  return jax.lax.ragged_dot(x_XK, w_EKN, group_sizes_E, preferred_element_type=jnp.bfloat16)


def _ragged_contract_f8(x_XK, y_XN, group_sizes_E):
  return jax.lax.ragged_dot_general(x_XK, y_XN, group_sizes_E, _RAGGED_CONTRACT,
                                    preferred_element_type=jnp.bfloat16)


def _dense_f8(x_XK, w_EKN, group_sizes_E):
  y_XEN = jnp.einsum("xk,ekn->xen", x_XK, w_EKN, preferred_element_type=jnp.float32)
  return jnp.einsum("xen,xe->xn", y_XEN, _members(group_sizes_E, x_XK.shape[0]).astype(
      jnp.float32)).astype(jnp.bfloat16)


def _dense_contract_f8(x_XK, y_XN, group_sizes_E):
  member_XE1 = _members(group_sizes_E, x_XK.shape[0])[:, :, None]
  y_XEN = jnp.where(member_XE1, y_XN[:, None, :], jnp.zeros((), y_XN.dtype))
  return jnp.einsum("xk,xen->ekn", x_XK, y_XEN, preferred_element_type=jnp.bfloat16)


# tokamax has none for Hopper: its sm90 grouped GEMM takes bf16/f16 operands only (float8 weights
# are dequantized in the kernel, which needs a newer ptxas than jax's CUDA 13 wheels bring).
FP8_KERNELS: dict[str, RaggedKernels] = {
    "ragged_dot": RaggedKernels(_ragged_dot_f8, _ragged_contract_f8),
    "dense": RaggedKernels(_dense_f8, _dense_contract_f8),
}


@dataclasses.dataclass(frozen=True)
class ExpertGemms:
  """How the experts multiply: the grouped GEMM, and the batched GEMM for per-expert blocks
  (used when `block_factor` > 0; see `blocked_expert_ffn`)."""
  grouped: GroupedGemm
  batched: BatchedGemm
  block_factor: float = 0.0


def expert_gemms(cfg, fp8_grad_format: str | None = None) -> ExpertGemms:
  """The MoE config's GEMMs, in FP8 (gradients in `fp8_grad_format`) when that is given."""
  return ExpertGemms(grouped_gemm(cfg.gemm, fp8_grad_format), batched_gemm(fp8_grad_format),
                     cfg.expert_blocks)


@functools.cache
def grouped_gemm(name: str, fp8_grad_format: str | None = None) -> GroupedGemm:
  """The backend's grouped GEMM; in FP8 (gradients in `fp8_grad_format`) when that is given."""
  name = auto_gemm() if name == "auto" else name
  if fp8_grad_format is None:
    return GEMM_BACKENDS[name]
  if name not in FP8_KERNELS:
    log.warning("moe.gemm=%s has no FP8 grouped GEMM on this GPU, so its grouped GEMMs stay in "
                "bf16; moe.expert_blocks > 0 runs the experts' blocks as FP8 batched GEMMs", name)
    return GEMM_BACKENDS[name]
  return grouped_fp8(FP8_KERNELS[name], fp8_grad_format)


GatedActivation = Callable[[jax.Array, jax.Array], jax.Array]  # (gate, up) -> hidden


def gated_activation(cfg) -> GatedActivation:
  """The expert FFN's gate: SwiGLU, or GPT-OSS's clamped variant (gate <= limit, |up| <= limit,
  gate * sigmoid(alpha * gate) * (up + 1))."""
  if cfg.activation == "clamped_swiglu":
    limit, alpha = cfg.swiglu_limit, cfg.swiglu_alpha

    def clamped(gate, up):
      gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
      return gate * jax.nn.sigmoid(alpha * gate) * (up + 1)

    return clamped
  return lambda gate, up: jax.nn.silu(gate) * up


def _row_bias(b_EF: jax.Array, group_sizes_E: jax.Array, num_rows: int) -> jax.Array:
  """Each row's expert's bias; rows past the groups (no expert) get zeros."""
  expert_X = row_groups(group_sizes_E, num_rows)
  return jnp.take(b_EF, expert_X, axis=0, mode="fill", fill_value=0)


def expert_ffn(x_XD: jax.Array, group_sizes_E: jax.Array, weights: dict[str, jax.Array],
               gemm: GroupedGemm, activation: GatedActivation) -> jax.Array:
  """Each expert's gated FFN on its rows: gate and up in one grouped GEMM, then the down projection.

  `weights`: w_in_ED2F, w_out_EFD and, when the experts have biases, b_in_E2F and b_out_ED.
  """
  w_in_ED2F, w_out_EFD = weights["w_in_ED2F"], weights["w_out_EFD"]
  num_experts, d_model, _, d_ff = w_in_ED2F.shape
  num_rows = x_XD.shape[0]
  h_X2F = gemm(x_XD, w_in_ED2F.reshape(num_experts, d_model, 2 * d_ff), group_sizes_E)
  h_X2F = h_X2F.reshape(num_rows, 2, d_ff)
  if "b_in_E2F" in weights:
    h_X2F = h_X2F + _row_bias(weights["b_in_E2F"], group_sizes_E, num_rows)
  hidden_XF = checkpoint_name(activation(h_X2F[:, 0], h_X2F[:, 1]), "expert_hidden")
  y_XD = gemm(hidden_XF, w_out_EFD, group_sizes_E)
  if "b_out_ED" in weights:
    y_XD = y_XD + _row_bias(weights["b_out_ED"], group_sizes_E, num_rows)
  return y_XD


# --- per-expert blocks: batched GEMMs, with the rows past a block through the grouped GEMM ---

BatchedGemm = Callable[[jax.Array, jax.Array], jax.Array]  # (x_ECK, w_EKN) -> y_ECN


@functools.cache
def batched_gemm(fp8_grad_format: str | None = None) -> BatchedGemm:
  if fp8_grad_format is None:
    return lambda x_ECK, w_EKN: jnp.einsum("eck,ekn->ecn", x_ECK, w_EKN)
  return batched_fp8(fp8_grad_format)


def block_capacity(mean_rows_per_expert: float, factor: float) -> int:
  """Rows in each expert's block: `factor` times the mean, rounded up to a multiple of 16."""
  return max(16, -(-math.ceil(factor * mean_rows_per_expert) // 16) * 16)


def blocked_expert_ffn(x_XD: jax.Array, group_sizes_E: jax.Array, weights: dict[str, jax.Array],
                       capacity: int, batched: BatchedGemm, grouped: GroupedGemm,
                       activation: GatedActivation, devices: tuple[str, ...] = ()) -> jax.Array:
  """`expert_ffn` with each expert's first `capacity` rows in a block of its own, so the GEMMs are
  one batched GEMM over experts (XLA's cuBLAS call, which also runs FP8); the rows an expert has
  past its block (none when routing is balanced within the capacity) go through `expert_ffn` with
  the grouped GEMM. Dropless either way.
  """
  num_rows = x_XD.shape[0]
  num_experts = group_sizes_E.shape[0]
  starts_E = jnp.cumsum(group_sizes_E) - group_sizes_E
  expert_X = row_groups(group_sizes_E, num_rows)
  rank_X = jnp.arange(num_rows) - jnp.take(starts_E, expert_X, mode="fill", fill_value=num_rows)
  # Block slot e * capacity + c holds row starts[e] + c; num_rows marks an empty slot, and
  # num_experts * capacity a row in no block.
  slot_C = jnp.arange(capacity)
  source_S = jnp.where(slot_C < group_sizes_E[:, None], starts_E[:, None] + slot_C,
                       num_rows).reshape(-1)
  in_block_X = (expert_X < num_experts) & (rank_X < capacity)
  slot_X = jnp.where(in_block_X, expert_X * capacity + rank_X, num_experts * capacity)
  x_ECD = move_rows(x_XD, source_S, slot_X).reshape(num_experts, capacity, -1)
  y_ECD = _block_ffn(x_ECD, weights, batched, activation)
  y_XD = move_rows(y_ECD.reshape(num_experts * capacity, -1), slot_X, source_S)

  # The overflow: its row j holds row starts[e] + capacity + (j - over_starts[e]) of its expert e.
  # Its buffer is as long as x, the worst case.
  over_E = jnp.maximum(group_sizes_E - capacity, 0)
  over_starts_E = jnp.cumsum(over_E) - over_E
  expert_J = row_groups(over_E, num_rows)
  source_J = (jnp.take(starts_E - over_starts_E, expert_J, mode="fill", fill_value=num_rows)
              + capacity + jnp.arange(num_rows))
  source_J = jnp.where(expert_J < num_experts, source_J, num_rows)
  over_X = (expert_X < num_experts) & (rank_X >= capacity)
  target_X = jnp.where(over_X, jnp.take(over_starts_E, expert_X, mode="fill", fill_value=0)
                       + rank_X - capacity, num_rows)

  def overflow(x_XD, weights, rows):
    source_J, target_X, over_E = rows
    y_JD = expert_ffn(move_rows(x_XD, source_J, target_X), over_E, weights, grouped, activation)
    return move_rows(y_JD, target_X, source_J).astype(x_XD.dtype)

  # The grouped GEMM's cost follows its buffer's length, not the rows in it, so it is skipped
  # when no expert overflows on any device (`devices`: the mesh axes to agree over; every device
  # takes the same branch, so collectives XLA schedules around the branch stay matched).
  overflows = jnp.sum(over_E) > 0
  if devices:
    overflows = jax.lax.pmax(overflows.astype(jnp.int32), devices) > 0
  y_over_XD = run_if(overflows, overflow, x_XD, weights, (source_J, target_X, over_E))
  return y_XD + y_over_XD.astype(y_XD.dtype)


@jax.custom_vjp
def move_rows(x_RD: jax.Array, source_S: jax.Array, inverse_R: jax.Array) -> jax.Array:
  """Rows x[source[s]] (zeros where source[s] is out of range), for a one-to-one `source` whose
  inverse is `inverse` (row r went to slot inverse[r], out of range if nowhere). Its gradient is
  the gather by `inverse`: no scatter-add, which is slow on GPUs."""
  return jnp.take(x_RD, source_S, axis=0, mode="fill", fill_value=0)


def _move_rows_fwd(x_RD, source_S, inverse_R):
  return move_rows(x_RD, source_S, inverse_R), (source_S, inverse_R)


def _move_rows_bwd(residuals, dy_SD):
  source_S, inverse_R = residuals
  return jnp.take(dy_SD, inverse_R, axis=0, mode="fill", fill_value=0), None, None


move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


def run_if(pred: jax.Array, fn: Callable, x, differentiable, constant):
  """fn(x, differentiable, constant) when `pred`, else zeros like x, for fn returning an array
  shaped like x; `constant` (integer arrays) gets no gradient. Every array fn uses must come in
  through the arguments. Differentiable with only the inputs kept for the backward pass, which
  also runs only when `pred` (differentiating `lax.cond` directly would fill the skipped
  branch's residuals with zeros, a copy as large as the work skipped)."""

  @jax.custom_vjp
  def run(pred, x, differentiable, constant):
    return jax.lax.cond(pred, fn, lambda x, *_: jnp.zeros_like(x), x, differentiable, constant)

  def run_fwd(pred, x, differentiable, constant):
    return run(pred, x, differentiable, constant), (pred, x, differentiable, constant)

  def run_bwd(residuals, dy):
    pred, x, differentiable, constant = residuals

    def grads(x, differentiable):
      return jax.vjp(lambda x, d: fn(x, d, constant), x, differentiable)[1](dy)

    zeros = lambda x, differentiable: jax.tree.map(jnp.zeros_like, (x, differentiable))
    dx, dd = jax.lax.cond(pred, grads, zeros, x, differentiable)
    return None, dx, dd, jax.tree.map(lambda _: None, constant)

  run.defvjp(run_fwd, run_bwd)
  return run(pred, x, differentiable, constant)


def _block_ffn(x_ECD, weights, batched: BatchedGemm, activation: GatedActivation):
  w_in_ED2F, w_out_EFD = weights["w_in_ED2F"], weights["w_out_EFD"]
  num_experts, d_model, _, d_ff = w_in_ED2F.shape
  h_EC2F = batched(x_ECD, w_in_ED2F.reshape(num_experts, d_model, 2 * d_ff))
  h_EC2F = h_EC2F.reshape(*h_EC2F.shape[:2], 2, d_ff)
  if "b_in_E2F" in weights:
    h_EC2F = h_EC2F + weights["b_in_E2F"][:, None]
  hidden_ECF = checkpoint_name(activation(h_EC2F[..., 0, :], h_EC2F[..., 1, :]), "expert_hidden")
  y_ECD = batched(hidden_ECF, w_out_EFD)
  if "b_out_ED" in weights:
    y_ECD = y_ECD + weights["b_out_ED"][:, None]
  return y_ECD
