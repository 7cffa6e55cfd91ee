"""The embedding lookup, with a gradient that sums a repeated token's rows before scattering them.

The gradient of `take(table_VD, tokens)` is a scatter-add of every position's row into [V, D]. XLA
runs it with one atomic add per element, so a token that recurs across the batch (text's spaces and
common words; every row of byte-level text) serializes its adds on the same addresses, and in a
16-bit table each add rounds. On one H200 (Qwen3-30B-A3B's bench, 8,192 byte-level tokens, D 2048)
that scatter took 4.75 ms of the packed bench's 147.3 ms step; alone, 16.4 ms on those tokens
against 0.5 on random ones, and 9% of the largest entry off the float32 sum.

Here the backward pass first sums the rows of equal tokens within chunks of C positions of a
sequence: E_CC = (ids equal) as 0/1, E . g_CD in float32 (a small GEMM per chunk, the 16-bit
rows summed in float32), keeping each token's first position in the chunk; only those rows go to
the scatter, so a token's adds on one device number at most its chunks (B x S / C) instead of its
occurrences. The chunks run along the sequence within each row, so they stay on the devices that
hold their tokens, whatever the batch's or sequence's split; the table's split is XLA's to handle
as for any scatter. Measured there (docs/PERFORMANCE.md): the packed bench's step 147.2 -> 145.1
ms; alone 1.2 ms on either kind of token, 0.7% of the largest entry off. (A float32 scatter of the
raw rows took 0.85 ms but holds a float32 [V, D] beside the table; C = 256 took 0.6 ms at 1.4%.)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jmoe.ops.remat import zeros_with

CHUNK = 1024  # positions whose equal tokens are summed before the scatter: 2 C D flops a token


def lookup(table_VD: jax.Array, tokens: jax.Array, chunk: int = CHUNK,
           sequence_split: int = 1) -> jax.Array:
  """`table_VD[tokens]`, [*tokens.shape, D]; for a 16-bit table its gradient as described above
  (a float32 table keeps XLA's: its float32 atomics neither serialise as much nor round).
  `sequence_split`: into how many parts the layout splits the last axis of the output's
  gradient (the sequence), so that each part holds whole chunks."""
  if jnp.dtype(table_VD.dtype).itemsize > 2:
    return jnp.take(table_VD, tokens, axis=0)
  vocab, dtype = table_VD.shape[0], table_VD.dtype

  @jax.custom_vjp
  def take(table_VD, tokens):
    return jnp.take(table_VD, tokens, axis=0)

  def forward(table_VD, tokens):
    return take(table_VD, tokens), tokens

  def backward(tokens, g):
    return summed_scatter(g, tokens, vocab, dtype, chunk, sequence_split), None

  take.defvjp(forward, backward)
  return take(table_VD, tokens)


def summed_scatter(g: jax.Array, tokens: jax.Array, vocab: int, dtype, chunk: int = CHUNK,
                   sequence_split: int = 1) -> jax.Array:
  """[V, D] in `dtype`: the sum of g's rows [*tokens.shape, D] by token id, equal ids summed in
  float32 within chunks of `chunk` positions along the last axis of `tokens` before the scatter
  (where that axis splits into `sequence_split` parts, chunks that divide a part). Negative ids
  count from the end, as `take` reads them; ids past the table add nothing (as `take`'s gradient
  drops them). Beside the result it holds, per device and token, 3 C bytes of equality (as bools
  and as 16-bit) and a float32 row: at 128k tokens of 2048 and C 1024, 0.4 and 1 GiB, at the
  backward pass's end."""
  d = g.shape[-1]
  ids = tokens.reshape(-1, tokens.shape[-1]) if tokens.ndim else tokens.reshape(1, 1)
  ids = jnp.where(ids < 0, ids + vocab, ids)
  g_RSD = g.reshape(*ids.shape, d)
  length = ids.shape[1]
  if sequence_split > 1 and length % sequence_split == 0:  # no chunk across two devices' parts
    chunk = math.gcd(length // sequence_split, chunk)
  chunk = min(chunk, length)
  padded = -(-length // chunk) * chunk
  if padded != length:  # the extra positions take an id past the table: dropped
    ids = jnp.pad(ids, ((0, 0), (0, padded - length)), constant_values=vocab)
    g_RSD = jnp.pad(g_RSD, ((0, 0), (0, padded - length), (0, 0)))
  # [rows, chunks, C]: the sequence's chunks keep their own axis, split as the sequence is
  ids_RNC = ids.reshape(ids.shape[0], -1, chunk)
  g_RNCD = g_RSD.reshape(*ids_RNC.shape, d)
  same_RNCC = ids_RNC[..., :, None] == ids_RNC[..., None, :]
  sums_RNCD = jnp.einsum("rnij,rnjd->rnid", same_RNCC.astype(g.dtype), g_RNCD,
                         preferred_element_type=jnp.float32)
  earlier_CC = jnp.arange(chunk)[:, None] > jnp.arange(chunk)[None, :]
  first_RNC = ~jnp.any(same_RNCC & earlier_CC, axis=-1)
  keep_RNC = first_RNC & (ids_RNC >= 0) & (ids_RNC < vocab)
  targets_RNC = jnp.where(keep_RNC, ids_RNC, vocab)  # `vocab`: out of bounds, dropped
  # (indices and rows kept in their [rows, chunks, C] shape: flattened, XLA gathers them whole)
  # The table-sized zeros the scatter adds into, made once g exists (as constants, XLA made them
  # at the start of the backward pass and held the table's bytes until the scatter at its end).
  return zeros_with((vocab, d), dtype, g).at[targets_RNC].add(sums_RNCD.astype(dtype),
                                                             mode="drop")
