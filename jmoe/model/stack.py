"""Layers stacked along a leading `layers` axis and run with `lax.scan`, so compile time does not
grow with depth; each layer rematerialised as `train.remat` says (jmoe/ops/remat.py)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.ops.remat import REMAT_POLICIES

def make_stack(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int,
               rngs: nnx.Rngs, axis: str = "layers") -> nnx.Module:
  """Builds `num_layers` independent layers as one module whose parameters have a leading axis
  (logical name `axis`: `stage_layers` for the stack that pipeline stages split)."""

  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=0, out_axes=0,
            transform_metadata={nnx.PARTITION_NAME: axis, "axes": axis})
  def create(rngs: nnx.Rngs) -> nnx.Module:
    return make_layer(rngs)

  return create(rngs)


def depth(stack: nnx.Module) -> int:
  """How many layers a stack made by `make_stack` holds (its parameters' leading axis)."""
  return jax.tree.leaves(nnx.state(stack))[0].shape[0]


def run_stack(stack: nnx.Module, x, *args, remat: str = "none", rng: jax.Array | None = None,
              first_layer: int | jax.Array = 0, unroll: int = 1, keys: jax.Array | None = None,
              active: jax.Array | None = None):
  """Runs x through every layer: `x, y = layer(x, *args, rng=key, layer=index)`, each layer with
  its own key (from `keys`, one per layer, or split from `rng`; or None) and its index in the
  whole model (the stack starting at `first_layer`); returns the last x and the stacked ys.
  `unroll` layers run per iteration of the loop (as many as the stack has: straight-line code,
  no loop buffers to fill). `active`: a bool per layer; one that is False is skipped (x passes
  unchanged, its y is zeros), as pipeline stages mask the slots their group lacks."""
  graphdef, state = nnx.split(stack)
  num_layers = depth(stack)
  if keys is None and rng is not None:
    keys = jax.random.split(rng, num_layers)
  indices = first_layer + jnp.arange(num_layers)

  def body(carry, layer):
    layer_state, key, index, on = layer
    x, y = nnx.merge(graphdef, layer_state)(carry, *args, rng=key, layer=index)
    if on is None:
      return x, y
    return jnp.where(on, x, carry), jax.tree.map(lambda a: jnp.where(on, a, 0), y)

  policy = REMAT_POLICIES[remat]
  unroll = min(unroll, num_layers)
  if policy is not None:
    # Inside a loop iteration XLA cannot merge the recomputation with the forward pass; across
    # unrolled layers it could, undoing the remat, unless told not to.
    body = jax.checkpoint(body, policy=policy, prevent_cse=unroll > 1)
  return jax.lax.scan(body, x, (state, keys, indices, active), unroll=unroll)


def decode_stack(stack: nnx.Module, x, positions_BS, cache: dict, first_layer: int = 0):
  """Runs new tokens through every layer with each layer's cache (stacked [L, ...]): the last x
  and the stacked caches with the tokens written (Block.decode)."""
  graphdef, state = nnx.split(stack)

  def body(x, layer):
    layer_state, layer_cache, index = layer
    return nnx.merge(graphdef, layer_state).decode(x, positions_BS, index, layer_cache)

  return jax.lax.scan(body, x, (state, cache, first_layer + jnp.arange(depth(stack))))
