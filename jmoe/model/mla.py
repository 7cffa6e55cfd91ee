"""Multi-head latent attention (DeepSeek-V2/V3).

Queries come from the model width directly or through a normalised rank-R_q latent; keys and values
come from one normalised rank-R_kv latent per token, expanded per head; a separate R-dim rotary key
is shared by all heads. Letters here: R latent rank, N no-rope head dims, P rope head dims, V value
head dims, K = N + P query/key head dims.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jmoe.config import ModelConfig
from jmoe.model.attention import KV_AXES, Q_AXES, attention, same_document
from jmoe.model.fp8 import Fp8Recipe, fp8_site, project
from jmoe.model.layers import RMSNorm, param
from jmoe.model.rope import apply_rope, softmax_scale
from jmoe.parallel import constrain

# DeepSeek's latent norms use this epsilon whatever the model's own norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs,
               fp8: Fp8Recipe | None = None):
    self.cfg, self.dtype = cfg, dtype
    self.fp8_q_a, self.fp8_q, self.fp8_kv_a, self.fp8_kv_b, self.fp8_o = (
        fp8_site(fp8) for _ in range(5))
    m, d, h, std = cfg.mla, cfg.d_model, cfg.num_heads, cfg.init_std
    k = m.qk_nope_head_dim + m.qk_rope_head_dim
    kw = dict(std=std, dtype=param_dtype)
    if m.q_lora_rank:
      self.w_q_a_DR = param(rngs, (d, m.q_lora_rank), ("embed", None), **kw)
      self.q_a_norm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, param_dtype=param_dtype, rngs=rngs)
      self.w_q_b_RHK = param(rngs, (m.q_lora_rank, h, k), ("latent", "heads", None), **kw)
    else:
      self.w_q_DHK = param(rngs, (d, h, k), ("embed", "heads", None), **kw)
    self.w_kv_a_DR = param(rngs, (d, m.kv_lora_rank + m.qk_rope_head_dim), ("embed", None), **kw)
    self.kv_a_norm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, param_dtype=param_dtype, rngs=rngs)
    self.w_kv_b_RHK = param(rngs, (m.kv_lora_rank, h, m.qk_nope_head_dim + m.v_head_dim),
                            ("latent", "heads", None), **kw)
    self.w_o_HVD = param(rngs, (h, m.v_head_dim, d), ("heads", None, "embed"), **kw)

  def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, layer=0,
               segment_ids_BS: jax.Array | None = None) -> jax.Array:
    m, dt, cfg = self.cfg.mla, self.dtype, self.cfg
    w = lambda p: p[...].astype(dt)
    if m.q_lora_rank:
      q_BSR = self.q_a_norm(project(x_BSD, w(self.w_q_a_DR), 1, self.fp8_q_a))
      q_BSHK = project(q_BSR, w(self.w_q_b_RHK), 1, self.fp8_q)
    else:
      q_BSHK = project(x_BSD, w(self.w_q_DHK), 1, self.fp8_q)
    kv_BSR = project(x_BSD, w(self.w_kv_a_DR), 1, self.fp8_kv_a)
    kv_BSR, k_rope_BSP = kv_BSR[..., :m.kv_lora_rank], kv_BSR[..., m.kv_lora_rank:]
    kv_BSHK = project(self.kv_a_norm(kv_BSR), w(self.w_kv_b_RHK), 1, self.fp8_kv_b)
    k_nope_BSHN, v_BSHV = kv_BSHK[..., :m.qk_nope_head_dim], kv_BSHK[..., m.qk_nope_head_dim:]

    rope = lambda t: apply_rope(t, positions_BS, cfg.rope_theta, cfg.yarn)
    q_BSHK = jnp.concatenate([q_BSHK[..., :m.qk_nope_head_dim],
                              rope(q_BSHK[..., m.qk_nope_head_dim:])], axis=-1)
    k_rope_BSHP = jnp.broadcast_to(rope(k_rope_BSP[:, :, None, :]),
                                   (*k_nope_BSHN.shape[:3], m.qk_rope_head_dim))
    k_BSHK = jnp.concatenate([k_nope_BSHN, k_rope_BSHP], axis=-1)
    # The attention kernel wants values as wide as keys: pad V up to K, drop the padding after.
    head_k = m.qk_nope_head_dim + m.qk_rope_head_dim
    v_BSHK = jnp.pad(v_BSHV, ((0, 0), (0, 0), (0, 0), (0, max(head_k - m.v_head_dim, 0))))
    q_BSHK, k_BSHK, v_BSHK = (constrain(q_BSHK, Q_AXES), constrain(k_BSHK, KV_AXES),
                              constrain(v_BSHK, KV_AXES))
    mask = None
    if segment_ids_BS is not None:
      seq = segment_ids_BS.shape[1]
      mask = jnp.tril(jnp.ones((seq, seq), bool))[None, None] & same_document(segment_ids_BS)
    out_BSHK = attention(q_BSHK, k_BSHK, v_BSHK, mask=mask, is_causal=mask is None,
                         scale=softmax_scale(head_k, cfg.yarn), kernel=cfg.attention_kernel)
    out_BSHV = checkpoint_name(constrain(out_BSHK, Q_AXES)[..., :m.v_head_dim], "attention_out")
    return project(out_BSHV, w(self.w_o_HVD), 2, self.fp8_o)
