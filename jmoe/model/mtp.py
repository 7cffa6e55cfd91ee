"""Multi-token prediction (DeepSeek-V3): each module k = 1..depth sees the previous depth's hidden
state at position i and the embedding of token i+k, runs one transformer block, and predicts token
i+k+1 through the model's own output head. Training adds their mean loss, weighted; inference
ignores them."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jmoe.config import LoRAConfig, ModelConfig, MoEConfig
from jmoe.model.block import RESIDUAL_AXES, Block
from jmoe.model.layers import RMSNorm
from jmoe.ops.fp8 import Fp8Recipe, fp8_site, project
from jmoe.ops.params import param
from jmoe.parallel import constrain, gathered


class MTPModule(nnx.Module):

  def __init__(self, cfg: ModelConfig, moe: MoEConfig, *, param_dtype, dtype, rngs: nnx.Rngs,
               fp8: Fp8Recipe | None = None, lora: LoRAConfig | None = None,
               max_logit: bool = False):
    d = cfg.d_model
    norm = lambda: RMSNorm(d, cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.dtype = dtype
    self.embed_norm, self.hidden_norm, self.out_norm = norm(), norm(), norm()
    self.w_proj_2DD = param(rngs, (2 * d, d), (None, "embed"), std=cfg.init_std, dtype=param_dtype,
                            matrix="io")
    self.fp8_proj = fp8_site(fp8)
    self.block = Block(cfg, moe, param_dtype=param_dtype, dtype=dtype, rngs=rngs, fp8=fp8,
                       lora=lora, max_logit=max_logit)

  def __call__(self, h_BSD, emb_BSD, positions_BS, segment_ids_BS, rng, layer):
    """Returns (the new hidden state for the next module, the normed state for the head, the
    block's LayerStats)."""
    x_BS2D = jnp.concatenate([self.embed_norm(emb_BSD), self.hidden_norm(h_BSD)], axis=-1)
    x_BSD = constrain(project(x_BS2D, gathered(self.w_proj_2DD, self.dtype), 1, self.fp8_proj),
                      RESIDUAL_AXES)
    x_BSD, stats = self.block(x_BSD, positions_BS, segment_ids_BS, rng=rng, layer=layer)
    return x_BSD, self.out_norm(x_BSD), stats
