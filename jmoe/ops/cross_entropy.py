"""Next-token cross-entropy straight from the last hidden states, without holding [B, S, V] logits.

The LM head and the loss run together, a chunk of the sequence at a time: each chunk's logits are
made in float32 (the head's GEMM accumulates in float32), reduced to their log-sum-exp and target
logit, and dropped. The backward pass makes them again per chunk and turns them into the two
gradients at once (dlogits = softmax - onehot, never stored whole). Exact: the same function as
`log_softmax` over the whole vocabulary, only never [B, S, V] in memory (one chunk is
[B, S / chunks, V]).

Chunk i holds positions s with s % chunks == i, so a chunk keeps the batch and sequence placement
of the hidden states (context parallelism splits S into contiguous blocks; each block has
positions of every chunk). `constrain` pins each chunk's logits as the caller's layout says.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

Constrain = Callable[[jax.Array], jax.Array]
LOGITS_PER_CHUNK = 2**28  # float32 logits of one chunk on one device: 1 GiB


def num_chunks(batch: int, seq: int, vocab: int, devices: int = 1) -> int:
  """The fewest chunks (a divisor of `seq`) whose logits stay under LOGITS_PER_CHUNK on each of
  the `devices` that split them. Few chunks matter beyond memory: with the batch split over
  devices, each chunk's head gradient is summed over them (docs/PERFORMANCE.md)."""
  want = max(1, math.ceil(batch * seq * vocab / (devices * LOGITS_PER_CHUNK)))
  return next(n for n in range(want, seq + 1) if seq % n == 0)


def _chunked(a_BS, chunks: int):
  """[B, S, ...] -> [chunks, B, S / chunks, ...], chunk i holding positions s % chunks == i."""
  b, s = a_BS.shape[:2]
  return jnp.moveaxis(a_BS.reshape(b, s // chunks, chunks, *a_BS.shape[2:]), 2, 0)


def _unchunked(a_nBc):
  n, b, c = a_nBc.shape[:3]
  return jnp.moveaxis(a_nBc, 0, 2).reshape(b, c * n, *a_nBc.shape[3:])


def _logits(h_BcD, w_DV, constrain: Constrain):
  return constrain(jnp.einsum("bcd,dv->bcv", h_BcD, w_DV, preferred_element_type=jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _nll_sum(h_BSD, w_DV, targets_BS, weight_BS, chunks: int, constrain: Constrain):
  return _forward(h_BSD, w_DV, targets_BS, weight_BS, chunks, constrain)[0]


def _forward(h_BSD, w_DV, targets_BS, weight_BS, chunks, constrain):
  def chunk(total, xs):
    h_BcD, targets_Bc, weight_Bc = xs
    logits_BcV = _logits(h_BcD, w_DV, constrain)
    lse_Bc = jax.nn.logsumexp(logits_BcV, axis=-1)
    target_Bc = jnp.take_along_axis(logits_BcV, targets_Bc[..., None], axis=-1)[..., 0]
    return total + jnp.sum((lse_Bc - target_Bc) * weight_Bc), lse_Bc

  xs = (_chunked(h_BSD, chunks), _chunked(targets_BS, chunks), _chunked(weight_BS, chunks))
  total, lse_nBc = jax.lax.scan(chunk, jnp.zeros((), jnp.float32), xs)
  return total, (h_BSD, w_DV, targets_BS, weight_BS, lse_nBc)


def _backward(chunks, constrain, residuals, g):
  h_BSD, w_DV, targets_BS, weight_BS, lse_nBc = residuals

  def chunk(dw_DV, xs):
    h_BcD, targets_Bc, weight_Bc, lse_Bc = xs
    logits_BcV = _logits(h_BcD, w_DV, constrain)
    onehot_BcV = jnp.arange(logits_BcV.shape[-1]) == targets_Bc[..., None]
    probs_BcV = jnp.exp(logits_BcV - lse_Bc[..., None])
    dlogits_BcV = (probs_BcV - onehot_BcV) * (g * weight_Bc)[..., None]
    dlogits_BcV = constrain(dlogits_BcV).astype(h_BcD.dtype)
    dh_BcD = jnp.einsum("bcv,dv->bcd", dlogits_BcV, w_DV)
    dw_DV = dw_DV + jnp.einsum("bcd,bcv->dv", h_BcD, dlogits_BcV,
                               preferred_element_type=jnp.float32)
    return dw_DV, dh_BcD

  xs = (_chunked(h_BSD, chunks), _chunked(targets_BS, chunks), _chunked(weight_BS, chunks),
        lse_nBc)
  dw_DV, dh_nBcD = jax.lax.scan(chunk, jnp.zeros(w_DV.shape, jnp.float32), xs)
  return _unchunked(dh_nBcD), dw_DV.astype(w_DV.dtype), None, None


_nll_sum.defvjp(_forward, _backward)


def linear_cross_entropy(h_BSD: jax.Array, w_DV: jax.Array, targets_BS: jax.Array,
                         mask_BS: jax.Array | None = None, *, chunks: int | None = None,
                         constrain: Constrain = lambda x: x, devices: int = 1) -> jax.Array:
  """Sum over the tokens where `mask_BS` holds of -log softmax(h . w)[target], in float32.

  `h_BSD` and `w_DV` in the compute dtype; `chunks` defaults to `num_chunks` for the logits split
  over `devices`; `constrain` places a chunk's [B, S / chunks, V] logits (e.g. split over the
  vocabulary with tensor parallelism)."""
  batch, seq = targets_BS.shape
  chunks = chunks or num_chunks(batch, seq, w_DV.shape[1], devices)
  weight_BS = (jnp.ones(targets_BS.shape, jnp.float32) if mask_BS is None
               else mask_BS.astype(jnp.float32))
  return _nll_sum(h_BSD, w_DV, targets_BS, weight_BS, chunks, constrain)
