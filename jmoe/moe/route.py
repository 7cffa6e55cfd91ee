"""Route: from router logits to each token's k experts, their weights, and the balancing terms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jmoe.config import RouterConfig


@struct.dataclass
class RouterStats:
  """What a layer's router reports, returned explicitly (one per MoE layer after the layer scan)."""
  aux_loss: jax.Array  # Switch balance loss E * sum_e f_e * p_e; 1.0 when perfectly balanced
  z_loss: jax.Array  # mean over tokens of logsumexp(logits)^2
  load_E: jax.Array  # fraction of the T*K routed token copies that went to each expert


@struct.dataclass
class Routing:
  expert_ids_TK: jax.Array  # int32
  weights_TK: jax.Array  # float32
  stats: RouterStats


def route(logits_TE: jax.Array, cfg: RouterConfig, top_k: int) -> Routing:
  """Softmax scores over all experts, top-k selection, optional renormalisation.

  Logits and scores are float32 whatever the compute dtype. Ties go to the lower expert index.
  """
  logits_TE = logits_TE.astype(jnp.float32)
  num_tokens, num_experts = logits_TE.shape
  probs_TE = jax.nn.softmax(logits_TE, axis=-1)
  weights_TK, expert_ids_TK = jax.lax.top_k(probs_TE, top_k)
  if cfg.norm_topk_prob:
    weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)

  counts_E = jnp.zeros((num_experts,), jnp.float32).at[expert_ids_TK.reshape(-1)].add(1.0)
  load_E = counts_E / (num_tokens * top_k)
  # Selection is not differentiable; the gradient reaches the router through the mean scores.
  aux_loss = num_experts * jnp.sum(jax.lax.stop_gradient(load_E) * jnp.mean(probs_TE, axis=0))
  z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1)))
  return Routing(expert_ids_TK=expert_ids_TK.astype(jnp.int32), weights_TK=weights_TK,
                 stats=RouterStats(aux_loss=aux_loss, z_loss=z_loss, load_E=load_E))
