"""A pre-norm transformer block: attention, then a dense MLP or an MoE layer."""

from __future__ import annotations

import jax
from flax import nnx, struct

from jmoe.config import LoRAConfig, ModelConfig, MoEConfig
from jmoe.model.attention import Attention
from jmoe.model.layers import RESIDUAL_AXES, RMSNorm
from jmoe.model.mla import MLAttention
from jmoe.model.mlp import SwiGLU
from jmoe.moe import MoE, RouterStats
from jmoe.ops.fp8 import Fp8Recipe
from jmoe.parallel import constrain


@struct.dataclass
class LayerStats:
  """What a block reports besides its output; after a loop over layers (or for a whole model),
  each field has a leading layer axis."""
  router: RouterStats | None  # an MoE block's router (None: a dense MLP)
  max_logit_H: jax.Array | None  # its attention's largest scaled logit per head, if asked


class Block(nnx.Module):
  """With `moe=None` the block's MLP is dense (d_ff wide); otherwise it is an MoE layer.
  `max_logit`: report attention's largest logit per head (QK-clip reads it)."""

  def __init__(self, cfg: ModelConfig, moe: MoEConfig | None, *, param_dtype, dtype,
               rngs: nnx.Rngs, fp8: Fp8Recipe | None = None, lora: LoRAConfig | None = None,
               max_logit: bool = False):
    self.max_logit = max_logit
    kw = dict(param_dtype=param_dtype, rngs=rngs, fp8=fp8, lora=lora)
    norm_kw = dict(param_dtype=param_dtype, rngs=rngs)
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, **norm_kw)
    self.attn = (MLAttention if cfg.attention == "mla" else Attention)(cfg, dtype=dtype, **kw)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, **norm_kw)
    if moe is None:
      self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, cfg.init_std, dtype=dtype, **kw)
    else:
      shared = (lambda: SwiGLU(cfg.d_model, moe.num_shared_experts * moe.d_ff_expert, cfg.init_std,
                               dtype=dtype, **kw)) if moe.num_shared_experts else None
      self.mlp = MoE(cfg.d_model, moe, cfg.init_std, dtype=dtype, make_shared=shared, **kw)

  def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array,
               segment_ids_BS: jax.Array | None = None, rng: jax.Array | None = None,
               layer: jax.Array | int = 0):
    """Returns the block's output and its LayerStats. `rng`, if given, drives the router's
    training noise; `layer` is the block's index in the model."""
    a_BSD, top_H = self.attn(self.attn_norm(x_BSD), positions_BS, layer, segment_ids_BS,
                             self.max_logit)
    x_BSD, router = self._mlp_part(constrain(x_BSD + a_BSD, RESIDUAL_AXES), rng)
    return x_BSD, LayerStats(router=router, max_logit_H=top_H)

  def decode(self, x_BSD: jax.Array, positions_BS: jax.Array, layer, cache: dict):
    """The block on new tokens with its attention's cache (jmoe/model/kv_cache.py): the output
    and the cache with them written."""
    a_BSD, cache = self.attn.decode(self.attn_norm(x_BSD), positions_BS, layer, cache)
    x_BSD, _ = self._mlp_part(constrain(x_BSD + a_BSD, RESIDUAL_AXES), None)
    return x_BSD, cache

  def _mlp_part(self, x_BSD, rng):
    """The residual after the MLP (or MoE layer), and the router stats (None for an MLP)."""
    if isinstance(self.mlp, MoE):
      y_BSD, stats = self.mlp(self.mlp_norm(x_BSD), rng=rng)
    else:
      y_BSD, stats = self.mlp(self.mlp_norm(x_BSD)), None
    return constrain(x_BSD + y_BSD, RESIDUAL_AXES), stats
