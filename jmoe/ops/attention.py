"""Attention kernels behind one call: `jax.nn.dot_product_attention` through cuDNN or XLA.

`ATTENTION_KERNELS` is the list of names `model.attention_kernel` may take (besides `auto`):
  cudnn  cuDNN's fused kernel (NVIDIA GPUs, 16-bit inputs); a case it refuses runs through XLA's,
         with the reason logged once
  xla    XLA's own attention, on any platform
`auto` is cuDNN on GPUs for bf16/fp16 inputs and XLA's otherwise. Packed documents (causal
attention within each document, `segment_ids`) reach cuDNN as its packed-sequence form: each
document's offset and length in its row, so the kernel skips whole blocks across documents
instead of reading an [S, S] mask; rows with more documents than MAX_SEGMENTS, and XLA's kernel,
take the mask. Alternating windows and the sinks reach either kernel as a mask and a bias.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp

from jmoe.errors import choice

log = logging.getLogger("jmoe")

# (q_BSHA, k_BSGA, v_BSGA, **dot_product_attention keywords) -> out_BSHA
AttentionKernel = Callable[..., jax.Array]


@functools.cache
def _refused(reason: str) -> None:
  log.warning("cuDNN attention refused a case (%s); it runs through XLA's attention", reason)


MAX_SEGMENTS = 64  # documents per row that cuDNN's packed form takes here


def same_document(segment_ids_BS: jax.Array) -> jax.Array:
  """[B, 1, S, S]: whether query and key belong to the same packed document."""
  return (segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :])[:, None]


def causal_document_mask(segment_ids_BS: jax.Array) -> jax.Array:
  seq = segment_ids_BS.shape[1]
  return jnp.tril(jnp.ones((seq, seq), bool))[None, None] & same_document(segment_ids_BS)


def packed_segments(segment_ids_BS: jax.Array, max_segments: int):
  """cuDNN's packed-sequence description of rows of documents (segment ids 1, 2, ... in runs,
  0 for padding at a row's end): (lengths_BM, offsets_BM1, documents_B), each row's document
  lengths and start offsets padded with -1 to `max_segments` (offsets: one more)."""
  prev_BS = jnp.pad(segment_ids_BS[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  start_BS = (segment_ids_BS != prev_BS) & (segment_ids_BS > 0)
  starts_BM = jax.vmap(lambda s: jnp.nonzero(s, size=max_segments, fill_value=-1)[0])(start_BS)
  starts_BM = starts_BM.astype(jnp.int32)
  tokens_B1 = jnp.sum(segment_ids_BS > 0, axis=1, dtype=jnp.int32)[:, None]
  next_BM = jnp.concatenate([starts_BM[:, 1:], jnp.full_like(starts_BM[:, :1], -1)], axis=1)
  ends_BM = jnp.where(next_BM >= 0, next_BM, tokens_B1)
  lengths_BM = jnp.where(starts_BM >= 0, ends_BM - starts_BM, -1)
  offsets_BM1 = jnp.concatenate([starts_BM, jnp.full_like(starts_BM[:, :1], -1)], axis=1)
  return lengths_BM, offsets_BM1, jnp.sum(start_BS, axis=1)


def _cudnn_packed(q_BSHA, k_BSGA, v_BSGA, segment_ids_BS, scale):
  """Causal attention within each packed document through cuDNN's packed-sequence kernel (JAX's
  own cuDNN binding, the one `jax.nn.dot_product_attention` calls), in a branch taken when
  every row has at most MAX_SEGMENTS documents; else with the document mask."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
  lengths_BM, offsets_BM1, documents_B = packed_segments(segment_ids_BS, MAX_SEGMENTS)
  in_document_BS11 = (segment_ids_BS > 0)[:, :, None, None]

  def packed(q, k, v):
    out = cudnn_attention.dot_product_attention(
        q, k, v, q_seqlen=lengths_BM, kv_seqlen=lengths_BM, q_offsets=offsets_BM1,
        kv_offsets=offsets_BM1, scale=scale,
        mask_type=cudnn_attention.MaskType.PADDING_CAUSAL)
    return jnp.where(in_document_BS11, out, jnp.zeros((), out.dtype))  # padding: no document

  def masked(q, k, v):
    return _cudnn(q, k, v, mask=causal_document_mask(segment_ids_BS), scale=scale)

  return jax.lax.cond(jnp.max(documents_B) <= MAX_SEGMENTS, packed, masked,
                      q_BSHA, k_BSGA, v_BSGA)


def _xla(q_BSHA, k_BSGA, v_BSGA, **kwargs) -> jax.Array:
  return jax.nn.dot_product_attention(q_BSHA, k_BSGA, v_BSGA, implementation="xla", **kwargs)


def _cudnn(q_BSHA, k_BSGA, v_BSGA, **kwargs) -> jax.Array:
  try:
    return jax.nn.dot_product_attention(q_BSHA, k_BSGA, v_BSGA, implementation="cudnn", **kwargs)
  except (ValueError, NotImplementedError, TypeError, RuntimeError) as e:
    _refused(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
  return _xla(q_BSHA, k_BSGA, v_BSGA, **kwargs)


ATTENTION_KERNELS: dict[str, AttentionKernel] = {"cudnn": _cudnn, "xla": _xla}


def auto_kernel(platform: str, dtype) -> str:
  """What `auto` means on `platform` for inputs of `dtype`."""
  return "cudnn" if platform == "gpu" and dtype in (jnp.bfloat16, jnp.float16) else "xla"


def attention(q_BSHA, k_BSGA, v_BSGA, *, kernel: str = "auto",
              segment_ids: jax.Array | None = None, **kwargs) -> jax.Array:
  """Attention through the kernel named `kernel` (or `auto`'s choice on this platform).
  `segment_ids` [B, S]: causal attention within each packed document (no other mask then)."""
  if kernel == "auto":
    kernel = auto_kernel(jax.default_backend(), q_BSHA.dtype)
  fn = choice("model.attention_kernel", kernel, ATTENTION_KERNELS)
  if segment_ids is None:
    return fn(q_BSHA, k_BSGA, v_BSGA, **kwargs)
  if fn is _cudnn:
    try:
      return _cudnn_packed(q_BSHA, k_BSGA, v_BSGA, segment_ids, kwargs["scale"])
    except (ValueError, NotImplementedError, TypeError, RuntimeError, ImportError) as e:
      _refused(f"packed documents: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
  return fn(q_BSHA, k_BSGA, v_BSGA, mask=causal_document_mask(segment_ids), **kwargs)
