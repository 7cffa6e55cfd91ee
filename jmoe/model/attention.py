"""Causal grouped-query attention with rotary embeddings.

The kernel is chosen by `model.attention_kernel` (jmoe/ops/attention.py: cuDNN's fused kernel on
GPUs, XLA's elsewhere); windows, packed documents and the sinks reach it as what they are, never as
an [S, S] mask. Options (config): QK-norm, sliding windows (on every layer, or alternating with
full attention), projection biases, and attention sinks.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jmoe.config import LoRAConfig, ModelConfig
from jmoe.model import kv_cache
from jmoe.model.layers import RMSNorm
from jmoe.model.lora import adapted, adapters
from jmoe.model.qk_clip import grouped_factors, scale_weights
from jmoe.model.rope import apply_rope, softmax_scale
from jmoe.ops.attention import attention, masked_attention
from jmoe.ops.fp8 import Fp8Recipe, fp8_site
from jmoe.ops.max_logit import max_logit
from jmoe.ops.params import param
from jmoe.parallel import constrain, split_count

# Queries are split over context devices; keys and values are gathered whole along the sequence.
Q_AXES = ("act_batch", "act_seq", "act_heads", None)
KV_AXES = ("act_batch", None, "act_kv_heads", None)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, rngs: nnx.Rngs,
               fp8: Fp8Recipe | None = None, lora: LoRAConfig | None = None):
    self.cfg = cfg
    self.dtype = dtype
    self.fp8_q, self.fp8_k, self.fp8_v, self.fp8_o = (fp8_site(fp8) for _ in range(4))
    d, h, g, a = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kw = dict(std=cfg.init_std, dtype=param_dtype)
    self.w_q_DHA = param(rngs, (d, h, a), ("embed", "heads", "head_dim"), matrix="ioo", **kw)
    self.w_k_DGA = param(rngs, (d, g, a), ("embed", "kv_heads", "head_dim"), matrix="ioo", **kw)
    self.w_v_DGA = param(rngs, (d, g, a), ("embed", "kv_heads", "head_dim"), matrix="ioo", **kw)
    self.w_o_HAD = param(rngs, (h, a, d), ("heads", "head_dim", "embed"), matrix="iio", **kw)
    bias = lambda shape, axes: (param(rngs, shape, axes, std=0, dtype=param_dtype, kind="bias")
                                if cfg.attention_bias else None)
    self.b_q_HA = bias((h, a), ("heads", "head_dim"))
    self.b_k_GA = bias((g, a), ("kv_heads", "head_dim"))
    self.b_v_GA = bias((g, a), ("kv_heads", "head_dim"))
    self.b_o_D = bias((d,), ("norm",))
    self.sinks_H = (param(rngs, (h,), ("heads",), std=0, dtype=param_dtype, kind="bias")
                    if cfg.attention_sinks else None)
    self.q_norm = RMSNorm(a, cfg.norm_eps, param_dtype=param_dtype, rngs=rngs) if cfg.qk_norm else None
    self.k_norm = RMSNorm(a, cfg.norm_eps, param_dtype=param_dtype, rngs=rngs) if cfg.qk_norm else None
    self.lora = adapters(lora, "attention", rngs, w_q_DHA=(self.w_q_DHA, 1),
                         w_k_DGA=(self.w_k_DGA, 1), w_v_DGA=(self.w_v_DGA, 1),
                         w_o_HAD=(self.w_o_HAD, 2))

  def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, layer=0,
               segment_ids_BS: jax.Array | None = None, with_max_logit: bool = False):
    """The output, and with `with_max_logit` each head's largest scaled logit [H] (else None).
    `segment_ids_BS`: which packed document each token belongs to; tokens attend only within
    their own (None: one document per row)."""
    q_BSHA, k_BSGA, v_BSGA = self._qkv(x_BSD, positions_BS)
    out_BSHA = checkpoint_name(self._attend(q_BSHA, k_BSGA, v_BSGA, layer, segment_ids_BS),
                               "attention_out")
    cfg = self.cfg
    top_H = (max_logit(q_BSHA, k_BSGA, scale=softmax_scale(cfg.head_dim, cfg.yarn),
                       window=cfg.sliding_window, windowed=cfg.windowed(layer),
                       segment_ids=segment_ids_BS) if with_max_logit else None)
    return self._out(out_BSHA), top_H

  def clip_logits(self, eta_H: jax.Array, alpha: float) -> None:
    """QK-clip: scales the query and key projections (and biases) so that each head's logits
    scale by its factor in `eta_H` (leading axes: a layer stack's), the shared key heads as
    jmoe/model/qk_clip.py's `grouped_factors` says."""
    q_H, k_G = grouped_factors(eta_H, alpha, self.cfg.num_kv_heads)
    scale_weights(self.w_q_DHA, q_H[..., None, :, None])
    scale_weights(self.w_k_DGA, k_G[..., None, :, None])
    if self.b_q_HA is not None:
      scale_weights(self.b_q_HA, q_H[..., None])
      scale_weights(self.b_k_GA, k_G[..., None])

  def cache_shapes(self, batch: int, length: int) -> dict[str, tuple[int, ...]]:
    g, a = self.cfg.num_kv_heads, self.cfg.head_dim
    return {"k": (batch, length, g, a), "v": (batch, length, g, a)}

  def decode(self, x_BSD: jax.Array, positions_BS: jax.Array, layer, cache: dict):
    """The tokens at `positions_BS` (consecutive in each row) against the cache of what came
    before them (jmoe/model/kv_cache.py); returns the output and the cache with them written."""
    q_BSHA, k_BSGA, v_BSGA = self._qkv(x_BSD, positions_BS)
    start_B = positions_BS[:, 0]
    cache = {"k": kv_cache.write(cache["k"], k_BSGA, start_B),
             "v": kv_cache.write(cache["v"], v_BSGA, start_B)}
    cfg = self.cfg
    allowed_B1ST = kv_cache.visible(positions_BS, cache["k"].shape[1], cfg.sliding_window,
                                    cfg.windowed(layer))
    out_BSHA = self._masked(q_BSHA, cache["k"].astype(q_BSHA.dtype),
                            cache["v"].astype(q_BSHA.dtype), allowed_B1ST)
    return self._out(out_BSHA), cache

  def _qkv(self, x_BSD, positions_BS):
    cfg, dt = self.cfg, self.dtype
    proj = lambda name, b, site: adapted(x_BSD, getattr(self, name), 1, site, dt, self.lora,
                                         name) + (0 if b is None else b[...].astype(dt))
    q_BSHA = proj("w_q_DHA", self.b_q_HA, self.fp8_q)
    k_BSGA = proj("w_k_DGA", self.b_k_GA, self.fp8_k)
    v_BSGA = proj("w_v_DGA", self.b_v_GA, self.fp8_v)
    if self.q_norm is not None:
      q_BSHA, k_BSGA = self.q_norm(q_BSHA), self.k_norm(k_BSGA)
    q_BSHA = constrain(apply_rope(q_BSHA, positions_BS, cfg.rope_theta, cfg.yarn), Q_AXES)
    k_BSGA = constrain(apply_rope(k_BSGA, positions_BS, cfg.rope_theta, cfg.yarn), KV_AXES)
    return q_BSHA, k_BSGA, constrain(v_BSGA, KV_AXES)

  def _out(self, out_BSHA):
    dt = self.dtype
    out_BSD = adapted(constrain(out_BSHA, Q_AXES), self.w_o_HAD, 2, self.fp8_o, dt, self.lora,
                      "w_o_HAD")
    return out_BSD if self.b_o_D is None else out_BSD + self.b_o_D[...].astype(dt)

  def _attend(self, q_BSHA, k_BSGA, v_BSGA, layer, segment_ids_BS) -> jax.Array:
    cfg = self.cfg
    return attention(q_BSHA, k_BSGA, v_BSGA, scale=softmax_scale(cfg.head_dim, cfg.yarn),
                     kernel=cfg.attention_kernel, window=cfg.sliding_window,
                     windowed=cfg.windowed(layer), segment_ids=segment_ids_BS,
                     sinks=None if self.sinks_H is None else self.sinks_H[...],
                     max_documents=cfg.attention_max_documents,
                     batch_shards=split_count(Q_AXES, q_BSHA.shape))

  def _masked(self, q_BSHA, k_BTGA, v_BTGA, allowed_B1ST):
    """Attention where `allowed_B1ST` says which keys each query sees, and the sinks."""
    return masked_attention(q_BSHA, k_BTGA, v_BTGA, allowed_B1ST,
                            scale=softmax_scale(self.cfg.head_dim, self.cfg.yarn),
                            sinks=None if self.sinks_H is None else self.sinks_H[...])
