"""The dense SwiGLU MLP (used by dense layers and by shared experts)."""

from __future__ import annotations

import jax
from flax import nnx

from jmoe.config import LoRAConfig
from jmoe.model.lora import adapted, adapters
from jmoe.ops.fp8 import Fp8Recipe, fp8_site
from jmoe.ops.params import param
from jmoe.parallel import constrain


class SwiGLU(nnx.Module):

  def __init__(self, d_model: int, d_ff: int, std: float, *, param_dtype, dtype, rngs: nnx.Rngs,
               fp8: Fp8Recipe | None = None, lora: LoRAConfig | None = None):
    self.dtype = dtype
    self.fp8_in, self.fp8_out = fp8_site(fp8), fp8_site(fp8)
    # Gate and up projections are one weight, so they are one GEMM.
    self.w_in_D2F = param(rngs, (d_model, 2, d_ff), ("embed", None, "mlp"), std=std, matrix="ibo",
                          dtype=param_dtype)
    self.w_out_FD = param(rngs, (d_ff, d_model), ("mlp", "embed"), std=std, dtype=param_dtype,
                          matrix="io")
    self.lora = adapters(lora, "mlp", rngs, w_in_D2F=(self.w_in_D2F, 1),
                         w_out_FD=(self.w_out_FD, 1))

  def __call__(self, x_BSD: jax.Array) -> jax.Array:
    h_BS2F = adapted(x_BSD, self.w_in_D2F, 1, self.fp8_in, self.dtype, self.lora, "w_in_D2F")
    h_BS2F = constrain(h_BS2F, ("act_batch", "act_seq", None, "act_mlp"))
    h_BSF = jax.nn.silu(h_BS2F[:, :, 0]) * h_BS2F[:, :, 1]
    return adapted(h_BSF, self.w_out_FD, 1, self.fp8_out, self.dtype, self.lora, "w_out_FD")
