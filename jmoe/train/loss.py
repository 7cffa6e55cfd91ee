"""Losses: next-token cross-entropy, and the router balancing terms summed over MoE layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmoe.config import BalanceConfig
from jmoe.moe.route import RouterStats


def cross_entropy_sum(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
  """Sum over tokens of -log p(target), in float32."""
  logits_BSV = logits_BSV.astype(jnp.float32)
  logz_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
  target_logits_BS = jnp.take_along_axis(logits_BSV, targets_BS[..., None], axis=-1)[..., 0]
  return jnp.sum(logz_BS - target_logits_BS)


def balance_losses(stats: RouterStats, cfg: BalanceConfig) -> tuple[jax.Array, jax.Array]:
  """(aux_loss, z_loss) as added to the loss: coefficient times the sum over MoE layers."""
  return cfg.aux_loss_coef * jnp.sum(stats.aux_loss), cfg.z_loss_coef * jnp.sum(stats.z_loss)
