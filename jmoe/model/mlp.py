"""The dense SwiGLU MLP (used by dense layers and by shared experts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.model.layers import param
from jmoe.parallel import constrain


class SwiGLU(nnx.Module):

  def __init__(self, d_model: int, d_ff: int, std: float, *, param_dtype, dtype, rngs: nnx.Rngs):
    self.dtype = dtype
    # Gate and up projections are one weight, so they are one GEMM.
    self.w_in_D2F = param(rngs, (d_model, 2, d_ff), ("embed", None, "mlp"), std=std,
                          dtype=param_dtype)
    self.w_out_FD = param(rngs, (d_ff, d_model), ("mlp", "embed"), std=std, dtype=param_dtype)

  def __call__(self, x_BSD: jax.Array) -> jax.Array:
    h_BS2F = jnp.einsum("bsd,dcf->bscf", x_BSD, self.w_in_D2F[...].astype(self.dtype))
    h_BS2F = constrain(h_BS2F, ("act_batch", "act_seq", None, "act_mlp"))
    h_BSF = jax.nn.silu(h_BS2F[:, :, 0]) * h_BS2F[:, :, 1]
    return jnp.einsum("bsf,fd->bsd", h_BSF, self.w_out_FD[...].astype(self.dtype))
