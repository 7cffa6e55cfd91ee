"""The decoder-only MoE transformer: embedding, first-k dense blocks, MoE blocks, norm, head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import LoRAConfig, ModelConfig, MoEConfig
from jmoe.model.block import RESIDUAL_AXES, Block, LayerStats
from jmoe.model.layers import Embed, RMSNorm
from jmoe.model.mtp import MTPModule
from jmoe.model.pipeline import run_pipeline
from jmoe.model.stack import decode_stack, depth, make_stack, run_stack
from jmoe.moe import RouterStats, bias_step
from jmoe.ops.fp8 import Fp8Recipe
from jmoe.ops.params import param
from jmoe.parallel import active_layout, constrain, gathered

LOGITS_AXES = ("act_batch", "act_seq", "act_vocab")  # split over the vocabulary with TP


class Transformer(nnx.Module):

  def __init__(self, cfg: ModelConfig, moe: MoEConfig, *, param_dtype=jnp.float32,
               dtype=jnp.float32, remat: str = "none", rngs: nnx.Rngs,
               fp8: Fp8Recipe | None = None, lora: LoRAConfig | None = None,
               max_logit: bool = False):
    """`fp8`: run the GEMMs of attention, MLPs and experts in FP8 with this recipe (the
    embedding, router and LM head stay in the compute dtype or float32). `lora`: low-rank
    adapters on the weights it targets (jmoe/model/lora.py). `max_logit`: every attention
    layer reports its heads' largest logits (train.qk_clip)."""
    self.cfg = cfg
    self.remat = remat
    self.max_logit = max_logit
    kw = dict(param_dtype=param_dtype, dtype=dtype, fp8=fp8, lora=lora, max_logit=max_logit)
    self.embed = Embed(cfg.vocab_size, cfg.d_model, cfg.init_std, param_dtype=param_dtype,
                       dtype=dtype, rngs=rngs)
    self.dense_blocks = (
        make_stack(lambda r: Block(cfg, None, rngs=r, **kw), moe.first_k_dense, rngs)
        if moe.first_k_dense else None)
    self.first_moe_layer = moe.first_k_dense
    self.num_experts = moe.num_experts
    self.moe_blocks = (  # None: a dense model (as upcycling starts from)
        make_stack(lambda r: Block(cfg, moe, rngs=r, **kw), cfg.num_layers - moe.first_k_dense,
                   rngs, axis="stage_layers")
        if moe.first_k_dense < cfg.num_layers else None)
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.head_DV = (
        None if cfg.tie_embeddings else
        param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), std=cfg.init_std,
              dtype=param_dtype))
    self.mtp = nnx.List([MTPModule(cfg, moe, rngs=rngs, **kw) for _ in range(cfg.mtp_depth)])

  def __call__(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None,
               segment_ids_BS: jax.Array | None = None, *,
               rng: jax.Array | None = None, micro_batches: int = 1
               ) -> tuple[jax.Array, LayerStats]:
    """Returns float32 logits and the layers' stats: the router stats of each MoE layer (leading
    axis: MoE layers) and, with `max_logit`, each layer's heads' largest logits [L, H].

    Packed rows pass each token's position in its document and its document's segment id (tokens
    attend only within their document); by default a row is one document. `rng` is for
    training-time noise (router jitter); without it the model is deterministic. With pipeline
    stages in the active layout the MoE blocks take the batch in `micro_batches` pieces (router
    stats: their means).
    """
    h_BSD, stats = self.hidden(tokens_BS, positions_BS, segment_ids_BS, rng=rng,
                               micro_batches=micro_batches)
    return self._logits(h_BSD), stats

  def hidden(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None,
             segment_ids_BS: jax.Array | None = None, *, rng: jax.Array | None = None,
             micro_batches: int = 1) -> tuple[jax.Array, LayerStats]:
    """As `__call__`, but the normed last hidden states the LM head reads (`head_weights`), for
    losses that make the logits themselves a chunk at a time (jmoe/ops/cross_entropy.py)."""
    positions_BS = self._positions(tokens_BS, positions_BS)
    h_BSD, stats = self._trunk(tokens_BS, positions_BS, segment_ids_BS, rng, micro_batches)
    return self.final_norm(h_BSD), stats

  def with_mtp(self, tokens_BS: jax.Array, next_tokens_BLS: jax.Array,
               positions_BS: jax.Array | None = None, segment_ids_BS: jax.Array | None = None,
               *, rng: jax.Array | None = None, micro_batches: int = 1):
    """Training forward with multi-token prediction: `next_tokens_BLS[:, k]` are the tokens k + 1
    places ahead of `tokens_BS`. Returns (the normed hidden states, each MTP module's [B, depth,
    S, D], the stats of the layers and then the MTP blocks): `head_weights` makes their
    logits."""
    positions_BS = self._positions(tokens_BS, positions_BS)
    trunk_BSD, stats = self._trunk(tokens_BS, positions_BS, segment_ids_BS, rng, micro_batches)
    mtp_BLSD, mtp_stats = self.mtp_outputs(trunk_BSD, next_tokens_BLS, positions_BS,
                                           segment_ids_BS, rng=rng)
    stats = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stats, mtp_stats)
    return self.final_norm(trunk_BSD), mtp_BLSD, stats

  def mtp_outputs(self, trunk_BSD: jax.Array, next_tokens_BLS: jax.Array,
                  positions_BS: jax.Array, segment_ids_BS: jax.Array | None, *,
                  rng: jax.Array | None = None) -> tuple[jax.Array, RouterStats]:
    """The MTP modules on the trunk's output (before the final norm): each one's [B, depth, S,
    D] and their router stats (leading axis: the modules)."""
    h_BSD, mtp_out, mtp_stats = trunk_BSD, [], []
    for k, module in enumerate(self.mtp):
      key = None if rng is None else jax.random.fold_in(rng, 1000 + k)
      h_BSD, out_BSD, block_stats = module(h_BSD, self.embed(next_tokens_BLS[:, k]), positions_BS,
                                           segment_ids_BS, key, self.cfg.num_layers + k)
      mtp_out.append(out_BSD)
      mtp_stats.append(block_stats)
    return jnp.stack(mtp_out, axis=1), jax.tree.map(lambda *b: jnp.stack(b), *mtp_stats)

  def init_cache(self, batch: int, length: int) -> dict:
    """An empty decoding cache for `batch` rows of up to `length` tokens: per layer stack, each
    attention layer's keys and values (or MLA's latents) stacked over its layers, in the
    compute dtype (jmoe/model/kv_cache.py)."""
    cache = {}
    for name in ("dense_blocks", "moe_blocks"):
      stack = getattr(self, name)
      if stack is not None:
        cache[name] = {k: jnp.zeros((depth(stack), *shape), self.embed.dtype)
                       for k, shape in stack.attn.cache_shapes(batch, length).items()}
    return cache

  def decode(self, tokens_BS: jax.Array, positions_BS: jax.Array, cache: dict
             ) -> tuple[jax.Array, dict]:
    """Float32 logits of the tokens at `positions_BS` (consecutive in each row, after the ones
    the cache holds), and the cache with them written. The MTP modules take no part."""
    x_BSD = constrain(self.embed(tokens_BS), RESIDUAL_AXES)
    cache = dict(cache)
    for name, first in (("dense_blocks", 0), ("moe_blocks", self.first_moe_layer)):
      if getattr(self, name) is not None:
        x_BSD, cache[name] = decode_stack(getattr(self, name), x_BSD, positions_BS, cache[name],
                                          first)
    return self._logits(self.final_norm(x_BSD)), cache

  def head_weights(self, dtype) -> jax.Array:
    """The LM head as [D, V] in `dtype` (the embedding table, transposed, when tied)."""
    if self.head_DV is None:
      return gathered(self.embed.table, dtype).T
    return gathered(self.head_DV, dtype)

  def update_expert_bias(self, load_LE: jax.Array, rate: float) -> None:
    """Aux-loss-free balancing after a step: moves each MoE layer's selection bias by its load
    (rows of `load_LE` in the order of the router stats: MoE layers, then MTP blocks)."""
    num_moe = self.cfg.num_layers - self.first_moe_layer
    if self.moe_blocks is not None:
      bias = self.moe_blocks.mlp.expert_bias_E
      bias[...] = bias_step(bias[...], load_LE[:num_moe], rate)
    for k, module in enumerate(self.mtp):
      bias = module.block.mlp.expert_bias_E
      bias[...] = bias_step(bias[...], load_LE[num_moe + k], rate)

  def clip_attention_logits(self, eta_LH: jax.Array, alpha: float) -> None:
    """QK-clip after a step (jmoe/model/qk_clip.py): each attention layer's query and key
    projections scaled so that head h's logits scale by eta_LH[layer, h] (rows: the layers in
    order, then the MTP blocks), the queries taking eta^alpha."""
    k, num_layers = self.first_moe_layer, self.cfg.num_layers
    if self.dense_blocks is not None:
      self.dense_blocks.attn.clip_logits(eta_LH[:k], alpha)
    if self.moe_blocks is not None:
      self.moe_blocks.attn.clip_logits(eta_LH[k:num_layers], alpha)
    for i, module in enumerate(self.mtp):
      module.block.attn.clip_logits(eta_LH[num_layers + i], alpha)

  def _positions(self, tokens_BS, positions_BS):
    if positions_BS is None:
      positions_BS = jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]), tokens_BS.shape)
    return positions_BS

  def _trunk(self, tokens_BS, positions_BS, segment_ids_BS, rng, micro_batches=1):
    """The hidden state after the last block (before the final norm) and the layers' stats (the
    MoE layers' router stats, every layer's largest logits if asked); the MoE blocks in the
    active layout's pipeline stages if it has them."""
    x_BSD, dense_top = self._front(tokens_BS, positions_BS, segment_ids_BS)
    tops = [dense_top]
    if self.moe_blocks is None:
      no_layers = jnp.zeros((0,), jnp.float32)
      stats = LayerStats(router=RouterStats(
          aux_loss=no_layers, z_loss=no_layers, dropped_fraction=no_layers,
          overflow_rounds=no_layers, load_E=jnp.zeros((0, self.num_experts), jnp.float32)),
          max_logit_H=None)
    elif (layout := active_layout()) is not None and layout.stages > 1:
      x_BSD, stats = run_pipeline(self.moe_blocks, layout, x_BSD, positions_BS, segment_ids_BS,
                                  micro_batches=micro_batches, remat=self.remat, rng=rng,
                                  first_layer=self.first_moe_layer, unroll=self.cfg.scan_unroll,
                                  axes=RESIDUAL_AXES)
    else:
      x_BSD, stats = run_stack(self.moe_blocks, x_BSD, positions_BS, segment_ids_BS,
                               remat=self.remat, rng=rng, first_layer=self.first_moe_layer,
                               unroll=self.cfg.scan_unroll, straight=self.cfg.layers_differ())
    tops.append(stats.max_logit_H)
    top_LH = jnp.concatenate([t for t in tops if t is not None]) if self.max_logit else None
    return x_BSD, stats.replace(max_logit_H=top_LH)

  def front(self, tokens_BS: jax.Array, positions_BS: jax.Array,
            segment_ids_BS: jax.Array | None) -> jax.Array:
    """The MoE blocks' input: the embedding, then the dense blocks first."""
    return self._front(tokens_BS, positions_BS, segment_ids_BS)[0]

  def _front(self, tokens_BS, positions_BS, segment_ids_BS):
    """`front`, and the dense blocks' largest logits per head (None without them, or unasked)."""
    x_BSD = constrain(self.embed(tokens_BS), RESIDUAL_AXES)
    if self.dense_blocks is None:
      return x_BSD, None
    x_BSD, dense = run_stack(self.dense_blocks, x_BSD, positions_BS, segment_ids_BS,
                             remat=self.remat, unroll=self.cfg.scan_unroll,
                             straight=self.cfg.layers_differ())
    return x_BSD, dense.max_logit_H

  def _logits(self, x_BSD):
    logits_BSV = jnp.einsum("bsd,dv->bsv", x_BSD, self.head_weights(x_BSD.dtype))
    return constrain(logits_BSV, LOGITS_AXES).astype(jnp.float32)
