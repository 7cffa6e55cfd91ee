"""Folding low-rank adapters into their weights: W + scale * A B.

Adapters (jmoe/model/lora.py for dense weights, jmoe/moe/layer.py for the experts) sit in a
module's `lora` dict, keyed by the name of the weight beside it, each with factors `a` and `b`;
`merged` reads that pairing from a model's variables.
"""

from __future__ import annotations

import numpy as np


def merged(pure: dict, scale: float) -> dict:
  """A model's variables (nnx.to_pure_dict) with every adapter folded into its weight,
  W + scale * A B, and the adapters gone: the model as it computes, without LoRA."""
  out = {}
  for key, value in pure.items():
    if key == "lora":
      continue
    out[key] = merged(value, scale) if isinstance(value, dict) else value
  for name, factors in pure.get("lora", {}).items():
    out[name] = fold(np.asarray(out[name]), np.asarray(factors["a"]), np.asarray(factors["b"]),
                     scale)
  return out


def fold(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
  """w + scale * a b, the factors' leading axes (stacked layers, experts) kept apart:
  a is lead + in + [r], b is lead + [r] + out, w is lead + in + out."""
  lead = a.ndim + b.ndim - 2 - w.ndim
  rank = a.shape[-1]
  lead_shape = w.shape[:lead]
  a3 = a.reshape(int(np.prod(lead_shape)), -1, rank).astype(np.float32)
  b3 = b.reshape(a3.shape[0], rank, -1).astype(np.float32)
  delta = np.matmul(a3, b3).reshape(w.shape)
  return (w.astype(np.float32) + scale * delta).astype(w.dtype)
