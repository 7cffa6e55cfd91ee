"""Small building blocks: parameters with logical axes, RMSNorm, embedding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], *,
          std: float | None, dtype, decay: bool = True) -> nnx.Param:
  """A parameter with its logical axis names (`axes`) for the sharding rules in jmoe/parallel/.

  std=None initialises to ones (norm scales), std=0 to zeros (biases). `decay` says whether weight
  decay applies to it.
  """
  assert len(shape) == len(axes), (shape, axes)
  if std is None:
    value = jnp.ones(shape, dtype)
  elif std == 0:
    value = jnp.zeros(shape, dtype)
  else:
    value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
    value = value.astype(dtype)
  return nnx.Param(value, axes=axes, weight_decay=decay)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = param(rngs, (dim,), ("norm",), std=None, dtype=param_dtype, decay=False)

  def __call__(self, x_BSD: jax.Array) -> jax.Array:
    x32 = x_BSD.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * self.scale[...].astype(jnp.float32)).astype(x_BSD.dtype)


class Embed(nnx.Module):

  def __init__(self, vocab_size: int, dim: int, std: float, *, param_dtype, dtype,
               rngs: nnx.Rngs):
    self.dtype = dtype
    self.table = param(rngs, (vocab_size, dim), ("vocab", "embed"), std=std, dtype=param_dtype)

  def __call__(self, tokens_BS: jax.Array) -> jax.Array:
    return jnp.take(self.table[...], tokens_BS, axis=0).astype(self.dtype)

  def attend(self, x_BSD: jax.Array) -> jax.Array:
    """Logits against the embedding table (tied output head)."""
    return jnp.einsum("bsd,vd->bsv", x_BSD, self.table[...].astype(x_BSD.dtype))
