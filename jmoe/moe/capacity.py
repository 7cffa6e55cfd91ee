"""Token dropping for a capacity factor (dropless is the default and needs none of this).

Each expert takes at most C = ceil(capacity_factor * T * K / E) of the T*K routed copies held on one
device. Which copies stay is the drop policy:
  position     the earliest tokens in the batch keep their place
  probability  the copies with the largest routing weights keep their place
A dropped copy gets expert id E (no expert) and weight 0: it contributes nothing and the token keeps
its other choices (and the residual connection).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
  return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def rank_within_expert(ids_X: jax.Array, num_groups: int, priority_X: jax.Array | None = None):
  """Each row's rank among the rows with the same id, in row order or by descending priority."""
  order_X = jnp.arange(ids_X.shape[0]) if priority_X is None else jnp.argsort(-priority_X,
                                                                               stable=True)
  order_X = order_X[jnp.argsort(ids_X[order_X], stable=True)]
  sorted_ids_X = ids_X[order_X]
  counts = jnp.zeros((num_groups,), jnp.int32).at[ids_X].add(1)
  rank_sorted_X = jnp.arange(ids_X.shape[0]) - (jnp.cumsum(counts) - counts)[sorted_ids_X]
  return jnp.zeros_like(ids_X).at[order_X].set(rank_sorted_X)


def apply_capacity(expert_ids_TK: jax.Array, weights_TK: jax.Array, num_experts: int,
                   capacity_factor: float, policy: str):
  """Returns (expert_ids_TK, weights_TK, dropped_fraction) with over-capacity copies dropped."""
  num_tokens, top_k = expert_ids_TK.shape
  capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
  ids_X = expert_ids_TK.reshape(-1)
  priority_X = weights_TK.reshape(-1) if policy == "probability" else None
  keep_X = rank_within_expert(ids_X, num_experts, priority_X) < capacity
  keep_TK = keep_X.reshape(num_tokens, top_k)
  dropped = 1.0 - jnp.mean(keep_X.astype(jnp.float32))
  return (jnp.where(keep_TK, expert_ids_TK, num_experts), jnp.where(keep_TK, weights_TK, 0.0),
          dropped)
