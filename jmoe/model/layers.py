"""Small building blocks: RMSNorm and the embedding."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.ops.embedding import lookup
from jmoe.ops.params import param
from jmoe.parallel import split_count

# The residual stream between blocks: sequence-parallel over context and tensor devices.
RESIDUAL_AXES = ("act_batch", "act_seq_sp", None)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = param(rngs, (dim,), ("norm",), std=None, dtype=param_dtype, kind="scale")

  def __call__(self, x_BSD: jax.Array) -> jax.Array:
    return rms_norm(x_BSD, self.scale[...], self.eps)


@functools.partial(jax.checkpoint, static_argnums=(2,))
def rms_norm(x_BSD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) x scale over the last axis, in float32, returned in x's dtype. Its backward pass
  computes it again from x and the scale, all it keeps (`jax.checkpoint`): differentiated as
  written, it kept x in float32 and x normalized in float32, two float32 arrays of x's size per
  norm (8.4 GiB a GPU of the GPT-OSS-20B 8-GPU plan's step, compiled for H200s)."""
  x32 = x_BSD.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * scale_D.astype(jnp.float32)).astype(x_BSD.dtype)


class Embed(nnx.Module):

  def __init__(self, vocab_size: int, dim: int, std: float, *, param_dtype, dtype,
               rngs: nnx.Rngs):
    self.dtype = dtype
    self.table = param(rngs, (vocab_size, dim), ("vocab", "embed"), std=std, dtype=param_dtype,
                       kind="lookup")

  def __call__(self, tokens_BS: jax.Array) -> jax.Array:
    # the output's gradient arrives split as the residual stream is
    split = split_count(RESIDUAL_AXES, (*tokens_BS.shape, 1), dim=1)
    return lookup(self.table[...], tokens_BS, sequence_split=split).astype(self.dtype)
