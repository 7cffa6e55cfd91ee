"""Decoding with a cache: what each attention layer keeps of the tokens it has seen, and which of
them a new token may see.

A cache is a dict of arrays [B, T, ...] per layer (keys and values; for multi-head latent
attention its normalised latent and the shared rotary key), stacked [L, B, T, ...] for a stack of
layers. Row b's tokens sit at their positions: new tokens are written where they stand, and a
query at position p sees the cached positions j <= p (within the window on windowed layers).
Positions past a row's last written token hold what an earlier, padded call left there; no query
sees them before they are written again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write(cache_BT: jax.Array, new_BS: jax.Array, start_B: jax.Array) -> jax.Array:
  """The cache with each row's new entries written from its position `start_B[b]` on."""

  def one(cache_T, new_S, start):
    return jax.lax.dynamic_update_slice_in_dim(cache_T, new_S.astype(cache_T.dtype), start, 0)

  return jax.vmap(one)(cache_BT, new_BS, start_B)


def visible(positions_BS: jax.Array, length: int, window: int, windowed) -> jax.Array:
  """[B, 1, S, T]: whether the query at positions_BS[b, s] sees cached position t: t <= p, and
  p - t < window where the layer is windowed (`windowed` may be traced)."""
  p_BS1 = positions_BS[:, :, None]
  t_11T = jnp.arange(length)[None, None, :]
  allowed_BST = t_11T <= p_BS1
  if window:
    allowed_BST &= jnp.logical_not(windowed) | (p_BS1 - t_11T < window)
  return allowed_BST[:, None]
