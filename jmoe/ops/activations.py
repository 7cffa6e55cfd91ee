"""Gated activations of expert FFNs: hidden = act(gate, up). `GATED_ACTIVATIONS` is the list of
names `moe.activation` may take; each entry makes the function from the config's
`swiglu_limit` and `swiglu_alpha` (which plain SwiGLU ignores)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

GatedActivation = Callable[[jax.Array, jax.Array], jax.Array]  # (gate, up) -> hidden


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  return jax.nn.silu(gate) * up


def clamped_swiglu(limit: float, alpha: float) -> GatedActivation:
  """GPT-OSS's gate: gate <= limit, |up| <= limit, gate * sigmoid(alpha * gate) * (up + 1).

  Its backward pass computes the function again from gate and up, which are all it keeps
  (`jax.checkpoint`): differentiated as written, each of its steps' values and the clamps' masks
  were kept from the forward pass, seven more arrays of the hidden's size per layer (37 GiB a
  GPU of the GPT-OSS-20B 8-GPU plan's step, compiled for H200s: scripts/compile_for_gpu.py)."""

  def clamped(gate, up):
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(alpha * gate) * (up + 1)

  return jax.checkpoint(clamped)


GATED_ACTIVATIONS: dict[str, Callable[[float, float], GatedActivation]] = {
    "swiglu": lambda limit, alpha: swiglu,
    "clamped_swiglu": clamped_swiglu,
}
