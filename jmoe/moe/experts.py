"""Expert compute: each local expert's gated FFN on the rows dispatch sorted to it.

The experts' weights travel as `ExpertWeights`, a small pytree that also knows how it is split
over the expert layout. `ExpertCompute` runs them: gate and up in one grouped GEMM (a backend of
jmoe/ops/grouped_gemm.py), the gated activation, the down projection; or, with
`moe.expert_blocks > 0`, per-expert blocks through one batched GEMM with the rows past a block
through the grouped GEMM (`blocked_expert_ffn`). Dropless either way.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jmoe.moe.dispatch import Rows
from jmoe.ops.activations import GATED_ACTIVATIONS, GatedActivation, swiglu
from jmoe.ops.fp8_grouped import weight_gradient_for
from jmoe.ops.grouped_gemm import BatchedGemm, GroupedGemm, batched_gemm, grouped_gemm
from jmoe.ops.rows import move_rows, row_groups, run_if, take_rows
from jmoe.parallel import ExpertAxes


@struct.dataclass
class ExpertLoRA:
  """Each expert's low-rank adapter factors (R: the rank) for its two projections; the
  projections become x.W + scale (x.A).B, through the same grouped GEMMs."""
  a_in_EDR: jax.Array
  b_in_ER2F: jax.Array
  a_out_EFR: jax.Array
  b_out_ERD: jax.Array
  scale: float = struct.field(pytree_node=False, default=1.0)

  def specs(self, expert, tensor) -> ExpertLoRA:
    return ExpertLoRA(a_in_EDR=P(expert, None, None), b_in_ER2F=P(expert, None, None, tensor),
                      a_out_EFR=P(expert, tensor, None), b_out_ERD=P(expert, None, None),
                      scale=self.scale)


@struct.dataclass
class ExpertWeights:
  """Every (local) expert's FFN weights, in the compute dtype; biases only where the experts have
  them (GPT-OSS), adapters only with LoRA on the experts; each weight's amax per expert where
  the train step keeps it for FP8 (jmoe/ops/fp8.py `WeightAmax`)."""
  w_in_ED2F: jax.Array  # gate and up projections
  w_out_EFD: jax.Array
  b_in_E2F: jax.Array | None = None
  b_out_ED: jax.Array | None = None
  lora: ExpertLoRA | None = None
  amax_in_E: jax.Array | None = None
  amax_out_E: jax.Array | None = None

  @property
  def num_experts(self) -> int:
    return self.w_in_ED2F.shape[0]

  def specs(self, axes: ExpertAxes) -> ExpertWeights:
    """The same tree of PartitionSpecs: experts over the expert axes, F over the tensor axes."""
    expert, tensor = axes.expert or None, axes.tensor or None
    bias = lambda b, spec: None if b is None else spec
    # (an amax is of the whole expert's weight, on every device of its expert-tensor group)
    return ExpertWeights(w_in_ED2F=P(expert, None, None, tensor), w_out_EFD=P(expert, tensor, None),
                         b_in_E2F=bias(self.b_in_E2F, P(expert, None, tensor)),
                         b_out_ED=bias(self.b_out_ED, P(expert, None)),
                         lora=None if self.lora is None else self.lora.specs(expert, tensor),
                         amax_in_E=bias(self.amax_in_E, P(expert)),
                         amax_out_E=bias(self.amax_out_E, P(expert)))


def gated_activation(cfg) -> GatedActivation:
  """The MoE config's gated activation (`moe.activation`, with its limit and alpha)."""
  return GATED_ACTIVATIONS[cfg.activation](cfg.swiglu_limit, cfg.swiglu_alpha)


@dataclasses.dataclass(frozen=True)
class ExpertCompute:
  """How the experts multiply: the grouped GEMM, the batched GEMM for per-expert blocks (when
  `block_factor` > 0: each block holds up to that multiple of the mean rows per expert), the
  gated activation, and the GEMMs of LoRA adapters (never FP8: their factors are thin).
  `grouped_few_rows`: the grouped GEMM for experts of fewer than FP8_WEIGHT_GRADIENT_ROWS rows
  each (precision.fp8_weight_gradient=auto: its weight gradient in bf16), if it differs."""
  grouped: GroupedGemm
  batched: BatchedGemm
  activation: GatedActivation
  block_factor: float = 0.0
  adapter_grouped: GroupedGemm | None = None
  adapter_batched: BatchedGemm | None = None
  grouped_few_rows: GroupedGemm | None = None

  @classmethod
  def from_config(cls, cfg, fp8_grad_format: str | None = None, blockwise: bool = False,
                  weight_gradient: str = "bf16", promote: str = "long") -> ExpertCompute:
    """The MoE config's; its GEMMs in FP8 (gradients in `fp8_grad_format`) when that is given,
    on blockwise scales with `blockwise`, the grouped weight gradient in `weight_gradient`
    (`auto`: by the rows per expert, `weight_gradient_for`), the kernels' sums promoted as
    `promote` (precision.fp8_promote) says."""
    grouped = lambda how: grouped_gemm(cfg.gemm, fp8_grad_format, blockwise, how, promote)
    many, few = (weight_gradient_for(weight_gradient, rows) for rows in (math.inf, 0))
    return cls(grouped(many), batched_gemm(fp8_grad_format),
               gated_activation(cfg), cfg.expert_blocks, grouped_gemm(cfg.gemm, None),
               batched_gemm(None), grouped(few) if few != many else None)

  def quantize_rows(self, weights: ExpertWeights):
    """How the first GEMM quantizes its input rows, where dispatch may do it before gathering
    them (FP8 grouped GEMMs, neither per-expert blocks nor adapters, which read the rows in 16
    bits), else None."""
    if self.block_factor or weights.lora is not None:
      return None
    return self.grouped.quantize_rows

  def __call__(self, rows: Rows, weights: ExpertWeights, axes: ExpertAxes) -> jax.Array:
    """y_XD for the rows of this device's experts (`axes`: where they run)."""
    if weights.b_out_ED is not None and axes.tensor:  # ETP partial sums add the down bias once
      first = (jax.lax.axis_index(axes.tensor) == 0).astype(weights.b_out_ED.dtype)
      weights = weights.replace(b_out_ED=weights.b_out_ED * first)
    grouped = self.grouped
    if (self.grouped_few_rows is not None
        and weight_gradient_for("auto", rows.mean_rows_per_expert) == "bf16"):
      grouped = self.grouped_few_rows
    if not self.block_factor:
      return expert_ffn(rows.x_XD, rows.group_sizes_E, weights, grouped, self.activation,
                        self.adapter_grouped, rows.quantized)
    capacity = block_capacity(rows.mean_rows_per_expert, self.block_factor)
    # the grouped GEMM takes only the rows past the blocks: few per expert
    return blocked_expert_ffn(rows.x_XD, rows.group_sizes_E, weights, capacity, self.batched,
                              self.grouped_few_rows or self.grouped, self.activation,
                              axes.tokens, self.adapter_batched, self.adapter_grouped)


def _row_bias(b_EF: jax.Array, group_sizes_E: jax.Array, num_rows: int) -> jax.Array:
  """Each row's expert's bias; rows past the groups (no expert) get zeros."""
  return take_rows(b_EF, row_groups(group_sizes_E, num_rows))


def expert_ffn(x_XD: jax.Array, group_sizes_E: jax.Array, weights: ExpertWeights,
               gemm: GroupedGemm, activation: GatedActivation,
               adapter_gemm: GroupedGemm | None = None, quantized=None) -> jax.Array:
  """Each expert's gated FFN on its rows: gate and up in one grouped GEMM, then the down
  projection; with adapters, each projection plus its low-rank pair (`adapter_gemm`, default
  `gemm`). `quantized`: x's rows as `gemm.quantize_rows` makes them, for the first GEMM. Where
  `gemm` has a fused first projection and SwiGLU (FP8: `GroupedGemm.swiglu`) and the FFN is
  plain SwiGLU without adapters or biases, the two run as that one op. The weights' kept amaxes
  go to `gemm` where it takes them (`GroupedGemm.takes_weight_amax`)."""
  num_experts, d_model, _, d_ff = weights.w_in_ED2F.shape
  num_rows = x_XD.shape[0]
  lora, low = weights.lora, adapter_gemm or gemm
  w_in_ED2F = weights.w_in_ED2F.reshape(num_experts, d_model, 2 * d_ff)
  fused = getattr(gemm, "swiglu", None)  # a GroupedGemm's, not a bare GEMM function's
  amax_in_E = weights.amax_in_E if getattr(gemm, "takes_weight_amax", False) else None
  if fused is not None and activation is swiglu and lora is None and weights.b_in_E2F is None:
    # the hidden, and its rows quantized for the down projection (which reads only those)
    hidden_XF, (hidden_q, scale_X1) = fused(x_XD, w_in_ED2F, group_sizes_E, quantized, amax_in_E)
    # All three named, so that a policy saving the hidden spares the first projection again in
    # the backward pass; the float8 values as their bytes (named float8 values came out NaN in
    # the gradient of a recomputed layer, jax 0.11.2).
    hidden_XF, bytes_XF, scale_X1 = checkpoint_name(
        (hidden_XF, jax.lax.bitcast_convert_type(hidden_q, jnp.uint8), scale_X1), "expert_hidden")
    rows = (jax.lax.bitcast_convert_type(bytes_XF, hidden_q.dtype), scale_X1)
    return _down(hidden_XF, group_sizes_E, weights, gemm, low, num_rows, rows)
  h_X2F = (gemm(x_XD, w_in_ED2F, group_sizes_E, quantized) if amax_in_E is None
           else gemm(x_XD, w_in_ED2F, group_sizes_E, quantized, amax_in_E))
  if lora is not None:
    up_ER2F = lora.b_in_ER2F.reshape(num_experts, -1, 2 * d_ff) * lora.scale
    h_X2F = h_X2F + low(low(x_XD, lora.a_in_EDR, group_sizes_E), up_ER2F, group_sizes_E)
  h_X2F = h_X2F.reshape(num_rows, 2, d_ff)
  if weights.b_in_E2F is not None:
    h_X2F = h_X2F + _row_bias(weights.b_in_E2F, group_sizes_E, num_rows)
  hidden_XF = checkpoint_name(activation(h_X2F[:, 0], h_X2F[:, 1]), "expert_hidden")
  return _down(hidden_XF, group_sizes_E, weights, gemm, low, num_rows)


def _down(hidden_XF, group_sizes_E, weights: ExpertWeights, gemm: GroupedGemm,
          adapter_gemm: GroupedGemm, num_rows: int, quantized=None) -> jax.Array:
  """The down projection of `expert_ffn`, with its adapter and bias where the experts have them;
  `quantized`: the hidden's rows as `gemm.quantize_rows` makes them, if made already."""
  amax_out_E = weights.amax_out_E if getattr(gemm, "takes_weight_amax", False) else None
  y_XD = (gemm(hidden_XF, weights.w_out_EFD, group_sizes_E)
          if amax_out_E is None and quantized is None
          else gemm(hidden_XF, weights.w_out_EFD, group_sizes_E, quantized, amax_out_E))
  lora = weights.lora
  if lora is not None:
    y_XD = y_XD + adapter_gemm(adapter_gemm(hidden_XF, lora.a_out_EFR, group_sizes_E),
                               lora.b_out_ERD * lora.scale, group_sizes_E)
  if weights.b_out_ED is not None:
    y_XD = y_XD + _row_bias(weights.b_out_ED, group_sizes_E, num_rows)
  return y_XD


# --- per-expert blocks: batched GEMMs, with the rows past a block through the grouped GEMM ---


def block_capacity(mean_rows_per_expert: float, factor: float) -> int:
  """Rows in each expert's block: `factor` times the mean, rounded up to a multiple of 16."""
  return max(16, -(-math.ceil(factor * mean_rows_per_expert) // 16) * 16)


def blocked_expert_ffn(x_XD: jax.Array, group_sizes_E: jax.Array, weights: ExpertWeights,
                       capacity: int, batched: BatchedGemm, grouped: GroupedGemm,
                       activation: GatedActivation, devices: tuple[str, ...] = (),
                       adapter_batched: BatchedGemm | None = None,
                       adapter_grouped: GroupedGemm | None = None) -> jax.Array:
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
  source_EC = jnp.where(slot_C < group_sizes_E[:, None], starts_E[:, None] + slot_C, num_rows)
  in_block_X = (expert_X < num_experts) & (rank_X < capacity)
  slot_X = jnp.where(in_block_X, expert_X * capacity + rank_X, num_experts * capacity)
  x_ECD = move_rows(x_XD, source_EC.reshape(-1), slot_X).reshape(num_experts, capacity, -1)
  y_ECD = _block_ffn(x_ECD, weights, batched, activation, adapter_batched)
  y_XD = move_rows(y_ECD.reshape(num_experts * capacity, -1), slot_X, source_EC.reshape(-1))

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
    y_JD = expert_ffn(move_rows(x_XD, source_J, target_X), over_E, weights, grouped, activation,
                      adapter_grouped)
    return move_rows(y_JD, target_X, source_J).astype(x_XD.dtype)

  # The grouped GEMM's cost follows its buffer's length, not the rows in it, so it is skipped
  # when no expert overflows on any device (`devices`: the mesh axes to agree over; every device
  # takes the same branch, so collectives XLA schedules around the branch stay matched).
  overflows = jnp.sum(over_E) > 0
  if devices:
    overflows = jax.lax.pmax(overflows.astype(jnp.int32), devices) > 0
  y_over_XD = run_if(overflows, overflow, x_XD, weights, (source_J, target_X, over_E))
  return y_XD + y_over_XD.astype(y_XD.dtype)


def _block_ffn(x_ECD, weights: ExpertWeights, batched: BatchedGemm, activation: GatedActivation,
               adapter_batched: BatchedGemm | None = None):
  num_experts, d_model, _, d_ff = weights.w_in_ED2F.shape
  lora, low = weights.lora, adapter_batched or batched
  h_EC2F = batched(x_ECD, weights.w_in_ED2F.reshape(num_experts, d_model, 2 * d_ff))
  if lora is not None:
    up_ER2F = lora.b_in_ER2F.reshape(num_experts, -1, 2 * d_ff) * lora.scale
    h_EC2F = h_EC2F + low(low(x_ECD, lora.a_in_EDR), up_ER2F)
  h_EC2F = h_EC2F.reshape(*h_EC2F.shape[:2], 2, d_ff)
  if weights.b_in_E2F is not None:
    h_EC2F = h_EC2F + weights.b_in_E2F[:, None]
  hidden_ECF = checkpoint_name(activation(h_EC2F[..., 0, :], h_EC2F[..., 1, :]), "expert_hidden")
  y_ECD = batched(hidden_ECF, weights.w_out_EFD)
  if lora is not None:
    y_ECD = y_ECD + low(low(hidden_ECF, lora.a_out_EFR), lora.b_out_ERD * lora.scale)
  if weights.b_out_ED is not None:
    y_ECD = y_ECD + weights.b_out_ED[:, None]
  return y_ECD
