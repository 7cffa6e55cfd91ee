"""Expert compute: the SwiGLU FFN of every expert as grouped GEMMs over expert-sorted rows.

A grouped GEMM multiplies row block e of x_XD (group_sizes_E[e] rows) by w_EDF[e]. Rows past
sum(group_sizes_E) belong to no expert and give zeros. Backends share this one signature:
  ragged_dot  XLA's `jax.lax.ragged_dot` (any platform)
  dense       a reference einsum over all experts with a row-to-expert mask (exact, E times the work)
`auto` picks the fastest backend the platform has.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

GroupedGemm = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _ragged_dot(x_XD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
  return jax.lax.ragged_dot(x_XD, w_EDF, group_sizes_E)


def _dense(x_XD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
  ends_E = jnp.cumsum(group_sizes_E)
  rows_X = jnp.arange(x_XD.shape[0])
  member_XE = (rows_X[:, None] >= ends_E - group_sizes_E) & (rows_X[:, None] < ends_E)
  y_XEF = jnp.einsum("xd,edf->xef", x_XD, w_EDF)
  return jnp.einsum("xef,xe->xf", y_XEF, member_XE.astype(y_XEF.dtype))


GEMM_BACKENDS: dict[str, GroupedGemm] = {"ragged_dot": _ragged_dot, "dense": _dense}


def grouped_gemm(name: str) -> GroupedGemm:
  if name == "auto":
    name = "ragged_dot"
  return GEMM_BACKENDS[name]


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
  expert_X = jnp.searchsorted(jnp.cumsum(group_sizes_E), jnp.arange(num_rows), side="right")
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
  y_XD = gemm(activation(h_X2F[:, 0], h_X2F[:, 1]), w_out_EFD, group_sizes_E)
  if "b_out_ED" in weights:
    y_XD = y_XD + _row_bias(weights["b_out_ED"], group_sizes_E, num_rows)
  return y_XD
