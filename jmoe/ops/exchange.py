"""Collectives over rows, for code inside `jax.shard_map`: gathering rows over mesh axes and
exchanging blocks of rows with peers, optionally as float8.

With `fp8` the rows cross devices as E4M3 with one float32 scale per row (about half the bytes of
bf16); their gradients travel back in full precision, through the collective's transpose.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jmoe.ops.fp8 import E4M3, amax, quantize, scale_for

Collective = Callable[[jax.Array], jax.Array]


def fp8_exchange(send: Collective, back: Collective) -> Collective:
  """`send` (a collective over rows) carrying E4M3 rows and their scales; the gradient goes
  through `back`, the transpose of `send`, in the gradient's own dtype."""

  @jax.custom_vjp
  def exchange(rows):
    scales = scale_for(amax(rows, axis=1, keepdims=True), E4M3)
    moved = send(quantize(rows, scales, E4M3)).astype(jnp.float32) * send(scales)
    return moved.astype(rows.dtype)

  exchange.defvjp(lambda rows: (exchange(rows), None), lambda _, d_rows: (back(d_rows),))
  return exchange


def all_gather(axes: tuple[str, ...], fp8: bool = False) -> Collective:
  """Every device's rows, concatenated in device order over `axes`."""
  gather = lambda a: jax.lax.all_gather(a, axes, axis=0, tiled=True)
  if not fp8:
    return gather
  return fp8_exchange(gather, lambda a: jax.lax.psum_scatter(a, axes, scatter_dimension=0,
                                                             tiled=True))


def all_to_all(axes: tuple[str, ...], fp8: bool = False) -> Collective:
  """Row block p goes to peer p over `axes`; block p of the result came from peer p."""
  exchange = lambda a: jax.lax.all_to_all(a, axes, 0, 0, tiled=True)
  return fp8_exchange(exchange, exchange) if fp8 else exchange


def reduce_scatter(axes: tuple[str, ...]) -> Collective:
  """The sum over `axes` of every device's rows; each device keeps its own block of them."""
  return lambda a: jax.lax.psum_scatter(a, axes, scatter_dimension=0, tiled=True)


def varying_like(tree, x: jax.Array | jax.ShapeDtypeStruct):
  """`tree`'s arrays marked as varying over every mesh axis x (an array, or a shape from
  `jax.eval_shape`) varies over (inside `jax.shard_map`; nothing to do when it does not check
  them). Arrays the same on several devices, such as expert weights over their data axes, get
  their gradients summed over those axes where this is transposed: once, wherever the arrays are
  used after it."""
  def varying(a):
    types = (a if isinstance(a, jax.ShapeDtypeStruct) else jax.typeof(a)).manual_axis_type
    return types.varying if types is not None else frozenset()

  def cast(a):
    missing = tuple(sorted(varying(x) - varying(a)))
    return jax.lax.pcast(a, missing, to="varying") if missing else a

  return jax.tree.map(cast, tree)
