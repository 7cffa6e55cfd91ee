"""The dense SwiGLU MLP (used by dense layers and by shared experts)."""

from __future__ import annotations

import jax
from flax import nnx

from jmoe.ops.fp8 import Fp8Recipe, fp8_site, project
from jmoe.ops.params import param
from jmoe.parallel import constrain, gathered


class SwiGLU(nnx.Module):

  def __init__(self, d_model: int, d_ff: int, std: float, *, param_dtype, dtype, rngs: nnx.Rngs,
               fp8: Fp8Recipe | None = None):
    self.dtype = dtype
    self.fp8_in, self.fp8_out = fp8_site(fp8), fp8_site(fp8)
    # Gate and up projections are one weight, so they are one GEMM.
    self.w_in_D2F = param(rngs, (d_model, 2, d_ff), ("embed", None, "mlp"), std=std,
                          dtype=param_dtype)
    self.w_out_FD = param(rngs, (d_ff, d_model), ("mlp", "embed"), std=std, dtype=param_dtype)

  def __call__(self, x_BSD: jax.Array) -> jax.Array:
    h_BS2F = project(x_BSD, gathered(self.w_in_D2F, self.dtype), 1, self.fp8_in)
    h_BS2F = constrain(h_BS2F, ("act_batch", "act_seq", None, "act_mlp"))
    h_BSF = jax.nn.silu(h_BS2F[:, :, 0]) * h_BS2F[:, :, 1]
    return project(h_BSF, gathered(self.w_out_FD, self.dtype), 1, self.fp8_out)
