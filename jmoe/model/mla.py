"""Multi-head latent attention (DeepSeek-V2/V3).

Queries come from the model width directly or through a normalised rank-R latent; keys and values
come from one normalised rank-R latent per token, expanded per head; a separate rotary key (p dims)
is shared by all heads. Letters (jmoe/__init__.py): A = n + p the query/key head dim, of which n
dims get no rotary embedding and p do; W the value head dim; I = R + p the width of the key/value
down-projection (the latent and the shared rotary key); Y = n + W the width of its per-head
up-projection (the keys' no-rope part and the values).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jmoe.config import LoRAConfig, ModelConfig
from jmoe.model.attention import KV_AXES, Q_AXES
from jmoe.model import kv_cache
from jmoe.model.layers import RMSNorm
from jmoe.model.lora import adapted, adapters
from jmoe.model.qk_clip import scale_weights
from jmoe.model.rope import apply_rope, softmax_scale
from jmoe.ops.attention import attention, masked_attention
from jmoe.ops.fp8 import Fp8Recipe, fp8_site
from jmoe.ops.max_logit import max_logit
from jmoe.ops.params import param
from jmoe.parallel import constrain, in_stages, split_count

# DeepSeek's latent norms use this epsilon whatever the model's own norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs,
               fp8: Fp8Recipe | None = None, lora: LoRAConfig | None = None):
    self.cfg, self.dtype = cfg, dtype
    self.fp8_q_a, self.fp8_q, self.fp8_kv_a, self.fp8_kv_b, self.fp8_o = (
        fp8_site(fp8) for _ in range(5))
    m, d, h, std = cfg.mla, cfg.d_model, cfg.num_heads, cfg.init_std
    a = m.qk_nope_head_dim + m.qk_rope_head_dim
    kw = dict(std=std, dtype=param_dtype)
    if m.q_lora_rank:
      self.w_q_a_DR = param(rngs, (d, m.q_lora_rank), ("embed", None), matrix="io", **kw)
      self.q_a_norm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, param_dtype=param_dtype, rngs=rngs)
      self.w_q_b_RHA = param(rngs, (m.q_lora_rank, h, a), ("latent", "heads", None),
                             matrix="ioo", **kw)
    else:
      self.w_q_DHA = param(rngs, (d, h, a), ("embed", "heads", None), matrix="ioo", **kw)
    self.w_kv_a_DI = param(rngs, (d, m.kv_lora_rank + m.qk_rope_head_dim), ("embed", None),
                           matrix="io", **kw)
    self.kv_a_norm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, param_dtype=param_dtype, rngs=rngs)
    self.w_kv_b_RHY = param(rngs, (m.kv_lora_rank, h, m.qk_nope_head_dim + m.v_head_dim),
                            ("latent", "heads", None), matrix="ioo", **kw)
    self.w_o_HWD = param(rngs, (h, m.v_head_dim, d), ("heads", None, "embed"), matrix="iio", **kw)
    weight = lambda name: getattr(self, name, None)
    self.lora = adapters(lora, "attention", rngs, w_q_a_DR=(weight("w_q_a_DR"), 1),
                         w_q_b_RHA=(weight("w_q_b_RHA"), 1), w_q_DHA=(weight("w_q_DHA"), 1),
                         w_kv_a_DI=(self.w_kv_a_DI, 1), w_kv_b_RHY=(self.w_kv_b_RHY, 1),
                         w_o_HWD=(self.w_o_HWD, 2))

  def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, layer=0,
               segment_ids_BS: jax.Array | None = None, with_max_logit: bool = False):
    """As Attention's: the output, and each head's largest scaled logit [H] if asked."""
    q_BSHA, latent_BSR, k_rope_BSp = self._project(x_BSD, positions_BS)
    return self._attend(q_BSHA, latent_BSR, k_rope_BSp, segment_ids_BS, None, with_max_logit)

  def clip_logits(self, eta_H: jax.Array, alpha: float) -> None:
    """QK-clip (jmoe/model/qk_clip.py): q's no-rope part times eta^alpha and its rotary part
    times eta, each head's no-rope key (in the key/value up-projection) times eta^(1 - alpha);
    the shared rotary key and the values as they are. `eta_H`: leading axes a layer stack's."""
    m = self.cfg.mla
    n, p = m.qk_nope_head_dim, m.qk_rope_head_dim
    along = lambda f_H, width: jnp.broadcast_to(f_H[..., None], (*f_H.shape, width))
    q_HA = jnp.concatenate([along(eta_H ** alpha, n), along(eta_H, p)], axis=-1)
    k_HY = jnp.concatenate([along(eta_H ** (1 - alpha), n), along(jnp.ones_like(eta_H),
                                                                    m.v_head_dim)], axis=-1)
    scale_weights(self.w_q_b_RHA if m.q_lora_rank else self.w_q_DHA, q_HA[..., None, :, :])
    scale_weights(self.w_kv_b_RHY, k_HY[..., None, :, :])

  def cache_shapes(self, batch: int, length: int) -> dict[str, tuple[int, ...]]:
    """The latent cache: each token's normalised latent and its shared rotary key."""
    m = self.cfg.mla
    return {"latent": (batch, length, m.kv_lora_rank),
            "k_rope": (batch, length, m.qk_rope_head_dim)}

  def decode(self, x_BSD: jax.Array, positions_BS: jax.Array, layer, cache: dict):
    """As Attention.decode, with the latent cache: the keys and values of every cached token
    are expanded from its latent each step."""
    q_BSHA, latent_BSR, k_rope_BSp = self._project(x_BSD, positions_BS)
    start_B = positions_BS[:, 0]
    cache = {"latent": kv_cache.write(cache["latent"], latent_BSR, start_B),
             "k_rope": kv_cache.write(cache["k_rope"], k_rope_BSp, start_B)}
    allowed_B1ST = kv_cache.visible(positions_BS, cache["latent"].shape[1], 0, False)
    dt = q_BSHA.dtype
    return self._attend(q_BSHA, cache["latent"].astype(dt), cache["k_rope"].astype(dt),
                        allowed_B1ST=allowed_B1ST)[0], cache

  def _project(self, x_BSD, positions_BS):
    """The queries (rotary part roped), each token's normalised latent and its roped rotary key."""
    m, dt, cfg = self.cfg.mla, self.dtype, self.cfg
    proj = lambda x, name, site: adapted(x, getattr(self, name), 1, site, dt, self.lora, name)
    if m.q_lora_rank:
      q_BSR = self.q_a_norm(proj(x_BSD, "w_q_a_DR", self.fp8_q_a))
      q_BSHA = proj(q_BSR, "w_q_b_RHA", self.fp8_q)
    else:
      q_BSHA = proj(x_BSD, "w_q_DHA", self.fp8_q)
    kv_BSI = proj(x_BSD, "w_kv_a_DI", self.fp8_kv_a)
    kv_BSR, k_rope_BSp = kv_BSI[..., :m.kv_lora_rank], kv_BSI[..., m.kv_lora_rank:]
    rope = lambda t: apply_rope(t, positions_BS, cfg.rope_theta, cfg.yarn)
    q_BSHA = jnp.concatenate([q_BSHA[..., :m.qk_nope_head_dim],
                              rope(q_BSHA[..., m.qk_nope_head_dim:])], axis=-1)
    return q_BSHA, self.kv_a_norm(kv_BSR), rope(k_rope_BSp[:, :, None, :])[:, :, 0]

  def _attend(self, q_BSHA, latent_BTR, k_rope_BTp, segment_ids=None, allowed_B1ST=None,
              with_max_logit=False):
    """Attention of the queries over the keys and values expanded from the latents: causal
    (within each packed document, with `segment_ids`), or where `allowed_B1ST` says (decoding);
    and, if asked (not in decoding), the heads' largest scaled logits, else None."""
    m, dt, cfg = self.cfg.mla, self.dtype, self.cfg
    kv_BTHY = adapted(latent_BTR, self.w_kv_b_RHY, 1, self.fp8_kv_b, dt, self.lora, "w_kv_b_RHY")
    k_nope_BTHn, v_BTHW = kv_BTHY[..., :m.qk_nope_head_dim], kv_BTHY[..., m.qk_nope_head_dim:]
    k_rope_BTHp = jnp.broadcast_to(k_rope_BTp[:, :, None, :],
                                   (*k_nope_BTHn.shape[:3], m.qk_rope_head_dim))
    k_BTHA = jnp.concatenate([k_nope_BTHn, k_rope_BTHp], axis=-1)
    q_BSHA, k_BTHA, v_BTHW = (constrain(q_BSHA, Q_AXES), constrain(k_BTHA, KV_AXES),
                              constrain(v_BTHW, KV_AXES))
    scale = softmax_scale(m.qk_nope_head_dim + m.qk_rope_head_dim, cfg.yarn)
    top_H = None
    if allowed_B1ST is None:  # values as they are: the kernels take a value head dim of its own
      out_BSHW = attention(q_BSHA, k_BTHA, v_BTHW, scale=scale, kernel=cfg.attention_kernel,
                           segment_ids=segment_ids, max_documents=cfg.attention_max_documents,
                           batch_shards=split_count(Q_AXES, q_BSHA.shape), vmapped=in_stages())
      if with_max_logit:
        top_H = max_logit(q_BSHA, k_BTHA, scale=scale, segment_ids=segment_ids)
    else:
      out_BSHW = masked_attention(q_BSHA, k_BTHA, v_BTHW, allowed_B1ST, scale=scale)
    out_BSHW = checkpoint_name(constrain(out_BSHW, Q_AXES), "attention_out")
    out_BSD = adapted(out_BSHW, self.w_o_HWD, 2, self.fp8_o, dt, self.lora, "w_o_HWD")
    return out_BSD, top_H
