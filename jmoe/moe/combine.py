"""Combine: undo the sort by expert and sum each token's k expert outputs with their weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def combine(y_XD: jax.Array, order_X: jax.Array, weights_TK: jax.Array) -> jax.Array:
  """y_TD from outputs sorted as `order_X` says (row r is copy order_X[r] = token * K + choice)."""
  num_tokens, top_k = weights_TK.shape
  y_unsorted_XD = jnp.zeros_like(y_XD).at[order_X].set(y_XD, unique_indices=True)
  return weighted_sum(y_unsorted_XD.reshape(num_tokens, top_k, -1), weights_TK)


def weighted_sum(y_TKD: jax.Array, weights_TK: jax.Array) -> jax.Array:
  """Each token's k expert outputs summed with their routing weights, accumulated in float32."""
  y_TD = jnp.einsum("tkd,tk->td", y_TKD, weights_TK.astype(y_TKD.dtype),
                    preferred_element_type=jnp.float32)
  return y_TD.astype(y_TKD.dtype)
