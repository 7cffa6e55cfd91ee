"""Next-token cross-entropy straight from the last hidden states, without holding [B, S, V] logits.

The LM head and the loss run together, a chunk of the sequence at a time: each chunk's logits are
made in float32 (the head's GEMM accumulates in float32), reduced to their log-sum-exp and target
logit, and dropped. The backward pass makes them again per chunk and turns them into the two
gradients at once (dlogits = softmax - onehot, never stored whole). Exact: the same function as
`log_softmax` over the whole vocabulary, only never [B, S, V] in memory (one chunk is
[B, S / chunks, V]).

Chunk i holds positions s with s % chunks == i, so a chunk keeps the batch and sequence placement
of the hidden states (context parallelism splits S into contiguous blocks; each block has
positions of every chunk). `place` pins each chunk's logits as the caller's layout says.

The head's weight gradient is a sum over every token, and the tokens are split over devices: summed
per chunk, it would cross the devices once per chunk. So each device keeps its own partial sum
over the chunks (one [D, V] float32 accumulator per part of the batch and positions, `splits`), and
the parts are summed once, after the last chunk, in the weight's dtype (as the other weights'
gradients are summed over devices).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

# Places an array by names for its axes: "batch", "seq", "vocab" or None (not split).
Place = Callable[[jax.Array, tuple], jax.Array]
LOGITS_PER_CHUNK = 2**28  # float32 logits of one chunk on one device: 1 GiB


def num_chunks(batch: int, seq: int, vocab: int, devices: int = 1) -> int:
  """The fewest chunks (a divisor of `seq`) whose logits stay under LOGITS_PER_CHUNK on each of
  the `devices` that split them (fewer chunks: fewer, larger GEMMs)."""
  want = max(1, math.ceil(batch * seq * vocab / (devices * LOGITS_PER_CHUNK)))
  return next(n for n in range(want, seq + 1) if seq % n == 0)


def _chunked(a_BS, chunks: int):
  """[B, S, ...] -> [chunks, B, S / chunks, ...], chunk i holding positions s % chunks == i."""
  b, s = a_BS.shape[:2]
  return jnp.moveaxis(a_BS.reshape(b, s // chunks, chunks, *a_BS.shape[2:]), 2, 0)


def _unchunked(a_nBc):
  n, b, c = a_nBc.shape[:3]
  return jnp.moveaxis(a_nBc, 0, 2).reshape(b, c * n, *a_nBc.shape[3:])


def _logits(h_BcD, w_DV, place: Place):
  return _placed_logits(jnp.einsum("bcd,dv->bcv", h_BcD, w_DV,
                                   preferred_element_type=jnp.float32), place)


def _placed_logits(logits_BcV, place: Place):
  return place(logits_BcV, ("batch", "seq", "vocab"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _nll_sum(h_BSD, w_DV, targets_BS, weight_BS, chunks: int, splits: tuple[int, int],
             place: Place):
  return _forward(h_BSD, w_DV, targets_BS, weight_BS, chunks, splits, place)[0]


def _forward(h_BSD, w_DV, targets_BS, weight_BS, chunks, splits, place):
  def chunk(total, xs):
    h_BcD, targets_Bc, weight_Bc = xs
    logits_BcV = _logits(h_BcD, w_DV, place)
    lse_Bc = jax.nn.logsumexp(logits_BcV, axis=-1)
    target_Bc = jnp.take_along_axis(logits_BcV, targets_Bc[..., None], axis=-1)[..., 0]
    return total + jnp.sum((lse_Bc - target_Bc) * weight_Bc), lse_Bc

  xs = (_chunked(h_BSD, chunks), _chunked(targets_BS, chunks), _chunked(weight_BS, chunks))
  total, lse_nBc = jax.lax.scan(chunk, jnp.zeros((), jnp.float32), xs)
  return total, (h_BSD, w_DV, targets_BS, weight_BS, lse_nBc)


def _parts(a_BcX, splits: tuple[int, int]):
  """[B, c, ...] -> [Pb, B / Pb, Pc, c / Pc, ...]: the batch and positions cut into the parts
  the devices hold (`splits` = (Pb, Pc))."""
  (pb, pc), (b, c) = splits, a_BcX.shape[:2]
  return a_BcX.reshape(pb, b // pb, pc, c // pc, *a_BcX.shape[2:])


def _backward(chunks, splits, place, residuals, g):
  h_BSD, w_DV, targets_BS, weight_BS, lse_nBc = residuals
  pb, pc = splits
  # Each device's share of the head's gradient: summed over devices once, after the last chunk.
  place_partial = lambda dw_PQDV: place(dw_PQDV, ("batch", "seq", None, "vocab"))

  def chunk(dw_PQDV, xs):
    h_BcD, targets_Bc, weight_Bc, lse_Bc = xs
    logits_BcV = _logits(h_BcD, w_DV, place)
    onehot_BcV = jnp.arange(logits_BcV.shape[-1]) == targets_Bc[..., None]
    probs_BcV = jnp.exp(logits_BcV - lse_Bc[..., None])
    dlogits_BcV = (probs_BcV - onehot_BcV) * (g * weight_Bc)[..., None]
    dlogits_BcV = _placed_logits(dlogits_BcV, place).astype(h_BcD.dtype)
    dh_BcD = jnp.einsum("bcv,dv->bcd", dlogits_BcV, w_DV)
    dw_PQDV = place_partial(dw_PQDV + jnp.einsum(
        "pbqcd,pbqcv->pqdv", _parts(h_BcD, splits), _parts(dlogits_BcV, splits),
        preferred_element_type=jnp.float32))
    return dw_PQDV, dh_BcD

  xs = (_chunked(h_BSD, chunks), _chunked(targets_BS, chunks), _chunked(weight_BS, chunks),
        lse_nBc)
  zeros = place_partial(jnp.zeros((pb, pc, *w_DV.shape), jnp.float32))
  dw_PQDV, dh_nBcD = jax.lax.scan(chunk, zeros, xs)
  # The parts summed in the weight's dtype, as the other weights' gradients are (over the
  # parts at once: summed over one axis, then the other, it takes two reductions).
  parts_PDV = dw_PQDV.astype(w_DV.dtype).reshape(pb * pc, *w_DV.shape)
  dw_DV = jax.lax.reduce(parts_PDV, jnp.zeros((), w_DV.dtype), jax.lax.add, (0,))
  # Made here, so that the float32 sums die here: left to XLA, the sum and the cast fused into
  # the optimizer's update at the end of the step, or ran there, and the float32 sums (a [D, V]
  # float32 array per part) were held through the whole backward pass. Tied to h's gradient,
  # which the rest of the backward pass needs first, they cannot wait (scripts/compile_for_gpu.py).
  dh_BSD, dw_DV = jax.lax.optimization_barrier((_unchunked(dh_nBcD), dw_DV))
  return dh_BSD, dw_DV, None, None


_nll_sum.defvjp(_forward, _backward)


def linear_cross_entropy(h_BSD: jax.Array, w_DV: jax.Array, targets_BS: jax.Array,
                         mask_BS: jax.Array | None = None, *, chunks: int | None = None,
                         place: Place = lambda x, axes: x, splits: tuple[int, int] = (1, 1),
                         devices: int = 1) -> jax.Array:
  """Sum over the tokens where `mask_BS` holds of -log softmax(h . w)[target], in float32.

  `h_BSD` and `w_DV` in the compute dtype; `chunks` defaults to `num_chunks` for the logits split
  over `devices`. `place` pins a chunk's [B, S / chunks, V] logits (e.g. split over the
  vocabulary with tensor parallelism) and the head gradient's partial sums; `splits`: into how
  many parts the devices split the batch and a chunk's positions, each part keeping its own
  partial sum of the head's gradient (any pair of divisors gives the same result; the
  devices' own split sums over the devices once rather than once per chunk)."""
  batch, seq = targets_BS.shape
  chunks = chunks or num_chunks(batch, seq, w_DV.shape[1], devices)
  # A count that does not divide its axis cannot be the devices' split of it: one part there
  # (the chunk's sum over that axis then crosses the devices, as before parts existed).
  pb, pc = splits
  splits = (pb if batch % pb == 0 else 1, pc if (seq // chunks) % pc == 0 else 1)
  weight_BS = (jnp.ones(targets_BS.shape, jnp.float32) if mask_BS is None
               else mask_BS.astype(jnp.float32))
  return _nll_sum(h_BSD, w_DV, targets_BS, weight_BS, chunks, splits, place)
