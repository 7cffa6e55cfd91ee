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


def expert_ffn(x_XD: jax.Array, group_sizes_E: jax.Array, w_in_ED2F: jax.Array,
               w_out_EFD: jax.Array, gemm: GroupedGemm) -> jax.Array:
  """SwiGLU per expert: gate and up in one grouped GEMM, then the down projection."""
  num_experts, d_model, _, d_ff = w_in_ED2F.shape
  h_X2F = gemm(x_XD, w_in_ED2F.reshape(num_experts, d_model, 2 * d_ff), group_sizes_E)
  h_X2F = h_X2F.reshape(-1, 2, d_ff)
  h_XF = jax.nn.silu(h_X2F[:, 0]) * h_X2F[:, 1]
  return gemm(h_XF, w_out_EFD, group_sizes_E)
