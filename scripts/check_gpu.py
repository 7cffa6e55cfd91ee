"""Checks on an NVIDIA GPU what CPU tests cannot run: the tokamax grouped GEMM and cuDNN attention,
each against the portable path. Prints one JSON line per check and exits 1 if any fails.

  python scripts/check_gpu.py
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np


def relative_error(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_grouped_gemm() -> list[dict]:
  """tokamax against the exact masked einsum, forward and both gradients, with rows past the
  groups (which must come out zero) in bf16."""
  from jmoe.ops.grouped_gemm import GEMM_BACKENDS
  keys = jax.random.split(jax.random.key(0), 3)
  rows, experts, d, f = 4096, 16, 512, 384
  x = jax.random.normal(keys[0], (rows, d), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (experts, d, f), jnp.float32) * 0.05).astype(jnp.bfloat16)
  sizes = np.random.default_rng(0).multinomial(rows - 300, np.ones(experts) / experts)
  sizes[3] = 0  # an expert with no rows
  group_sizes = jnp.asarray(sizes, jnp.int32)
  out = []
  for name in ("tokamax", "ragged_dot"):  # XLA's, in the same bf16: what rounding alone gives
    def loss(x, w, gemm=GEMM_BACKENDS[name]):
      y = gemm(x, w, group_sizes)
      return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.size).reshape(y.shape))), y

    def reference(x, w):
      y = GEMM_BACKENDS["dense"](x.astype(jnp.float32), w.astype(jnp.float32), group_sizes)
      return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), y

    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
    (_, y_ref), (dx_ref, dw_ref) = jax.jit(jax.value_and_grad(reference, argnums=(0, 1),
                                                              has_aux=True))(x, w)
    tail = int(sizes.sum())
    result = {"check": f"grouped_gemm_{name}", "out": relative_error(y, y_ref),
              "dx": relative_error(dx, dx_ref), "dw": relative_error(dw, dw_ref),
              "dw_worst_expert": max(relative_error(dw[e], dw_ref[e]) for e in range(experts)
                                     if sizes[e]),
              "dw_empty_expert_zero": bool(np.all(np.asarray(dw[3]) == 0)),
              "rows_past_groups_zero": bool(np.all(np.asarray(y[tail:]) == 0)
                                            and np.all(np.asarray(dx[tail:]) == 0))}
    result["ok"] = (max(result["out"], result["dx"]) < 2e-2 and result["dw"] < 0.1
                    and result["rows_past_groups_zero"] and result["dw_empty_expert_zero"])
    out.append(result)
  return out


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
      out.append({"check": f"attention_{name}{'_packed' if packed else ''}",
                  "cudnn_used": fused, "cudnn_vs_xla": error, "ok": error < 2e-2})
  return out


def main() -> int:
  print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__}))
  results = check_grouped_gemm() + check_attention()
  for r in results:
    print(json.dumps(r))
  return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
