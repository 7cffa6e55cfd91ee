"""Rotary position embeddings, in the half-split layout (the first half of each head's dims pairs
with the second half), which is the layout Hugging Face checkpoints use."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x_BSHA: jax.Array, positions_BS: jax.Array, theta: float) -> jax.Array:
  half = x_BSHA.shape[-1] // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles_BSA = positions_BS[..., None].astype(jnp.float32) * inv_freq  # A here is half
  cos = jnp.cos(angles_BSA)[:, :, None, :]
  sin = jnp.sin(angles_BSA)[:, :, None, :]
  x1, x2 = jnp.split(x_BSHA.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BSHA.dtype)
