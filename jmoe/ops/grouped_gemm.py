"""Grouped GEMMs: row block e of x_XD (group_sizes_E[e] rows) times w_EDF[e], all groups at once.

Every backend has this one signature, is differentiable (one custom VJP or plain autodiff), and
gives zeros for the rows past sum(group_sizes_E), in the output and in the input gradient; an
expert with no rows gets a zero weight gradient. The registry `GEMM_BACKENDS` is the list of names
`moe.gemm` may take (besides `auto`):
  tokamax     tokamax's Mosaic GPU kernel (NVIDIA Hopper and newer; the `gpu` extra)
  ragged_dot  XLA's `jax.lax.ragged_dot` (any platform; on GPUs it expands to dense work)
  dense       a reference einsum over all experts with a row-to-expert mask (exact, E times the
              work)
`auto` picks tokamax on GPUs where it imports, and ragged_dot elsewhere. With FP8 expert GEMMs a
backend runs its float8 kernels (`GroupedGemm.fp8`) through `jmoe.ops.fp8_grouped.grouped_fp8`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp

from jmoe.errors import choice
from jmoe.ops.fp8_grouped import RaggedKernels, batched_fp8, grouped_fp8
from jmoe.ops.rows import members

log = logging.getLogger("jmoe")


@dataclasses.dataclass(frozen=True)
class GroupedGemm:
  """A grouped GEMM (x_XD, w_EDF, group_sizes_E) -> y_XF and what jmoe needs to know of it."""
  gemm: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
  fp8: RaggedKernels | None = None  # its float8 kernels, if it has any
  # Whether its gradients keep shard_map's varying-axes types (a custom VJP around a foreign
  # kernel may drop them; shard_map then runs with that check off).
  keeps_varying_axes: bool = True

  def __call__(self, x_XD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
    return self.gemm(x_XD, w_EDF, group_sizes_E)


# --- XLA's ragged dot, and the dense reference ---

_RAGGED_CONTRACT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def _ragged_dot(x_XD, w_EDF, group_sizes_E):
  return jax.lax.ragged_dot(x_XD, w_EDF, group_sizes_E)


def _ragged_dot_f8(x_XD, w_EDF, group_sizes_E):
  return jax.lax.ragged_dot(x_XD, w_EDF, group_sizes_E, preferred_element_type=jnp.bfloat16)


def _ragged_contract_f8(x_XD, y_XF, group_sizes_E):
  return jax.lax.ragged_dot_general(x_XD, y_XF, group_sizes_E, _RAGGED_CONTRACT,
                                    preferred_element_type=jnp.bfloat16)


def _dense(x_XD, w_EDF, group_sizes_E):
  y_XEF = jnp.einsum("xd,edf->xef", x_XD, w_EDF)
  return jnp.einsum("xef,xe->xf", y_XEF, members(group_sizes_E, x_XD.shape[0]).astype(y_XEF.dtype))


def _dense_f8(x_XD, w_EDF, group_sizes_E):
  y_XEF = jnp.einsum("xd,edf->xef", x_XD, w_EDF, preferred_element_type=jnp.float32)
  return jnp.einsum("xef,xe->xf", y_XEF, members(group_sizes_E, x_XD.shape[0]).astype(
      jnp.float32)).astype(jnp.bfloat16)


def _dense_contract_f8(x_XD, y_XF, group_sizes_E):
  member_XE1 = members(group_sizes_E, x_XD.shape[0])[:, :, None]
  y_XEF = jnp.where(member_XE1, y_XF[:, None, :], jnp.zeros((), y_XF.dtype))
  return jnp.einsum("xd,xef->edf", x_XD, y_XEF, preferred_element_type=jnp.bfloat16)


# --- tokamax ---

def _tokamax_kernel(x_XD, w_EDF, group_sizes_E):
  import tokamax
  return tokamax.ragged_dot(x_XD, w_EDF, group_sizes_E, implementation="mosaic")


def _rows_in_groups(y_XF, group_sizes_E):
  in_groups_X1 = (jnp.arange(y_XF.shape[0]) < jnp.sum(group_sizes_E))[:, None]
  return jnp.where(in_groups_X1, y_XF, jnp.zeros_like(y_XF))


@jax.custom_vjp
def _tokamax(x_XD, w_EDF, group_sizes_E):
  # The kernel leaves what no row of a group touches unwritten: output rows past the groups, and
  # in the backward pass the input gradient of those rows and the weight gradient of an expert
  # with no rows. Zeros are selected there, so the contract holds and no garbage reaches the
  # optimizer.
  return _rows_in_groups(_tokamax_kernel(x_XD, w_EDF, group_sizes_E), group_sizes_E)


def _tokamax_fwd(x_XD, w_EDF, group_sizes_E):
  y_XF, vjp = jax.vjp(lambda x, w: _tokamax_kernel(x, w, group_sizes_E), x_XD, w_EDF)
  return _rows_in_groups(y_XF, group_sizes_E), (vjp, group_sizes_E)


def _tokamax_bwd(residuals, dy_XF):
  vjp, group_sizes_E = residuals
  dx_XD, dw_EDF = vjp(_rows_in_groups(dy_XF, group_sizes_E))
  dw_EDF = jnp.where((group_sizes_E > 0)[:, None, None], dw_EDF, jnp.zeros_like(dw_EDF))
  return _rows_in_groups(dx_XD, group_sizes_E), dw_EDF, None


_tokamax.defvjp(_tokamax_fwd, _tokamax_bwd)


GEMM_BACKENDS: dict[str, GroupedGemm] = {
    # tokamax has no float8 kernel for Hopper: its sm90 grouped GEMM takes bf16/f16 operands only
    # (float8 weights are dequantized in the kernel, which needs a newer ptxas than jax's CUDA 13
    # wheels bring).
    "tokamax": GroupedGemm(_tokamax, keeps_varying_axes=False),
    "ragged_dot": GroupedGemm(_ragged_dot, RaggedKernels(_ragged_dot_f8, _ragged_contract_f8)),
    "dense": GroupedGemm(_dense, RaggedKernels(_dense_f8, _dense_contract_f8)),
}


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


def check_backend(name: str) -> None:
  """A ConfigError unless `name` is `auto` or a registered backend."""
  if name != "auto":
    choice("moe.gemm", name, GEMM_BACKENDS)


@functools.cache
def grouped_gemm(name: str, fp8_grad_format: str | None = None) -> GroupedGemm:
  """The backend `name` (or `auto`'s choice); in FP8 (gradients in `fp8_grad_format`) when that
  is given and the backend has float8 kernels."""
  check_backend(name)
  name = auto_gemm() if name == "auto" else name
  backend = GEMM_BACKENDS[name]
  if fp8_grad_format is None:
    return backend
  if backend.fp8 is None:
    log.warning("moe.gemm=%s has no FP8 grouped GEMM on this GPU, so its grouped GEMMs stay in "
                "bf16; moe.expert_blocks > 0 runs the experts' blocks as FP8 batched GEMMs", name)
    return backend
  return GroupedGemm(grouped_fp8(backend.fp8, fp8_grad_format), backend.fp8)


BatchedGemm = Callable[[jax.Array, jax.Array], jax.Array]  # (x_ECD, w_EDF) -> y_ECF


@functools.cache
def batched_gemm(fp8_grad_format: str | None = None) -> BatchedGemm:
  """One GEMM per expert over per-expert blocks of rows: XLA's batched GEMM (cuBLAS on GPUs), in
  FP8 when `fp8_grad_format` is given."""
  if fp8_grad_format is None:
    return lambda x_ECD, w_EDF: jnp.einsum("ecd,edf->ecf", x_ECD, w_EDF)
  return batched_fp8(fp8_grad_format)
