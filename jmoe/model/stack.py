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


def scan_layers(step: Callable, x, xs, *, first_layer: int | jax.Array = 0,
                straight: bool = False, unroll: int = 1):
  """`x, y = step(x, xs_l, index_l)` over the layers (xs: leading axis of layers; index_l: the
  layer's index in the whole model, the stack starting at `first_layer`); the last x and the
  stacked ys. A `lax.scan`, `unroll` layers per iteration; or, with `straight` where every layer
  is unrolled and `first_layer` is known when tracing, straight-line code in which each layer's
  index is a Python int, so that what it decides (a window on alternating layers) is fixed in
  the program rather than branched on at run time (XLA's GPU runtime waits for the device at
  each branch). The layers are taken apart by `jnp.split`, whose gradient is one concatenation
  per array, as the unrolled scan's is (slicing each layer instead gave the optimizer's update
  other fusions: 17% slower steps on GPT-OSS's bench, H100, 2026-12-06)."""
  num_layers = jax.tree.leaves(xs)[0].shape[0]
  unroll = min(unroll, num_layers)
  if not (straight and unroll == num_layers and isinstance(first_layer, int)):
    indices = first_layer + jnp.arange(num_layers)
    return jax.lax.scan(lambda x, layer: step(x, *layer), x, (xs, indices), unroll=unroll)
  leaves, tree = jax.tree.flatten(xs)
  parts = [jnp.split(a, num_layers) for a in leaves]
  ys = []
  for i in range(num_layers):
    x, y = step(x, tree.unflatten([p[i][0] for p in parts]), first_layer + i)
    ys.append(y)
  return x, jax.tree.map(lambda *y: jnp.stack(y), *ys)


def run_stack(stack: nnx.Module, x, *args, remat: str = "none", rng: jax.Array | None = None,
              first_layer: int | jax.Array = 0, unroll: int = 1, keys: jax.Array | None = None,
              active: jax.Array | None = None, straight: bool = False):
  """Runs x through every layer: `x, y = layer(x, *args, rng=key, layer=index)`, each layer with
  its own key (from `keys`, one per layer, or split from `rng`; or None) and its index in the
  whole model (the stack starting at `first_layer`); returns the last x and the stacked ys.
  `unroll` layers run per iteration of the loop (as many as the stack has: straight-line code,
  no loop buffers to fill). `active`: a bool per layer; one that is False is skipped (x passes
  unchanged, its y is zeros), as pipeline stages mask the slots their group lacks. `straight`:
  unrolled layers are told their index as a Python int (`scan_layers`)."""
  graphdef, state = nnx.split(stack)
  num_layers = depth(stack)
  if keys is None and rng is not None:
    keys = jax.random.split(rng, num_layers)
  policy = REMAT_POLICIES[remat]
  # Inside a loop iteration XLA cannot merge the recomputation with the forward pass; across
  # unrolled layers it could, undoing the remat, unless told not to.
  prevent_cse = min(unroll, num_layers) > 1

  def run_layer(carry, layer, index):
    layer_state, key, on = layer
    x, y = nnx.merge(graphdef, layer_state)(carry, *args, rng=key, layer=index)
    if on is None:
      return x, y
    return jnp.where(on, x, carry), jax.tree.map(lambda a: jnp.where(on, a, 0), y)

  def rematerialised(carry, layer, index):  # (the index closed over: a Python int stays one)
    return jax.checkpoint(lambda c, l: run_layer(c, l, index), policy=policy,
                          prevent_cse=prevent_cse)(carry, layer)

  return scan_layers(run_layer if policy is None else rematerialised, x, (state, keys, active),
                     first_layer=first_layer, straight=straight, unroll=unroll)


def decode_stack(stack: nnx.Module, x, positions_BS, cache: dict, first_layer: int = 0):
  """Runs new tokens through every layer with each layer's cache (stacked [L, ...]): the last x
  and the stacked caches with the tokens written (Block.decode)."""
  graphdef, state = nnx.split(stack)

  def step(x, layer, index):
    layer_state, layer_cache = layer
    return nnx.merge(graphdef, layer_state).decode(x, positions_BS, index, layer_cache)

  return scan_layers(step, x, (state, cache), first_layer=first_layer)
