"""Causal grouped-query attention with rotary embeddings.

The kernel is `jax.nn.dot_product_attention`, which runs cuDNN's fused attention on NVIDIA GPUs and
XLA's elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig
from jmoe.model.layers import RMSNorm, param
from jmoe.model.rope import apply_rope, softmax_scale
from jmoe.parallel import constrain

# Queries are split over context devices; keys and values are gathered whole along the sequence.
Q_AXES = ("act_batch", "act_seq", "act_heads", None)
KV_AXES = ("act_batch", None, "act_kv_heads", None)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = dtype
    d, h, g, a = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    std = cfg.init_std
    self.w_q_DHA = param(rngs, (d, h, a), ("embed", "heads", "head_dim"), std=std, dtype=param_dtype)
    self.w_k_DGA = param(rngs, (d, g, a), ("embed", "kv_heads", "head_dim"), std=std,
                         dtype=param_dtype)
    self.w_v_DGA = param(rngs, (d, g, a), ("embed", "kv_heads", "head_dim"), std=std,
                         dtype=param_dtype)
    self.w_o_HAD = param(rngs, (h, a, d), ("heads", "head_dim", "embed"), std=std, dtype=param_dtype)
    self.q_norm = RMSNorm(a, cfg.norm_eps, param_dtype=param_dtype, rngs=rngs) if cfg.qk_norm else None
    self.k_norm = RMSNorm(a, cfg.norm_eps, param_dtype=param_dtype, rngs=rngs) if cfg.qk_norm else None
    # A window of W keys: the token itself and the W - 1 before it.
    self.window = (cfg.sliding_window - 1, 0) if cfg.sliding_window else None

  def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array) -> jax.Array:
    dt = self.dtype
    q_BSHA = jnp.einsum("bsd,dha->bsha", x_BSD, self.w_q_DHA[...].astype(dt))
    k_BSGA = jnp.einsum("bsd,dga->bsga", x_BSD, self.w_k_DGA[...].astype(dt))
    v_BSGA = jnp.einsum("bsd,dga->bsga", x_BSD, self.w_v_DGA[...].astype(dt))
    if self.q_norm is not None:
      q_BSHA, k_BSGA = self.q_norm(q_BSHA), self.k_norm(k_BSGA)
    q_BSHA = constrain(apply_rope(q_BSHA, positions_BS, self.cfg.rope_theta, self.cfg.yarn), Q_AXES)
    k_BSGA = constrain(apply_rope(k_BSGA, positions_BS, self.cfg.rope_theta, self.cfg.yarn), KV_AXES)
    v_BSGA = constrain(v_BSGA, KV_AXES)
    out_BSHA = jax.nn.dot_product_attention(
        q_BSHA, k_BSGA, v_BSGA, is_causal=True, local_window_size=self.window,
        scale=softmax_scale(self.cfg.head_dim, self.cfg.yarn))
    out_BSHA = constrain(out_BSHA, Q_AXES)
    return jnp.einsum("bsha,had->bsd", out_BSHA, self.w_o_HAD[...].astype(dt))
