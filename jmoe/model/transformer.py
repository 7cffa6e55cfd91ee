"""The decoder-only MoE transformer: embedding, first-k dense blocks, MoE blocks, norm, head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import ModelConfig, MoEConfig
from jmoe.model.block import RESIDUAL_AXES, Block
from jmoe.model.layers import Embed, RMSNorm, param
from jmoe.model.stack import make_stack, run_stack
from jmoe.moe.route import RouterStats
from jmoe.parallel import constrain


class Transformer(nnx.Module):

  def __init__(self, cfg: ModelConfig, moe: MoEConfig, *, param_dtype=jnp.float32,
               dtype=jnp.float32, remat: str = "none", rngs: nnx.Rngs):
    self.cfg = cfg
    self.remat = remat
    kw = dict(param_dtype=param_dtype, dtype=dtype)
    self.embed = Embed(cfg.vocab_size, cfg.d_model, cfg.init_std, rngs=rngs, **kw)
    self.dense_blocks = (
        make_stack(lambda r: Block(cfg, None, rngs=r, **kw), moe.first_k_dense, rngs)
        if moe.first_k_dense else None)
    self.first_moe_layer = moe.first_k_dense
    self.moe_blocks = make_stack(lambda r: Block(cfg, moe, rngs=r, **kw),
                                 cfg.num_layers - moe.first_k_dense, rngs)
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.head_DV = (
        None if cfg.tie_embeddings else
        param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), std=cfg.init_std,
              dtype=param_dtype))

  def __call__(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None, *,
               rng: jax.Array | None = None) -> tuple[jax.Array, RouterStats]:
    """Returns float32 logits and the router stats of each MoE layer (leading axis: MoE layers).

    `rng` is for training-time noise (router jitter); without it the model is deterministic.
    """
    if positions_BS is None:
      positions_BS = jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]), tokens_BS.shape)
    x_BSD = constrain(self.embed(tokens_BS), RESIDUAL_AXES)
    if self.dense_blocks is not None:
      x_BSD, _ = run_stack(self.dense_blocks, x_BSD, positions_BS, remat=self.remat)
    x_BSD, stats = run_stack(self.moe_blocks, x_BSD, positions_BS, remat=self.remat, rng=rng,
                             first_layer=self.first_moe_layer)
    x_BSD = self.final_norm(x_BSD)
    if self.head_DV is None:
      logits_BSV = self.embed.attend(x_BSD)
    else:
      logits_BSV = jnp.einsum("bsd,dv->bsv", x_BSD, self.head_DV[...].astype(x_BSD.dtype))
    logits_BSV = constrain(logits_BSV, ("act_batch", "act_seq", "act_vocab"))
    return logits_BSV.astype(jnp.float32), stats
