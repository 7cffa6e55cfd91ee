"""Losses: next-token cross-entropy, and the router balancing terms summed over MoE layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmoe.config import BalanceConfig
from jmoe.moe.route import RouterStats


def cross_entropy_sum(logits_BSV: jax.Array, targets_BS: jax.Array,
                      mask_BS: jax.Array | None = None) -> jax.Array:
  """Sum over tokens (those where `mask_BS` is true) of -log p(target), in float32."""
  logits_BSV = logits_BSV.astype(jnp.float32)
  logz_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
  target_logits_BS = jnp.take_along_axis(logits_BSV, targets_BS[..., None], axis=-1)[..., 0]
  nll_BS = logz_BS - target_logits_BS
  return jnp.sum(nll_BS if mask_BS is None else jnp.where(mask_BS, nll_BS, 0.0))


def mtp_loss(mtp_logits_BKSV: jax.Array, tokens_BS1: jax.Array, num_sequences: int,
             weight: float) -> jax.Array:
  """Multi-token prediction: module k (0-based) at position i predicts token i + k + 2 of the
  window; each module's loss is its mean over the `num_sequences` of the global batch, and the
  result is `weight` times their mean."""
  depth, seq = mtp_logits_BKSV.shape[1], mtp_logits_BKSV.shape[2]
  total = 0.0
  for k in range(depth):
    valid = seq - k - 1  # positions whose target lies inside the window
    targets_BS = jnp.pad(tokens_BS1[:, k + 2:], ((0, 0), (0, seq - valid)))
    mask_BS = jnp.broadcast_to(jnp.arange(seq) < valid, targets_BS.shape)
    total += cross_entropy_sum(mtp_logits_BKSV[:, k], targets_BS, mask_BS) / (num_sequences * valid)
  return weight * total / depth


def mtp_inputs(tokens_BS1: jax.Array, depth: int) -> jax.Array:
  """[B, depth, S]: for module k, the tokens k + 1 places ahead of the inputs (zero past the end)."""
  seq = tokens_BS1.shape[1] - 1
  return jnp.stack([jnp.pad(tokens_BS1[:, k + 1:], ((0, 0), (0, k)))[:, :seq]
                    for k in range(depth)], axis=1)


def balance_losses(stats: RouterStats, cfg: BalanceConfig) -> tuple[jax.Array, jax.Array]:
  """(aux_loss, z_loss) as added to the loss: coefficient times the sum over MoE layers."""
  return cfg.aux_loss_coef * jnp.sum(stats.aux_loss), cfg.z_loss_coef * jnp.sum(stats.z_loss)
