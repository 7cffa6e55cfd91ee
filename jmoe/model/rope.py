"""Rotary position embeddings, in the half-split layout (the first half of each head's dims pairs
with the second half), which is the layout Hugging Face checkpoints use; interleaved checkpoints are
permuted into it on import. Optional YaRN scaling of the frequencies for long contexts."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jmoe.config import YarnConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(dim: int, theta: float, yarn: YarnConfig) -> tuple[np.ndarray, float]:
  """(inverse frequencies [dim / 2], factor on cos and sin) for rotating `dim` dims."""
  inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  if yarn.factor <= 1:
    return inv_freq, 1.0

  def correction_dim(rotations):  # the dim whose wavelength fits `rotations` times in the context
    return dim * math.log(yarn.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
  if yarn.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  # Fast-rotating dims keep their frequency (extrapolate), slow ones are stretched by `factor`.
  inv_freq = inv_freq / yarn.factor * ramp + inv_freq * (1 - ramp)
  if yarn.mscale_all_dim:
    scale = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
  else:
    scale = yarn_mscale(yarn.factor)
  return inv_freq.astype(np.float32), float(scale)


def apply_rope(x_BSHA: jax.Array, positions_BS: jax.Array, theta: float,
               yarn: YarnConfig = YarnConfig()) -> jax.Array:
  inv_freq, scale = rope_frequencies(x_BSHA.shape[-1], theta, yarn)
  angles_BSa = positions_BS[..., None].astype(jnp.float32) * inv_freq  # a: half of A
  cos = jnp.cos(angles_BSa)[:, :, None, :] * scale
  sin = jnp.sin(angles_BSa)[:, :, None, :] * scale
  x1, x2 = jnp.split(x_BSHA.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BSHA.dtype)


def softmax_scale(qk_head_dim: int, yarn: YarnConfig) -> float:
  """1/sqrt(d), times YaRN's mscale(all_dim)^2 where the model asks for it (DeepSeek)."""
  scale = qk_head_dim ** -0.5
  if yarn.factor > 1 and yarn.mscale_all_dim:
    scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
  return scale
