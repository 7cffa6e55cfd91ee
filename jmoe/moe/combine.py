"""Combine: undo the dispatch sort and sum each token's k expert outputs with their weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmoe.moe.dispatch import Dispatched


def combine(y_XD: jax.Array, dispatched: Dispatched, weights_TK: jax.Array) -> jax.Array:
  num_tokens, top_k = weights_TK.shape
  y_unsorted_XD = jnp.zeros_like(y_XD).at[dispatched.order_X].set(y_XD, unique_indices=True)
  return weighted_sum(y_unsorted_XD.reshape(num_tokens, top_k, -1), weights_TK)


def weighted_sum(y_TKD: jax.Array, weights_TK: jax.Array) -> jax.Array:
  """Each token's k expert outputs summed with their routing weights, accumulated in float32."""
  y_TD = jnp.einsum("tkd,tk->td", y_TKD, weights_TK.astype(y_TKD.dtype),
                    preferred_element_type=jnp.float32)
  return y_TD.astype(y_TKD.dtype)
