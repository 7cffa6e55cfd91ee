"""Expert compute: the SwiGLU FFN of every expert as grouped GEMMs over expert-sorted rows.

A grouped GEMM multiplies row block e of x_XD (group_sizes_E[e] rows) by w_EDF[e]. Rows past
sum(group_sizes_E) belong to no expert and give zeros. Backends share this one signature:
  tokamax     tokamax's Mosaic GPU kernel (NVIDIA Hopper and newer; the `gpu` extra)
  ragged_dot  XLA's `jax.lax.ragged_dot` (any platform; on GPUs it expands to dense work)
  dense       a reference einsum over all experts with a row-to-expert mask (exact, E times the work)
`auto` picks tokamax on GPUs where it imports, and ragged_dot elsewhere.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

log = logging.getLogger("jmoe")

GroupedGemm = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _ragged_dot(x_XD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
  return jax.lax.ragged_dot(x_XD, w_EDF, group_sizes_E)


def _dense(x_XD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
  ends_E = jnp.cumsum(group_sizes_E)
  rows_X = jnp.arange(x_XD.shape[0])
  member_XE = (rows_X[:, None] >= ends_E - group_sizes_E) & (rows_X[:, None] < ends_E)
  y_XEF = jnp.einsum("xd,edf->xef", x_XD, w_EDF)
  return jnp.einsum("xef,xe->xf", y_XEF, member_XE.astype(y_XEF.dtype))


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


def grouped_gemm(name: str) -> GroupedGemm:
  return GEMM_BACKENDS[auto_gemm() if name == "auto" else name]


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
  hidden_XF = checkpoint_name(activation(h_X2F[:, 0], h_X2F[:, 1]), "expert_hidden")
  y_XD = gemm(hidden_XF, w_out_EFD, group_sizes_E)
  if "b_out_ED" in weights:
    y_XD = y_XD + _row_bias(weights["b_out_ED"], group_sizes_E, num_rows)
  return y_XD
