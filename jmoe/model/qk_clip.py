"""QK-clip (MuonClip, train.qk_clip): after an update, the query and key projections of every
attention head whose largest scaled logit S_h in the step exceeded tau are scaled so that S_h
would be tau. With eta_h = min(1, tau / S_h), a logit q.k scales by eta_h when the head's query
projection scales by eta_h^alpha and its key projection by eta_h^(1 - alpha).

Where a key belongs to one head only (multi-head attention, MLA's no-rope part) that is all. The
parts attention shares between heads take one factor for all of them, and the parts of each head
the rest, so that every head's logits still scale by its own eta_h:
- grouped-query attention: key head g serves query heads h of its group, and takes
  eta_g^(1 - alpha) from the group's largest logit (eta_g = min over its heads of eta_h: the head
  that needs most); each query head takes eta_h / eta_g^(1 - alpha). The group's largest head
  gets eta_g^alpha, as without groups; a head of a clipped group that is itself below tau has its
  query scaled up by exactly what the shared key lost, its logits unchanged. A group none of
  whose heads exceeded tau is untouched, bit for bit.
- MLA: q's no-rope part scales by eta_h^alpha and k's (each head's, from the key/value
  up-projection) by eta_h^(1 - alpha); the rotary key is one for all heads and is left as it is,
  so q's rotary part takes all of eta_h.
Factors are applied to the stored parameters in float32 (a factor of 1 leaves a value as it was).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def clip_factors(max_logit_H: jax.Array, tau: float) -> jax.Array:
  """eta_h = tau / S_h where S_h > tau, else 1 (also where S_h is not a number)."""
  top = max_logit_H.astype(jnp.float32)
  return jnp.where(top > tau, tau / jnp.where(top > tau, top, 1.0), 1.0)


def grouped_factors(eta_H: jax.Array, alpha: float, kv_heads: int
                    ) -> tuple[jax.Array, jax.Array]:
  """(query factors [..., H], key factors [..., G]) for heads in groups of H / G per key head."""
  h = eta_H.shape[-1]
  eta_GR = eta_H.reshape(*eta_H.shape[:-1], kv_heads, h // kv_heads)
  k_G = jnp.min(eta_GR, axis=-1) ** (1 - alpha)
  return (eta_GR / k_G[..., None]).reshape(eta_H.shape), k_G


def scale_weights(variable: nnx.Variable, factor: jax.Array) -> None:
  """variable *= factor (broadcast), computed in float32 and stored in the variable's dtype."""
  x = variable[...]
  variable[...] = (x.astype(jnp.float32) * factor).astype(x.dtype)
