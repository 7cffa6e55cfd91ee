"""Causal attention for training, through the kernel `model.attention_kernel` names.

`ATTENTION_KERNELS` is the list of names `model.attention_kernel` may take (besides `auto`):
  cudnn  cuDNN's fused flash kernels (NVIDIA GPUs, 16-bit inputs); a case it refuses runs
         through XLA's, with the reason logged once
  xla    XLA's own attention over the [S, S] scores, on any platform
`auto` is cuDNN on GPUs for bf16/fp16 inputs and XLA's otherwise (jmoe/ops/attention_kernels.py
has both). Each query sees the keys at or before it, within a sliding window if one is given
(`windowed`, possibly traced, says whether it applies: GPT-OSS alternates windowed and full
layers inside one loop over layers), within its own packed document if `segment_ids` are given
(a padding token, id 0, is in none: its output is zero and takes no gradient).

Sinks (GPT-OSS): a learned logit per head added to every softmax denominator, as a key whose value
is zero. The kernel runs without it and returns its log-sum-exp L; with the sink s the
denominator's log is L' = log(exp(L) + exp(s)), so the output is the kernel's times exp(L - L').
The backward runs the kernel's backward with L' and that rescaled output, which is exact for the
queries, keys and values (attention_kernels.py says why); the sink's own gradient is
-sum over queries of exp(s - L') rowsum(dout * out). So the sink costs no extra key (a 4,097th key
is a length cuDNN's training kernels refuse) and no [S, S] bias.

Decoding attends over a cache with an explicit mask: `masked_attention`, through XLA.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp

from jmoe.errors import choice
from jmoe.ops.attention_kernels import (CUDNN, MAX_DOCUMENTS, XLA, AttentionKernel, cudnn_kernel,
                                        in_documents)

log = logging.getLogger("jmoe")
F32 = jnp.float32

ATTENTION_KERNELS: dict[str, AttentionKernel] = {"cudnn": CUDNN, "xla": XLA}


@functools.cache
def _refused(reason: str) -> None:
  log.warning("cuDNN attention refused a case (%s); it runs through XLA's attention", reason)


def auto_kernel(platform: str, dtype) -> str:
  """What `auto` means on `platform` for inputs of `dtype`."""
  return "cudnn" if platform == "gpu" and dtype in (jnp.bfloat16, jnp.float16) else "xla"


@dataclasses.dataclass(frozen=True)
class _Static:
  kernel: AttentionKernel
  scale: float
  window: int  # 0: none; else applied where `windowed` (an argument) is true


def _run(static: _Static, windowed, run):
  """`run(window)` with the window where `windowed` holds and none elsewhere."""
  if windowed is None:
    return run(static.window)
  return jax.lax.cond(windowed, lambda: run(static.window), lambda: run(0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q_BSHA, k_BTGA, v_BTGW, sinks_H, windowed, segment_ids_BS, static):
  return _forward(q_BSHA, k_BTGA, v_BTGW, sinks_H, windowed, segment_ids_BS, static)[0]


def _forward(q_BSHA, k_BTGA, v_BTGW, sinks_H, windowed, segment_ids_BS, static):
  kernel = static.kernel
  out_BSHW, lse_BHS = _run(static, windowed, lambda window: kernel.forward(
      q_BSHA, k_BTGA, v_BTGW, segment_ids_BS, scale=static.scale, window=window))
  if sinks_H is not None:
    lse_with_sink_BHS = jnp.logaddexp(lse_BHS, sinks_H.astype(F32)[None, :, None])
    kept_BSH1 = jnp.exp(lse_BHS - lse_with_sink_BHS).transpose(0, 2, 1)[..., None]
    out_BSHW = (out_BSHW.astype(F32) * kept_BSH1).astype(out_BSHW.dtype)
    lse_BHS = lse_with_sink_BHS
  out_BSHW = in_documents(segment_ids_BS, out_BSHW)  # padding tokens are in no document
  residuals = (q_BSHA, k_BTGA, v_BTGW, sinks_H, windowed, segment_ids_BS, out_BSHW, lse_BHS)
  return out_BSHW, residuals


def _backward(static, residuals, dout_BSHW):
  q_BSHA, k_BTGA, v_BTGW, sinks_H, windowed, segment_ids_BS, out_BSHW, lse_BHS = residuals
  dout_BSHW = in_documents(segment_ids_BS, dout_BSHW)
  dq, dk, dv = _run(static, windowed, lambda window: static.kernel.backward(
      q_BSHA, k_BTGA, v_BTGW, out_BSHW, lse_BHS, dout_BSHW, segment_ids_BS,
      scale=static.scale, window=window))
  dsinks_H = None
  if sinks_H is not None:
    rowsum_BSH = jnp.einsum("bshw,bshw->bsh", dout_BSHW.astype(F32), out_BSHW.astype(F32))
    sink_share_BHS = jnp.exp(sinks_H.astype(F32)[None, :, None] - lse_BHS)
    dsinks_H = -jnp.einsum("bhs,bsh->h", sink_share_BHS, rowsum_BSH).astype(sinks_H.dtype)
  return dq, dk, dv, dsinks_H, None, None


_attention.defvjp(_forward, _backward)


def attention(q_BSHA: jax.Array, k_BTGA: jax.Array, v_BTGW: jax.Array, *, scale: float,
              kernel: str = "auto", window: int = 0, windowed=True,
              segment_ids: jax.Array | None = None, sinks: jax.Array | None = None,
              max_documents: int = MAX_DOCUMENTS, batch_shards: int = 1,
              vmapped: bool = False) -> jax.Array:
  """Causal attention [B, S, H, W] of queries [B, S, H, A] over keys [B, S, G, A] and values
  [B, S, G, W] (query head h reads key head h // (H / G)). `window`: each query sees its last
  `window` keys, itself included (0: all before it), where `windowed` (a bool, or a traced one)
  holds. `segment_ids` [B, S]: within each packed document only. `sinks` [H]: each head's sink
  logit (see the module doc). `max_documents`: the most documents a packed row has for cuDNN's
  packed form (a batch with more takes XLA's kernel); `batch_shards`: the devices the batch is
  split over (cuDNN then takes packed rows one per device at a time). `vmapped`: the call runs
  under a vmap (the pipeline's stages), whose batching rule for cuDNN's attention (jax 0.11)
  takes the values' head size for the keys': narrower values are then padded with zeros to the
  keys' size for cuDNN and the output cut back (exact; the padding's products are wasted)."""
  if kernel == "auto":
    kernel = auto_kernel(jax.default_backend(), q_BSHA.dtype)
  chosen = choice("model.attention_kernel", kernel, ATTENTION_KERNELS)
  reason = chosen.refusal(q_BSHA, k_BTGA, v_BTGW, segment_ids, window)
  if reason is not None:
    _refused(reason)
    chosen = XLA
  elif chosen is CUDNN and segment_ids is not None:
    chosen = cudnn_kernel(max_documents, batch_shards)
  if not window or isinstance(windowed, bool):  # known now: no branch at run time
    window, windowed = (window if windowed else 0), None
  else:
    windowed = jnp.asarray(windowed, bool)
  static = _Static(chosen, float(scale), int(window))
  width, keys = v_BTGW.shape[-1], k_BTGA.shape[-1]
  if vmapped and chosen is not XLA and width < keys:
    v_BTGA = jnp.pad(v_BTGW, [(0, 0)] * 3 + [(0, keys - width)])
    return _attention(q_BSHA, k_BTGA, v_BTGA, sinks, windowed, segment_ids, static)[..., :width]
  return _attention(q_BSHA, k_BTGA, v_BTGW, sinks, windowed, segment_ids, static)


def masked_attention(q_BSHA: jax.Array, k_BTGA: jax.Array, v_BTGW: jax.Array,
                     allowed_B1ST: jax.Array, *, scale: float,
                     sinks: jax.Array | None = None) -> jax.Array:
  """Attention where `allowed_B1ST` says which keys each query sees (decoding over a cache), with
  the sinks as one more term in each denominator. Through XLA: a few new queries at a time."""
  b, s, h, _ = q_BSHA.shape
  g = k_BTGA.shape[2]
  q_BSGRA = q_BSHA.reshape(b, s, g, h // g, -1)
  logits = jnp.einsum("bsgra,btga->bgrst", q_BSGRA, k_BTGA, preferred_element_type=F32) * scale
  allowed = allowed_B1ST[:, :, None]  # [B, 1, 1, S, T]
  logits = jnp.where(allowed, logits, -jnp.inf)
  lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  if sinks is not None:
    lse = jnp.logaddexp(lse, sinks.astype(F32).reshape(1, g, h // g, 1, 1))
  p = jnp.where(allowed, jnp.exp(logits - lse), 0.0)
  out = jnp.einsum("bgrst,btgw->bsgrw", p.astype(v_BTGW.dtype), v_BTGW,
                   preferred_element_type=F32)
  return out.reshape(b, s, h, -1).astype(q_BSHA.dtype)
