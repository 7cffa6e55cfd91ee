"""Layers stacked along a leading `layers` axis and run with `lax.scan`, so compile time does not
grow with depth; each layer rematerialised as `train.remat` says (jmoe/ops/remat.py)."""

from __future__ import annotations

import dataclasses
import functools
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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["index"],
                   meta_fields=["phase", "period"])
@dataclasses.dataclass(frozen=True)
class PeriodicIndex:
  """A layer's index in the model, traced, whose place within a period of layers is known when
  the loop is traced: `index % m` is a Python int where m divides the period (the layer's kind,
  windowed or full attention, is then fixed in the program rather than branched on)."""
  index: jax.Array
  phase: int
  period: int

  def __mod__(self, m):
    return self.phase % m if isinstance(m, int) and self.period % m == 0 else self.index % m


def scan_layers(step: Callable, x, xs, *, first_layer: int | jax.Array = 0, period: int = 1,
                unroll: int = 1):
  """`lax.scan` of `x, y = step(x, xs_l, index_l)` over the layers (xs: leading axis of layers;
  index_l: the layer's index in the whole model, the stack starting at `first_layer`); the last
  x and the stacked ys. With `period` > 1, where the stack holds whole periods and `first_layer`
  is known when tracing, each iteration runs `period` layers, each given a `PeriodicIndex`, so
  that a layer's kind is fixed when traced (XLA's GPU runtime waits for the device at each
  branch on it); `unroll` layers per iteration, at least `period`."""
  num_layers = jax.tree.leaves(xs)[0].shape[0]
  indices = first_layer + jnp.arange(num_layers)
  unroll = min(unroll, num_layers)
  if period <= 1 or num_layers % period or not isinstance(first_layer, int):
    return jax.lax.scan(lambda x, layer: step(x, layer[0], layer[1]), x, (xs, indices),
                        unroll=unroll)
  groups = jax.tree.map(lambda a: a.reshape(num_layers // period, period, *a.shape[1:]),
                        (xs, indices))

  def body(x, group):
    ys = []
    for j in range(period):
      layer, index = jax.tree.map(lambda a: a[j], group)
      x, y = step(x, layer, PeriodicIndex(index, first_layer + j, period))
      ys.append(y)
    return x, jax.tree.map(lambda *y: jnp.stack(y), *ys)

  x, ys = jax.lax.scan(body, x, groups, unroll=max(1, unroll // period))
  return x, jax.tree.map(lambda a: a.reshape(num_layers, *a.shape[2:]), ys)


def run_stack(stack: nnx.Module, x, *args, remat: str = "none", rng: jax.Array | None = None,
              first_layer: int | jax.Array = 0, unroll: int = 1, keys: jax.Array | None = None,
              active: jax.Array | None = None, period: int = 1):
  """Runs x through every layer: `x, y = layer(x, *args, rng=key, layer=index)`, each layer with
  its own key (from `keys`, one per layer, or split from `rng`; or None) and its index in the
  whole model (the stack starting at `first_layer`); returns the last x and the stacked ys.
  `unroll` layers run per iteration of the loop (as many as the stack has: straight-line code,
  no loop buffers to fill). `active`: a bool per layer; one that is False is skipped (x passes
  unchanged, its y is zeros), as pipeline stages mask the slots their group lacks. `period`:
  the layers' kinds repeat every this many (`scan_layers`)."""
  graphdef, state = nnx.split(stack)
  num_layers = depth(stack)
  if keys is None and rng is not None:
    keys = jax.random.split(rng, num_layers)

  def run_layer(carry, layer, index):
    layer_state, key, on = layer
    x, y = nnx.merge(graphdef, layer_state)(carry, *args, rng=key, layer=index)
    if on is None:
      return x, y
    return jnp.where(on, x, carry), jax.tree.map(lambda a: jnp.where(on, a, 0), y)

  policy = REMAT_POLICIES[remat]
  if policy is not None:
    # Inside a loop iteration XLA cannot merge the recomputation with the forward pass; across
    # layers in one iteration (unrolled, or a period's) it could, undoing the remat, unless told
    # not to.
    several = min(unroll, num_layers) > 1 or period > 1
    run_layer = jax.checkpoint(run_layer, policy=policy, prevent_cse=several)
  return scan_layers(run_layer, x, (state, keys, active), first_layer=first_layer,
                     period=period, unroll=unroll)


def decode_stack(stack: nnx.Module, x, positions_BS, cache: dict, first_layer: int = 0,
                 period: int = 1):
  """Runs new tokens through every layer with each layer's cache (stacked [L, ...]): the last x
  and the stacked caches with the tokens written (Block.decode); `period` as in run_stack."""
  graphdef, state = nnx.split(stack)

  def step(x, layer, index):
    layer_state, layer_cache = layer
    return nnx.merge(graphdef, layer_state).decode(x, positions_BS, index, layer_cache)

  return scan_layers(step, x, (state, cache), first_layer=first_layer, period=period)
