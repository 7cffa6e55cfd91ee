"""Causal softmax attention kernels that return the softmax's log-sum-exp and take it back in the
backward pass, so that jmoe/ops/attention.py can change the softmax's denominator (the sinks)
around them under one custom VJP.

A kernel is a forward and a backward over the same pattern of visible keys: query s sees key t
when t <= s, s - t < window (0: no window), and both lie in the same packed document when
`segment_ids_BS` is given (ids 1, 2, ... in runs; 0 for padding at a row's end).
  forward(q_BSHA, k_BTGA, v_BTGW, segment_ids_BS, *, scale, window) -> (out_BSHW, lse_BHS)
  backward(q, k, v, out_BSHW, lse_BHS, dout_BSHW, segment_ids_BS, *, scale, window)
      -> (dq, dk, dv)
lse is float32, the natural log of each query's softmax denominator over its visible keys (scaled
logits). The backward takes the output and the log-sum-exp the probabilities are to be formed with,
which need not be the forward's own: with P = exp(scale q.k - lse) and D = rowsum(dout * out),
  dv = P^T dout,  dS = P * (dout.v - D),  dq = scale dS.k,  dk = scale dS^T.q,
which is exact for any extra term in the denominator whose value is zero (a sink), given that term's
lse and output. Heads: query head h uses key/value head h // (H / G). The value head dim W may
differ from the query/key head dim A (multi-head latent attention).

  cudnn  cuDNN's flash kernels through JAX's own binding (its forward with the statistics, its
         backward primitive fed jmoe's); packed documents as cuDNN's packed-sequence form (each
         document's offset and length, whole blocks across documents skipped), with more than
         `max_documents` documents in a row (model.attention_max_documents) taking XLA's
         kernel in a branch, a block of FALLBACK_BLOCK queries at a time. cuDNN sizes its work
         for B x max_documents sequences of S tokens each (its backward's float32 dQ
         accumulator and statistics): 64 cost a packed Qwen3-30B-A3B step 14 GiB and 6%; so
         packed rows go to it one per device at a time (`_by_rows`: 16 documents, 2 rows a
         device, 3.6 -> 1.4 GiB over the unpacked step on an H200). That branch is decided on
         the device, and XLA's GPU runtime reads a branch's predicate by waiting for the
         device: the host thread launching the step cannot run ahead of it, and a copy to the
         host beside the step (a checkpoint's) held each such wait up for the copy's length.
         Where the caller knows, counted on the host, that every row holds at most N
         documents, it traces under `documents_per_row(N)`, and a kernel whose
         max_documents is at least N takes cuDNN's packed form with no branch
  xla    einsums over the [S, T] scores with the pattern as a mask; any platform, the reference
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

F32 = jnp.float32
MAX_DOCUMENTS = 16  # documents per row that cuDNN's packed form takes, unless told
# Queries per block of the branch that takes rows of more documents: the branch's buffers are
# held whether it runs or not, and [S, S] scores per head would be most of a packed step's memory.
FALLBACK_BLOCK = 256


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
  forward: Callable
  backward: Callable
  # (q, k, v, segment_ids, window) -> why this kernel cannot take the case, or None
  refusal: Callable = lambda *args: None


# --- XLA: the scores as an [S, T] array per head ---

def visible(seq: int, window: int, segment_ids_BS: jax.Array | None, start=0,
            queries: int | None = None) -> jax.Array:
  """[B or 1, 1, 1, Q, T]: which keys each query sees (broadcast over key and query heads), for
  the Q = `queries` (default: all) queries from position `start` on."""
  queries = seq if queries is None else queries
  s_S1, t_1T = start + jnp.arange(queries)[:, None], jnp.arange(seq)[None, :]
  allowed_ST = t_1T <= s_S1
  if window:
    allowed_ST &= s_S1 - t_1T < window
  allowed_BST = allowed_ST[None]
  if segment_ids_BS is not None:
    ids_BS = jax.lax.dynamic_slice_in_dim(segment_ids_BS, start, queries, axis=1)
    allowed_BST = allowed_BST & (ids_BS[:, :, None] == segment_ids_BS[:, None, :])
  return allowed_BST[:, None, None]


def _heads_major(x_BSHA, groups):
  """[B, G, R, S, A]: the R query heads of each key head, each head's tokens together, so that
  every product below has its batch dimensions first (no transposed copy of the scores)."""
  b, s, h, a = x_BSHA.shape
  return x_BSHA.reshape(b, s, groups, h // groups, a).transpose(0, 2, 3, 1, 4)


def _tokens_major(x_BGRSA):
  b, g, r, s, a = x_BGRSA.shape
  return x_BGRSA.transpose(0, 3, 1, 2, 4).reshape(b, s, g * r, a)


def _logits(q_BGRSA, k_BGTA, scale):
  return jnp.einsum("bgrsa,bgta->bgrst", q_BGRSA, k_BGTA, preferred_element_type=F32) * scale


def xla_forward(q_BSHA, k_BTGA, v_BTGW, segment_ids_BS=None, *, scale, window, start=0):
  """Attention of the queries q_BSHA, the S from position `start` on, over every key."""
  b, s, h, _ = q_BSHA.shape
  g = k_BTGA.shape[2]
  allowed = visible(k_BTGA.shape[1], window, segment_ids_BS, start, s)
  logits = _logits(_heads_major(q_BSHA, g), k_BTGA.transpose(0, 2, 1, 3), scale)
  logits = jnp.where(allowed, logits, -jnp.inf)
  lse_BGRS = jax.nn.logsumexp(logits, axis=-1)
  p = jnp.exp(logits - lse_BGRS[..., None])
  out_BGRSW = jnp.einsum("bgrst,bgtw->bgrsw", p.astype(v_BTGW.dtype),
                         v_BTGW.transpose(0, 2, 1, 3), preferred_element_type=F32)
  return _tokens_major(out_BGRSW).astype(q_BSHA.dtype), lse_BGRS.reshape(b, h, s)


def xla_backward(q_BSHA, k_BTGA, v_BTGW, out_BSHW, lse_BHS, dout_BSHW, segment_ids_BS=None, *,
                 scale, window, start=0, accumulate=False):
  """The gradients of `xla_forward`'s output (queries from `start` on); `accumulate`: dk and dv
  in float32, as partial sums over query blocks."""
  b, s, h, _ = q_BSHA.shape
  g = k_BTGA.shape[2]
  q_BGRSA = _heads_major(q_BSHA, g)
  k_BGTA, v_BGTW = k_BTGA.transpose(0, 2, 1, 3), v_BTGW.transpose(0, 2, 1, 3)
  dout_BGRSW = _heads_major(dout_BSHW, g)
  allowed = visible(k_BTGA.shape[1], window, segment_ids_BS, start, s)
  logits = jnp.where(allowed, _logits(q_BGRSA, k_BGTA, scale), -jnp.inf)
  p = jnp.exp(logits - lse_BHS.reshape(b, g, h // g, s)[..., None])
  d_BGRS = jnp.einsum("bgrsw,bgrsw->bgrs", dout_BGRSW, _heads_major(out_BSHW, g),
                      preferred_element_type=F32)
  dv_BGTW = jnp.einsum("bgrst,bgrsw->bgtw", p, dout_BGRSW, preferred_element_type=F32)
  dp = jnp.einsum("bgrsw,bgtw->bgrst", dout_BGRSW, v_BGTW, preferred_element_type=F32)
  ds = p * (dp - d_BGRS[..., None]) * scale
  dq_BGRSA = jnp.einsum("bgrst,bgta->bgrsa", ds, k_BGTA, preferred_element_type=F32)
  dk_BGTA = jnp.einsum("bgrst,bgrsa->bgta", ds, q_BGRSA, preferred_element_type=F32)
  dk_BTGA, dv_BTGW = dk_BGTA.transpose(0, 2, 1, 3), dv_BGTW.transpose(0, 2, 1, 3)
  if not accumulate:
    dk_BTGA, dv_BTGW = dk_BTGA.astype(k_BTGA.dtype), dv_BTGW.astype(v_BTGW.dtype)
  return _tokens_major(dq_BGRSA).astype(q_BSHA.dtype), dk_BTGA, dv_BTGW


def _query_blocks(block, x_BS__):
  """[B, S, ...] -> [S / block, B, block, ...]."""
  return x_BS__.reshape(x_BS__.shape[0], -1, block, *x_BS__.shape[2:]).swapaxes(0, 1)


def blockwise_forward(q_BSHA, k_BTGA, v_BTGW, segment_ids_BS=None, *, scale, window, block):
  """`xla_forward` a block of `block` queries at a time: the scores held are [block, T] per head
  instead of [S, T]."""
  s = q_BSHA.shape[1]
  if s % block or s == block:
    return xla_forward(q_BSHA, k_BTGA, v_BTGW, segment_ids_BS, scale=scale, window=window)
  q_NBCHA = _query_blocks(block, q_BSHA)

  def one(n, q_BCHA):
    return xla_forward(q_BCHA, k_BTGA, v_BTGW, segment_ids_BS, scale=scale, window=window,
                       start=n * block)
  out_NBCHW, lse_NBHC = jax.lax.map(lambda a: one(*a), (jnp.arange(s // block), q_NBCHA))
  out_BSHW = out_NBCHW.swapaxes(0, 1).reshape(q_BSHA.shape[:3] + out_NBCHW.shape[-1:])
  lse_BHS = lse_NBHC.transpose(1, 2, 0, 3).reshape(lse_NBHC.shape[1], lse_NBHC.shape[2], s)
  return out_BSHW, lse_BHS


def blockwise_backward(q_BSHA, k_BTGA, v_BTGW, out_BSHW, lse_BHS, dout_BSHW, segment_ids_BS=None,
                       *, scale, window, block):
  """`xla_backward` a block of `block` queries at a time, dk and dv summed over the blocks."""
  s = q_BSHA.shape[1]
  if s % block or s == block:
    return xla_backward(q_BSHA, k_BTGA, v_BTGW, out_BSHW, lse_BHS, dout_BSHW, segment_ids_BS,
                        scale=scale, window=window)
  b, h = lse_BHS.shape[:2]
  lse_NBHC = lse_BHS.reshape(b, h, -1, block).transpose(2, 0, 1, 3)
  blocks = (_query_blocks(block, q_BSHA), _query_blocks(block, out_BSHW), lse_NBHC,
            _query_blocks(block, dout_BSHW))

  def one(sums, a):
    n, q, out, lse, dout = a
    dq, dk, dv = xla_backward(q, k_BTGA, v_BTGW, out, lse, dout, segment_ids_BS, scale=scale,
                              window=window, start=n * block, accumulate=True)
    return (sums[0] + dk, sums[1] + dv), dq
  zeros = (jnp.zeros(k_BTGA.shape, F32), jnp.zeros(v_BTGW.shape, F32))
  (dk, dv), dq_NBCHA = jax.lax.scan(one, zeros, (jnp.arange(s // block), *blocks))
  return (dq_NBCHA.swapaxes(0, 1).reshape(q_BSHA.shape), dk.astype(k_BTGA.dtype),
          dv.astype(v_BTGW.dtype))


XLA = AttentionKernel(xla_forward, xla_backward)


# --- cuDNN ---

def _document_starts(segment_ids_BS):
  """[B, S]: whether a document starts at the token."""
  prev_BS = jnp.pad(segment_ids_BS[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  return (segment_ids_BS != prev_BS) & (segment_ids_BS > 0)


def packed_segments(segment_ids_BS: jax.Array, max_segments: int):
  """cuDNN's packed-sequence description of rows of documents (segment ids 1, 2, ... in runs,
  0 for padding at a row's end): (lengths_BM, offsets_BM1, documents_B), each row's document
  lengths and start offsets padded with -1 to `max_segments` (offsets: one more)."""
  start_BS = _document_starts(segment_ids_BS)
  starts_BM = jax.vmap(lambda s: jnp.nonzero(s, size=max_segments, fill_value=-1)[0])(start_BS)
  starts_BM = starts_BM.astype(jnp.int32)
  tokens_B1 = jnp.sum(segment_ids_BS > 0, axis=1, dtype=jnp.int32)[:, None]
  next_BM = jnp.concatenate([starts_BM[:, 1:], jnp.full_like(starts_BM[:, :1], -1)], axis=1)
  ends_BM = jnp.where(next_BM >= 0, next_BM, tokens_B1)
  lengths_BM = jnp.where(starts_BM >= 0, ends_BM - starts_BM, -1)
  offsets_BM1 = jnp.concatenate([starts_BM, jnp.full_like(starts_BM[:, :1], -1)], axis=1)
  return lengths_BM, offsets_BM1, jnp.sum(start_BS, axis=1)


def _statistics_index(segment_ids_BS, offsets_BM1, documents_B):
  """Where each token's softmax statistic lies in cuDNN's packed statistics [N, H, S], N = B x
  M (M + 1 = offsets_BM1's width): the documents of all rows one after another (row 0's first), each document's
  tokens from its own start. Returns (document_BS, within_BS), the index of the token's document
  in that order and its place in it; a padding token's document is N (past the end)."""
  batch, seq = segment_ids_BS.shape
  most = offsets_BM1.shape[1] - 1
  changes_BS = jnp.pad(segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1], ((0, 0), (1, 0)))
  in_row_BS = jnp.cumsum(changes_BS, axis=1)  # the token's document among its row's
  before_B1 = (jnp.cumsum(documents_B) - documents_B)[:, None]
  first_BS = jnp.take_along_axis(offsets_BM1, jnp.clip(in_row_BS, 0, most - 1), axis=1)
  in_document_BS = segment_ids_BS > 0
  document_BS = jnp.where(in_document_BS, before_B1 + in_row_BS, batch * most)
  within_BS = jnp.where(in_document_BS, jnp.arange(seq)[None] - first_BS, 0)
  return document_BS, within_BS


def in_documents(segment_ids_BS, x_BS__):
  """x where the token lies in a document, zero on padding tokens (segment id 0); x itself
  without segment ids."""
  if segment_ids_BS is None:
    return x_BS__
  in_document = (segment_ids_BS > 0).reshape(segment_ids_BS.shape + (1,) * (x_BS__.ndim - 2))
  return jnp.where(in_document, x_BS__, jnp.zeros((), x_BS__.dtype))


def _cudnn_module():
  from jax._src.cudnn import fused_attention_stablehlo
  return fused_attention_stablehlo


def _cudnn_refusal(q_BSHA, k_BTGA, v_BTGW, segment_ids_BS, window):
  """Why cuDNN's flash kernels cannot take this case (JAX's own checks, as its training path
  runs them), or None."""
  try:
    cudnn = _cudnn_module()
    layout = cudnn.AttentionLayout.BTNH
    cudnn.check_layout(q_BSHA, k_BTGA, v_BTGW, None, None, None, None, None, None, None, layout)
    cudnn.check_is_flash_attention(q_BSHA, k_BTGA, v_BTGW, layout.value,
                                   cudnn.check_cudnn_version(), False, True,
                                   segment_ids_BS is not None)
  except (ValueError, NotImplementedError, TypeError, RuntimeError, ImportError) as e:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  if q_BSHA.shape[2] % k_BTGA.shape[2]:
    return "query heads are not a multiple of key heads"
  return None


def _cudnn_call(segment_ids_BS, window, max_documents):
  """The sequence-length and offset arguments and the mask type of a cuDNN call."""
  cudnn = _cudnn_module()
  kw = dict(sliding_window_length=window or None, mask_type=cudnn.MaskType.CAUSAL)
  if segment_ids_BS is None:
    return kw, None
  lengths_BM, offsets_BM1, documents_B = packed_segments(segment_ids_BS, max_documents)
  kw.update(q_seqlen=lengths_BM, kv_seqlen=lengths_BM, q_offsets=offsets_BM1,
            kv_offsets=offsets_BM1, mask_type=cudnn.MaskType.PADDING_CAUSAL)
  return kw, (offsets_BM1, documents_B)


# The most documents any row of the batch being traced holds, as its caller counted them on
# the host (`documents_per_row`); None: not known, decided on the device. A JAX user context:
# part of the key of JAX's caches of traces and compiled programs, so that a function traced
# under one bound is traced again under another.
_DOCUMENTS_PER_ROW = jax.make_user_context(default_value=None)


def documents_per_row(at_most: int | None) -> contextlib.AbstractContextManager:
  """A context within which every row of the segment ids the cuDNN kernels are given holds at
  most `at_most` documents (None: not known). The caller must have counted them on the host (a
  row with more would be attended wrongly); a program traced so is only for such batches."""
  return _DOCUMENTS_PER_ROW(at_most)


def _packed_fits(segment_ids_BS, max_documents):
  """Whether every row has at most `max_documents` documents (else XLA's kernel runs)."""
  return jnp.max(jnp.sum(_document_starts(segment_ids_BS), axis=1)) <= max_documents


def _fits_or_branch(fused: Callable, unpacked: Callable, max_documents: int, *args):
  """`fused(*args)` where the rows are known to hold at most `max_documents` documents
  (`documents_per_row`), else a branch on the device between it and `unpacked(*args)`
  (args end with the segment ids)."""
  known = _DOCUMENTS_PER_ROW.value
  if known is not None and known <= max_documents:
    return fused(*args)
  return jax.lax.cond(_packed_fits(args[-1], max_documents), fused, unpacked, *args)


def _by_rows(run, shards, *arrays_B):
  """`run` on `shards` rows at a time, one from each of the `shards` equal blocks of the batch
  (each device's share where the layout splits the batch over `shards` devices), the results
  put back in order. cuDNN sizes a packed call's work for every row's `max_documents` sequences
  of S tokens: a row at a time per device, that is one row's. The calls are unrolled (a
  lax.map over the rows measured the same step time on an H200, 2026-12-03)."""
  batch = arrays_B[0].shape[0]
  if batch % shards or batch == shards:
    return run(*arrays_B)
  steps = batch // shards
  blocks = [x.reshape(shards, steps, *x.shape[1:]) for x in arrays_B]
  results = [run(*(x[:, i] for x in blocks)) for i in range(steps)]
  return jax.tree.map(lambda *ys: jnp.stack(ys, axis=1).reshape(batch, *ys[0].shape[1:]),
                      *results)


def _fused_forward(q_BSHA, k_BTGA, v_BTGW, segment_ids_BS, *, scale, window, max_documents):
  """cuDNN's forward: of rows of one sequence each (no segment ids), or of packed rows (each
  with at most `max_documents` documents)."""
  cudnn = _cudnn_module()
  kw, packed = _cudnn_call(segment_ids_BS, window, max_documents)
  out, stats = cudnn.dot_product_attention(q_BSHA, k_BTGA, v_BTGW, scale=scale,
                                           return_residual=True, **kw)
  if packed is None:
    return out, stats  # [B, H, S]
  document_BS, within_BS = _statistics_index(segment_ids_BS, *packed)
  heads_1H1 = jnp.arange(q_BSHA.shape[2])[None, :, None]
  lse_BHS = stats.at[document_BS[:, None, :], heads_1H1, within_BS[:, None, :]].get(
      mode="fill", fill_value=0.0)
  return out, lse_BHS  # (padding tokens' rows: jmoe/ops/attention.py zeroes them)


def _fused_backward(q, k, v, out, lse_BHS, dout, segment_ids_BS, *, scale, window,
                    max_documents):
  """cuDNN's backward of `_fused_forward`."""
  cudnn = _cudnn_module()
  kw, packed = _cudnn_call(segment_ids_BS, window, max_documents)
  unused = jnp.zeros(0, q.dtype)
  stats = lse_BHS
  if packed is not None:  # back to cuDNN's packed order: [B x max_documents, H, S]
    b, s, h = q.shape[0], q.shape[1], q.shape[2]
    document_BS, within_BS = _statistics_index(segment_ids_BS, *packed)
    stats = jnp.zeros((b * max_documents, h, s), F32).at[
        document_BS[:, None, :], jnp.arange(h)[None, :, None], within_BS[:, None, :]].set(
            lse_BHS, mode="drop")
  args = [kw.get(name, unused) for name in ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets")]
  grads = cudnn._dot_product_attention_bwd_p_wrapper.bind(
      q, k, v, unused, *args, unused, unused, stats, out, dout, scale=scale, seed=42,
      dropout_rate=0.0, variadic_args=(False, False), mask_type=kw["mask_type"],
      layout=cudnn.AttentionLayout.BTNH.value,
      sliding_window_length=kw["sliding_window_length"])[:3]
  if packed is None:
    return tuple(grads)
  # Padding tokens take part in no document: their rows of the gradients are zero (the kernel
  # leaves them unwritten).
  return tuple(in_documents(segment_ids_BS, g) for g in grads)


def _cudnn_forward(q_BSHA, k_BTGA, v_BTGW, segment_ids_BS=None, *, scale, window,
                   max_documents=MAX_DOCUMENTS, shards=1):
  call = functools.partial(_fused_forward, scale=scale, window=window,
                           max_documents=max_documents)
  if segment_ids_BS is None:
    return call(q_BSHA, k_BTGA, v_BTGW, None)
  fused = lambda *a: _by_rows(call, shards, *a)
  unpacked = lambda q, k, v, ids: blockwise_forward(q, k, v, ids, scale=scale, window=window,
                                                    block=FALLBACK_BLOCK)
  return _fits_or_branch(fused, unpacked, max_documents, q_BSHA, k_BTGA, v_BTGW, segment_ids_BS)


def _cudnn_backward(q_BSHA, k_BTGA, v_BTGW, out_BSHW, lse_BHS, dout_BSHW, segment_ids_BS=None,
                    *, scale, window, max_documents=MAX_DOCUMENTS, shards=1):
  call = functools.partial(_fused_backward, scale=scale, window=window,
                           max_documents=max_documents)
  args = (q_BSHA, k_BTGA, v_BTGW, out_BSHW, lse_BHS, dout_BSHW)
  if segment_ids_BS is None:
    return call(*args, None)
  fused = lambda *a: _by_rows(call, shards, *a)
  unpacked = lambda *a: blockwise_backward(*a, scale=scale, window=window, block=FALLBACK_BLOCK)
  return _fits_or_branch(fused, unpacked, max_documents, *args, segment_ids_BS)


CUDNN = AttentionKernel(_cudnn_forward, _cudnn_backward, _cudnn_refusal)


@functools.cache
def cudnn_kernel(max_documents: int, shards: int = 1) -> AttentionKernel:
  """cuDNN's kernels taking packed rows of up to `max_documents` documents in its packed form,
  a row per call on each of the `shards` devices the batch is split over."""
  if (max_documents, shards) == (MAX_DOCUMENTS, 1):
    return CUDNN
  options = dict(max_documents=max_documents, shards=shards)
  return AttentionKernel(functools.partial(_cudnn_forward, **options),
                         functools.partial(_cudnn_backward, **options), _cudnn_refusal)
