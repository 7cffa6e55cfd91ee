"""Combine: undo the sort by expert and sum each token's k expert outputs with their weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmoe.ops.rows import move_rows


def unsort(y_XD: jax.Array, order_X: jax.Array, inverse_X: jax.Array) -> jax.Array:
  """Rows sorted as `order_X` says (row r is copy order_X[r]) back in copy order, by a gather
  whose gradient is a gather (`inverse_X`: where each copy was sorted to)."""
  return move_rows(y_XD, inverse_X, order_X)


def combine(y_XD: jax.Array, order_X: jax.Array, inverse_X: jax.Array,
            weights_TK: jax.Array) -> jax.Array:
  """y_TD from outputs sorted as `order_X` says (copy = token * K + choice)."""
  num_tokens, top_k = weights_TK.shape
  y_TKD = unsort(y_XD, order_X, inverse_X).reshape(num_tokens, top_k, -1)
  return weighted_sum(y_TKD, weights_TK)


def weighted_sum(y_TKD: jax.Array, weights_TK: jax.Array) -> jax.Array:
  """Each token's k expert outputs summed with their routing weights, accumulated in float32."""
  y_TD = jnp.einsum("tkd,tk->td", y_TKD, weights_TK.astype(y_TKD.dtype),
                    preferred_element_type=jnp.float32)
  return y_TD.astype(y_TKD.dtype)
