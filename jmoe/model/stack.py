"""Layers stacked along a leading `layers` axis and run with `lax.scan`, so compile time does not
grow with depth."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

# What the backward pass keeps from each layer's forward; the rest it recomputes. The names are
# `jax.ad_checkpoint.checkpoint_name` points in the model: "attention_out" (the attention kernel's
# output, so the kernel never reruns), "moe_input" (the normed input of the MoE layer, before
# routing and dispatch) and "expert_hidden" (the experts' gated activations).
_names = jax.checkpoint_policies.save_only_these_names
REMAT_POLICIES = {
    "none": None,  # keep everything
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only each layer's input
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep GEMM outputs
    "attention": _names("attention_out"),
    "attention_moe": _names("attention_out", "moe_input"),
    "attention_moe_experts": _names("attention_out", "moe_input", "expert_hidden"),
    # as attention_moe, but the saved tensors wait in host memory until the backward pass
    "offload_attention_moe": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["attention_out", "moe_input"],
        offload_src="device", offload_dst="pinned_host"),
}


def make_stack(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int,
               rngs: nnx.Rngs) -> nnx.Module:
  """Builds `num_layers` independent layers as one module whose parameters have a leading axis."""

  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=0, out_axes=0,
            transform_metadata={nnx.PARTITION_NAME: "layers", "axes": "layers"})
  def create(rngs: nnx.Rngs) -> nnx.Module:
    return make_layer(rngs)

  return create(rngs)


def run_stack(stack: nnx.Module, x, *args, remat: str = "none", rng: jax.Array | None = None,
              first_layer: int = 0):
  """Runs x through every layer: `x, y = layer(x, *args, rng=key, layer=index)`, each layer with
  its own key from `rng` (or None) and its index in the whole model (the stack starting at
  `first_layer`); returns the last x and the stacked ys."""
  graphdef, state = nnx.split(stack)
  num_layers = jax.tree.leaves(state)[0].shape[0]
  keys = None if rng is None else jax.random.split(rng, num_layers)
  indices = first_layer + jnp.arange(num_layers)

  def body(carry, layer):
    layer_state, key, index = layer
    return nnx.merge(graphdef, layer_state)(carry, *args, rng=key, layer=index)

  policy = REMAT_POLICIES[remat]
  if policy is not None:
    body = jax.checkpoint(body, policy=policy, prevent_cse=False)
  return jax.lax.scan(body, x, (state, keys, indices))
