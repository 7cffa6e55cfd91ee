"""Losses: next-token cross-entropy, and the router balancing terms summed over MoE layers."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jmoe.config import BalanceConfig
from jmoe.model.transformer import LOGITS_AXES
from jmoe.moe import RouterStats
from jmoe.ops.cross_entropy import linear_cross_entropy
from jmoe.parallel import active_layout, constrain, split_count


def cross_entropy_sum(logits_BSV: jax.Array, targets_BS: jax.Array,
                      mask_BS: jax.Array | None = None) -> jax.Array:
  """Sum over tokens (those where `mask_BS` is true) of -log p(target), in float32."""
  logits_BSV = logits_BSV.astype(jnp.float32)
  logz_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
  target_logits_BS = jnp.take_along_axis(logits_BSV, targets_BS[..., None], axis=-1)[..., 0]
  nll_BS = logz_BS - target_logits_BS
  return jnp.sum(nll_BS if mask_BS is None else jnp.where(mask_BS, nll_BS, 0.0))


def target_masks(tokens_BN: jax.Array, segment_ids_BN: jax.Array | None, depth: int,
                 loss_mask_BN: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Which predictions count: ([B, S] for the next token, [B, depth, S] for MTP module k's token
  k + 2 ahead). A target counts when it lies in the window, is not padding (segment 0), belongs
  to the same packed document as the input token, and (with `loss_mask_BN`, chat data) is
  marked there (the assistant's tokens)."""
  batch, seq = tokens_BN.shape[0], tokens_BN.shape[1] - 1
  if segment_ids_BN is None:
    segment_ids_BN = jnp.ones_like(tokens_BN)
  inputs_BS = segment_ids_BN[:, :-1]

  def ahead_of(x_BN, ahead):  # x at the target `ahead` places after each input (0 past the end)
    return jnp.pad(x_BN[:, ahead:], ((0, 0), (0, ahead - 1)))[:, :seq]

  def same_document(ahead):
    counts_BS = (inputs_BS > 0) & (ahead_of(segment_ids_BN, ahead) == inputs_BS)
    return counts_BS if loss_mask_BN is None else counts_BS & (ahead_of(loss_mask_BN, ahead) > 0)

  mtp_BLS = (jnp.stack([same_document(k + 2) for k in range(depth)], axis=1) if depth
             else jnp.zeros((batch, 0, seq), bool))
  return same_document(1), mtp_BLS


NllSum = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]  # (out, targets_BS, mask_BS)


def mtp_loss(mtp_out_BL: jax.Array, tokens_BN: jax.Array, mask_BLS: jax.Array,
             count_L: jax.Array, weight: float, nll_sum: NllSum = cross_entropy_sum) -> jax.Array:
  """Multi-token prediction: module k (0-based) at position i predicts token i + k + 2 of the
  window. Each module's summed loss over the positions in `mask_BLS` (`nll_sum` of its outputs
  `mtp_out_BL[:, k]`: logits, or hidden states with a loss that applies the head) is divided by
  `count_L[k]` (its number of targets in the global batch); the result is `weight` times their
  mean."""
  depth, seq = mask_BLS.shape[1], mask_BLS.shape[2]
  total = 0.0
  for k in range(depth):
    targets_BS = jnp.pad(tokens_BN[:, k + 2:], ((0, 0), (0, k + 1)))[:, :seq]
    total += nll_sum(mtp_out_BL[:, k], targets_BS, mask_BLS[:, k]) / count_L[k]
  return weight * total / depth


def mtp_inputs(tokens_BN: jax.Array, depth: int) -> jax.Array:
  """[B, depth, S]: for module k, the tokens k + 1 places ahead of the inputs (zero past the end)."""
  seq = tokens_BN.shape[1] - 1
  return jnp.stack([jnp.pad(tokens_BN[:, k + 1:], ((0, 0), (0, k)))[:, :seq]
                    for k in range(depth)], axis=1)


def balance_losses(stats: RouterStats, cfg: BalanceConfig) -> tuple[jax.Array, jax.Array]:
  """(aux_loss, z_loss) as added to the loss: coefficient times the sum over MoE layers."""
  return cfg.aux_loss_coef * jnp.sum(stats.aux_loss), cfg.z_loss_coef * jnp.sum(stats.z_loss)


def target_counts(batch: dict, depth: int) -> dict[str, jax.Array]:
  """The global batch's number of next-token targets and of each MTP module's targets."""
  lm_BS, mtp_BLS = target_masks(batch["tokens"], batch.get("segment_ids"), depth,
                                batch.get("loss_mask"))
  # At least one, so that an all-padding batch gives a zero loss rather than NaN.
  return {"lm": jnp.maximum(jnp.sum(lm_BS), 1).astype(jnp.float32),
          "mtp": jnp.maximum(jnp.sum(mtp_BLS, axis=(0, 2)), 1).astype(jnp.float32)}


_LOGICAL = dict(zip(("batch", "seq", "vocab"), LOGITS_AXES))


def head_nll(head_DV: jax.Array) -> NllSum:
  """The LM head and the summed loss of hidden states, a chunk at a time, the logits split over
  all the active layout's devices, the head's gradient summed over them once."""
  def place(x, axes):
    return constrain(x, tuple(_LOGICAL.get(a) for a in axes))

  def nll_sum(h_BSD, targets_BS, mask_BS):
    layout = active_layout()
    shape = (*targets_BS.shape, head_DV.shape[1])
    splits = (split_count(LOGITS_AXES, shape, 0), split_count(LOGITS_AXES, shape, 1))
    return linear_cross_entropy(h_BSD, head_DV, targets_BS, mask_BS, place=place,
                                splits=splits, devices=layout.mesh.size if layout else 1)
  return nll_sum


def router_metrics(stats: RouterStats, cfg: BalanceConfig, num_micro: int,
                   rounds_possible: bool) -> tuple[jax.Array, dict]:
  """The balancing terms added to the loss and the router's metrics, from stats per layer
  summed over `num_micro` micro-batches."""
  aux_loss, z_loss = balance_losses(stats, cfg)
  aux_loss, z_loss = aux_loss / num_micro, z_loss / num_micro
  # over the MoE layers; 0 without any (a mean over none would be NaN, which JSON cannot hold)
  per_layer = lambda x_L: jnp.sum(x_L) / max(x_L.size, 1)
  metrics = {"aux_loss": aux_loss, "z_loss": z_loss, "expert_load": stats.load_E / num_micro,
             "dropped_fraction": per_layer(stats.dropped_fraction) / num_micro}
  if rounds_possible:  # elsewhere always 0
    metrics["overflow_rounds"] = per_layer(stats.overflow_rounds) / num_micro
  return aux_loss + z_loss, metrics
