"""Dispatch: sort each token's k copies by expert, so each expert's rows are contiguous."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Dispatched:
  x_XD: jax.Array  # token copies, grouped by expert in expert order
  group_sizes_E: jax.Array  # int32 rows per expert; sums to X
  order_X: jax.Array  # sorted row r holds the flat copy order_X[r] (= token * K + choice)


def dispatch(x_TD: jax.Array, expert_ids_TK: jax.Array, num_experts: int) -> Dispatched:
  top_k = expert_ids_TK.shape[1]
  flat_ids_X = expert_ids_TK.reshape(-1)
  order_X = jnp.argsort(flat_ids_X, stable=True).astype(jnp.int32)
  x_XD = jnp.take(x_TD, order_X // top_k, axis=0)
  group_sizes_E = jnp.zeros((num_experts,), jnp.int32).at[flat_ids_X].add(1)
  return Dispatched(x_XD=x_XD, group_sizes_E=group_sizes_E, order_X=order_X)
