"""The MoE layer: router and expert parameters, and the four stages run in order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import MoEConfig
from jmoe.model.layers import param
from jmoe.model.mlp import SwiGLU
from jmoe.parallel import active_layout
from jmoe.moe.combine import combine
from jmoe.moe.dispatch import dispatch
from jmoe.moe.exchange import sharded_experts
from jmoe.moe.experts import expert_ffn, grouped_gemm
from jmoe.moe.route import RouterStats, route


class MoE(nnx.Module):

  def __init__(self, d_model: int, cfg: MoEConfig, std: float, *, param_dtype, dtype,
               rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = dtype
    e, f = cfg.num_experts, cfg.d_ff_expert
    self.router_DE = param(rngs, (d_model, e), ("embed", None), std=std, dtype=param_dtype)
    self.w_in_ED2F = param(rngs, (e, d_model, 2, f), ("expert", "expert_embed", None, "expert_mlp"),
                           std=std, dtype=param_dtype)
    self.w_out_EFD = param(rngs, (e, f, d_model), ("expert", "expert_mlp", "expert_embed"), std=std,
                           dtype=param_dtype)
    self.shared = (
        SwiGLU(d_model, cfg.num_shared_experts * f, std, param_dtype=param_dtype, dtype=dtype,
               rngs=rngs)
        if cfg.num_shared_experts else None)

  def __call__(self, x_BSD: jax.Array) -> tuple[jax.Array, RouterStats]:
    batch, seq, d_model = x_BSD.shape
    x_TD = x_BSD.reshape(batch * seq, d_model)
    with jax.named_scope("route"):
      logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32),
                             self.router_DE[...].astype(jnp.float32))
      routing = route(logits_TE, self.cfg.router, self.cfg.top_k)
    w_in_ED2F = self.w_in_ED2F[...].astype(self.dtype)
    w_out_EFD = self.w_out_EFD[...].astype(self.dtype)
    gemm = grouped_gemm(self.cfg.gemm)
    layout = active_layout()
    if layout is None:  # everything on one device
      with jax.named_scope("dispatch"):
        dispatched = dispatch(x_TD, routing.expert_ids_TK, self.cfg.num_experts)
      with jax.named_scope("experts"):
        y_XD = expert_ffn(dispatched.x_XD, dispatched.group_sizes_E, w_in_ED2F, w_out_EFD, gemm)
      with jax.named_scope("combine"):
        y_TD = combine(y_XD, dispatched, routing.weights_TK)
    else:
      with jax.named_scope("expert_parallel"):
        y_TD = sharded_experts(layout, self.cfg.dispatcher, x_TD, routing.expert_ids_TK,
                               routing.weights_TK, w_in_ED2F, w_out_EFD, gemm)
    y_BSD = y_TD.reshape(batch, seq, d_model)
    if self.shared is not None:
      y_BSD = y_BSD + self.shared(x_BSD)
    return y_BSD, routing.stats
