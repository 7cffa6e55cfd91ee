"""Grouped GEMMs: row block e of x_XD (group_sizes_E[e] rows) times w_EDF[e], all groups at once.

Every backend has this one signature, is differentiable (one custom VJP or plain autodiff), and
gives zeros for the rows past sum(group_sizes_E), in the output and in the input gradient; an
expert with no rows gets a zero weight gradient. The registry `GEMM_BACKENDS` is the list of names
`moe.gemm` may take (besides `auto`):
  mosaic      JAX's own Pallas Mosaic-GPU kernels (NVIDIA Hopper; jmoe/ops/mosaic_gemm.py)
  ragged_dot  XLA's `jax.lax.ragged_dot` (any platform; on GPUs it expands to dense work)
  dense       a reference einsum over all experts with a row-to-expert mask (exact, E times the
              work)
`auto` picks mosaic on Hopper GPUs and ragged_dot elsewhere; scripts/check_gpu.py holds every
backend to a float32 reference on the GPU, expert by expert (tokamax 0.0.17's kernel, measured
there with a weight gradient 4% off, is not among them). With FP8 expert GEMMs a backend runs its
float8 kernels (`GroupedGemm.fp8`) through `jmoe.ops.fp8_grouped.grouped_fp8`; mosaic's are
jmoe's own (jmoe/ops/fp8_mosaic.py: float8 operands, float32 accumulation, a bf16 output), and
so are its kernels for the blockwise recipe (`GroupedGemm.fp8_blockwise`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp

from jmoe.errors import choice
from jmoe.ops.fp8_blockwise import BlockwiseKernels, blockwise_grouped, quantize_row_blocks
from jmoe.ops.fp8_grouped import (RaggedKernels, batched_fp8, grouped_fp8, grouped_fp8_swiglu,
                                  quantize_rows)
from jmoe.ops.fp8_mosaic import PROMOTE_SETTINGS, mosaic_blockwise_kernels, mosaic_fp8_kernels
from jmoe.ops.mosaic_gemm import mosaic_grouped_gemm, on_hopper
from jmoe.ops.rows import members

log = logging.getLogger("jmoe")


@dataclasses.dataclass(frozen=True)
class GroupedGemm:
  """A grouped GEMM (x_XD, w_EDF, group_sizes_E) -> y_XF and what jmoe needs to know of it."""
  gemm: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
  fp8: RaggedKernels | None = None  # its float8 kernels, if it has any
  # its kernels for blockwise-scaled float8 operands, if it has any (else the blockwise recipe
  # runs its 16-bit GEMM on the dequantized operands)
  fp8_blockwise: BlockwiseKernels | None = None
  # its float8 kernels with their sums promoted to float32 from contractions of the given length
  # on (precision.fp8_promote), if it has any
  fp8_promoted: Callable[[int], RaggedKernels] | None = None
  # In FP8: how it quantizes its input's rows, x_XD -> `quantized` (float8 rows and their
  # scales), so that a caller may quantize the rows before gathering them and hand them over.
  quantize_rows: Callable[[jax.Array], tuple[jax.Array, jax.Array]] | None = None
  # In FP8: the first projection and SwiGLU as one op, (x_XD, w_ED2F, group_sizes_E, quantized)
  # -> (silu(gate) * up [X, F], its rows quantized as `quantize_rows` makes them), whose
  # backward pass quantizes d(gate, up) as it makes it (`grouped_fp8_swiglu`); None where the
  # projection and the activation run apart.
  swiglu: Callable[..., jax.Array] | None = None
  # In FP8 on per-expert weight scales: it (and `swiglu`) takes each expert's weight amax,
  # `w_amax_E`, made beforehand (jmoe/ops/fp8.py `WeightAmax`), instead of reading the weight.
  takes_weight_amax: bool = False
  # Whether its gradients keep shard_map's varying-axes types (a custom VJP around a foreign
  # kernel may drop them; shard_map then runs with that check off).
  keeps_varying_axes: bool = True
  portable: bool = True  # runs (and traces) on every platform, not only on its GPU

  def __call__(self, x_XD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array,
               quantized: tuple[jax.Array, jax.Array] | None = None,
               w_amax_E: jax.Array | None = None) -> jax.Array:
    """`quantized`: x_XD's rows as `quantize_rows` makes them (only with it); `w_amax_E`: each
    expert's weight amax (only where it `takes_weight_amax`)."""
    if w_amax_E is not None:
      return self.gemm(x_XD, w_EDF, group_sizes_E, quantized, w_amax_E)
    if quantized is None:
      return self.gemm(x_XD, w_EDF, group_sizes_E)
    return self.gemm(x_XD, w_EDF, group_sizes_E, quantized)


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


GEMM_BACKENDS: dict[str, GroupedGemm] = {
    # Their custom VJPs drop shard_map's varying types.
    "mosaic": GroupedGemm(mosaic_grouped_gemm, mosaic_fp8_kernels(), mosaic_blockwise_kernels(),
                          lambda k: mosaic_fp8_kernels(promote_from_k=k),
                          keeps_varying_axes=False, portable=False),
    "ragged_dot": GroupedGemm(_ragged_dot, RaggedKernels(_ragged_dot_f8, _ragged_contract_f8)),
    "dense": GroupedGemm(_dense, RaggedKernels(_dense_f8, _dense_contract_f8)),
}


@functools.cache
def auto_gemm() -> str:
  """mosaic on Hopper GPUs, XLA's ragged_dot elsewhere."""
  if on_hopper():
    return "mosaic"
  if jax.default_backend() == "gpu":
    log.warning("moe.gemm=auto: no grouped GEMM kernel of jmoe's runs on %s, so the experts use "
                "XLA's ragged_dot, which is slow on GPUs", jax.devices()[0].device_kind)
  return "ragged_dot"


def check_backend(name: str) -> None:
  """A ConfigError unless `name` is `auto` or a registered backend."""
  if name != "auto":
    choice("moe.gemm", name, GEMM_BACKENDS)


@functools.cache
def grouped_gemm(name: str, fp8_grad_format: str | None = None, blockwise: bool = False,
                 weight_gradient: str = "bf16", promote: str = "long") -> GroupedGemm:
  """The backend `name` (or `auto`'s choice); in FP8 (gradients in `fp8_grad_format`) when that
  is given and the backend has float8 kernels, the weight gradient in `weight_gradient` (bf16
  where the backend has a 16-bit contraction for it, else float8), the kernels' sums promoted
  to float32 as `promote` (precision.fp8_promote) says where the backend can; with `blockwise`,
  on DeepSeek-V3's blockwise scaled operands, through its blockwise float8 kernels where it has
  them, else its 16-bit ones (jmoe/ops/fp8_blockwise.py)."""
  check_backend(name)
  name = auto_gemm() if name == "auto" else name
  backend = GEMM_BACKENDS[name]
  if fp8_grad_format is None:
    return backend
  if blockwise:
    return dataclasses.replace(backend, gemm=blockwise_grouped(backend.gemm, fp8_grad_format,
                                                               backend.fp8_blockwise),
                               quantize_rows=quantize_row_blocks)
  if backend.fp8 is None:
    log.warning("moe.gemm=%s has no FP8 grouped GEMM, so its grouped GEMMs stay in bf16; "
                "moe.expert_blocks > 0 runs the experts' blocks as FP8 batched GEMMs", name)
    return backend
  kernels = backend.fp8
  promote_from_k = PROMOTE_SETTINGS[promote]
  if promote_from_k is not None and backend.fp8_promoted is not None:
    kernels = backend.fp8_promoted(promote_from_k)
  return dataclasses.replace(
      backend, gemm=grouped_fp8(kernels, fp8_grad_format, weight_gradient),
      quantize_rows=quantize_rows,
      swiglu=grouped_fp8_swiglu(kernels, fp8_grad_format, weight_gradient),
      takes_weight_amax=True)


def has_fp8_kernels(name: str) -> bool:
  """Whether the backend `name` (or `auto`'s choice) has float8 grouped kernels: FP8 runs its
  expert GEMMs on per-expert weight scales (not blockwise), which take a kept weight amax."""
  check_backend(name)
  return GEMM_BACKENDS[auto_gemm() if name == "auto" else name].fp8 is not None


BatchedGemm = Callable[[jax.Array, jax.Array], jax.Array]  # (x_ECD, w_EDF) -> y_ECF


@functools.cache
def batched_gemm(fp8_grad_format: str | None = None) -> BatchedGemm:
  """One GEMM per expert over per-expert blocks of rows: XLA's batched GEMM (cuBLAS on GPUs), in
  FP8 when `fp8_grad_format` is given."""
  if fp8_grad_format is None:
    return lambda x_ECD, w_EDF: jnp.einsum("ecd,edf->ecf", x_ECD, w_EDF)
  return batched_fp8(fp8_grad_format)
