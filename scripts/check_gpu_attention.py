"""scripts/check_gpu.py's attention checks: cuDNN's kernels through jmoe's attention against
plain float32 softmax attention, and the model's logits with cuDNN's kernel against XLA's.

  python scripts/check_gpu.py [--quick] [--no-attention]   (runs them; this file has no command)
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from check_gpu import named, relative_error


# name -> (batch, seq, query heads, key heads, query/key dim, value dim, window, sinks, packed,
# traced window choice, documents counted on the host). GPT-OSS's attention (64 heads of 64 over 8
# key heads, 128-token windows, sinks), at its training length and longer; latent attention's
# 192 / 128 head dims. Packed rows whose documents were counted on the host (as jmoe.train
# counts them) are traced under `documents_per_row` and take cuDNN's packed kernel with no
# branch on the device; the others branch on the device between it and the blockwise kernel.
ATTENTION_CASES = {
    "gpt_oss_window_sinks_4096": (1, 4096, 64, 8, 64, 64, 128, True, False, False, False),
    "gpt_oss_full_sinks_4096": (1, 4096, 64, 8, 64, 64, 0, True, False, False, False),
    "gpt_oss_traced_window_sinks_4096": (1, 4096, 64, 8, 64, 64, 128, True, False, True, False),
    "gpt_oss_window_sinks_packed_4096": (2, 4096, 16, 8, 64, 64, 128, True, True, False, False),
    "gpt_oss_window_sinks_packed_counted_4096": (2, 4096, 16, 8, 64, 64, 128, True, True, False,
                                                 True),
    "gpt_oss_window_sinks_8192": (1, 8192, 16, 8, 64, 64, 128, True, False, False, False),
    "causal_packed_4096": (2, 4096, 16, 4, 128, 128, 0, False, True, False, False),
    "causal_packed_counted_4096": (2, 4096, 16, 4, 128, 128, 0, False, True, False, True),
    "mla_4096": (1, 4096, 16, 16, 192, 128, 0, False, False, False, False),
    "mla_packed_4096": (1, 4096, 16, 16, 192, 128, 0, False, True, False, False),
    "mla_packed_counted_4096": (1, 4096, 16, 16, 192, 128, 0, False, True, False, True),
}
# --quick: windows, sinks and packed documents in one case (with and without the documents
# counted on the host), latent attention's value width in the other (the full run has each on
# its own, a window chosen at run time and 8192 tokens).
QUICK_ATTENTION = ("gpt_oss_window_sinks_packed_4096", "gpt_oss_window_sinks_packed_counted_4096",
                   "mla_4096")
ATTENTION_TOLERANCE = 2e-2  # bf16 inputs and outputs


def packed_rows(batch: int, seq: int, rng) -> np.ndarray:
  """Segment ids of rows packed with documents of random lengths (the last row ends in padding)."""
  rows = []
  for b in range(batch):
    lengths = rng.integers(seq // 16, seq // 3, size=16)
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[:seq]
    ids = np.pad(ids, (0, seq - len(ids)))
    if b == batch - 1:
      ids[-seq // 10:] = 0
    rows.append(ids)
  return np.stack(rows).astype(np.int32)


def attention_jobs(names) -> list[Callable[[], dict]]:
  """Each case through `attention(kernel="cudnn")` against plain_attention in float32 on the same
  bf16 inputs: the output and the gradients of the queries, keys, values and sinks (relative
  Frobenius error, on tokens in documents); `branch` says whether the program branches on the
  device (a case with its documents counted on the host fails if it does). The sinks are drawn
  large enough to hold a good share of each softmax: `sink_effect` (how far the reference moves
  without them) shows the check could see a sink mishandled."""
  sys.path.insert(0, "tests")
  from helpers import plain_attention
  from jmoe.data.pipeline import most_documents
  from jmoe.ops.attention import attention
  from jmoe.ops.attention_kernels import documents_per_row

  def check(index, name):
    b, s, h, g, a, w, window, sinks, packed, traced, counted = ATTENTION_CASES[name]
    rng = np.random.default_rng(index)
    keys = jax.random.split(jax.random.key(index), 5)
    q = jax.random.normal(keys[0], (b, s, h, a), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, g, a), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, g, w), jnp.bfloat16)
    dout = jax.random.normal(keys[3], (b, s, h, w), jnp.bfloat16)
    sinks_H = (4.0 + 1.5 * jax.random.normal(keys[4], (h,))) if sinks else None
    segments = jnp.asarray(packed_rows(b, s, rng)) if packed else None
    scale = a ** -0.5

    def ours(q, k, v, sinks_H, windowed):
      return attention(q, k, v, scale=scale, kernel="cudnn", window=window,
                       windowed=windowed, segment_ids=segments, sinks=sinks_H)

    windowed = jnp.asarray(True) if traced else True

    def run(q, k, v, sinks_H, dout):
      out_, vjp = jax.vjp(lambda *x: ours(*x, windowed), q, k, v, sinks_H)
      return (out_, *vjp(dout))

    with documents_per_row(most_documents(segments) if counted else None):
      lowered = jax.jit(run).lower(q, k, v, sinks_H, dout)
    branch = "stablehlo.case" in lowered.as_text()  # a branch on the device
    compiled = lowered.compile()
    fused = "fmha" in compiled.as_text()  # cuDNN's fused attention custom calls
    got = compiled(q, k, v, sinks_H, dout)
    f32 = lambda t: None if t is None else t.astype(jnp.float32)

    def reference(q, k, v, sk):  # padding tokens (no document) give zeros
      out_ = plain_attention(q, k, v, sk, scale=scale, window=window, segments_BS=segments)
      return out_ if segments is None else out_ * (segments > 0)[:, :, None, None]

    args = [f32(t) for t in (q, k, v, sinks_H)]

    @jax.jit
    def reference_grads(args, dout):  # compiled: op by op it took most of a case's time
      want_out, vjp = jax.vjp(reference, *args)
      return [want_out, *vjp(dout)]
    want = reference_grads(args, f32(dout))
    want_out = want[0]
    in_doc = None if segments is None else np.asarray(segments > 0)
    errors = {}
    for i, part in enumerate(("out", "dq", "dk", "dv", "dsinks")):
      if got[i] is None or want[i] is None:
        continue
      g_, w_ = np.asarray(got[i], np.float32), np.asarray(want[i], np.float32)
      if in_doc is not None and i < 4:  # padding tokens belong to no document
        g_, w_ = g_[in_doc], w_[in_doc]
      errors[part] = relative_error(g_, w_)
    result = {"check": f"attention/{name}", "cudnn_used": fused, "branch": branch, **errors}
    if sinks:
      without = jax.jit(reference)(*args[:3], None)
      result["sink_effect"] = relative_error(without, want_out)
    worst = max(errors.values())
    result["ok"] = bool(fused and worst <= ATTENTION_TOLERANCE and not (counted and branch)
                        and (not sinks or worst < result["sink_effect"] / 5))
    return result

  return [named(functools.partial(check, i, name), f"attention/{name}")
          for i, name in enumerate(names)]


def check_attention() -> list[dict]:
  """The model's logits with cuDNN attention against XLA attention, bf16, for each variant."""
  sys.path.insert(0, "tests")
  from flax import nnx
  from helpers import tiny_config
  from jmoe.model.factory import model_factory
  variants = {
      "causal": {}, "window": dict(sliding_window=16),
      "sinks_alternating": dict(attention_sinks=True, sliding_window=16, full_attention_every=2),
      "mla": dict(attention="mla", mla=dict(q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
                                            qk_rope_head_dim=16, v_head_dim=16)),
  }
  tokens = np.random.default_rng(0).integers(0, 256, (2, 128))
  segments = np.repeat(np.arange(1, 5), 32)[None].repeat(2, 0)
  positions = np.tile(np.arange(32), 4)[None].repeat(2, 0)
  out = []
  for name, model_cfg in variants.items():
    for packed in (False, True):
      logits, fused = {}, False
      for kernel in ("xla", "cudnn"):
        config = tiny_config(model=dict(model_cfg, attention_kernel=kernel, head_dim=64,
                                        num_heads=4, num_kv_heads=2, d_model=128),
                             precision=dict(params="float32", compute="bfloat16"))
        graphdef, state = nnx.split(model_factory(config)())
        forward = jax.jit(lambda state, *a: nnx.merge(graphdef, state)(*a)[0])
        args = (tokens, positions, segments) if packed else (tokens,)
        compiled = forward.lower(state, *args).compile()
        if kernel == "cudnn":
          fused = "fmha" in compiled.as_text()  # cuDNN's fused attention custom call
        logits[kernel] = compiled(state, *args)
      error = relative_error(logits["cudnn"], logits["xla"])
      out.append({"check": f"model_attention/{name}{'_packed' if packed else ''}",
                  "cudnn_used": fused, "cudnn_vs_xla": error,
                  "ok": bool(fused and error < ATTENTION_TOLERANCE)})
  return out
