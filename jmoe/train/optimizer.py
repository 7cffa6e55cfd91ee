"""AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import optax
from flax import nnx

from jmoe.config import TrainConfig
from jmoe.ops.params import DECAYED_KINDS, kind_of


def learning_rate(cfg: TrainConfig) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps, decay_steps=cfg.steps,
      end_value=cfg.lr * cfg.min_lr_ratio)


def _decay_mask(params):
  """Weight decay applies to GEMM weights and embeddings, not to norm scales or biases: each
  parameter's kind says which it is."""
  return jax.tree.map(lambda v: v.replace(kind_of(v) in DECAYED_KINDS), params,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  adamw = optax.adamw(learning_rate(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=_decay_mask)
  if cfg.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
  return adamw
