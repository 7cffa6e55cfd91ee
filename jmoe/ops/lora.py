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
  return added(w, product(a, b, a.ndim + b.ndim - 2 - w.ndim), scale)


def product(a: np.ndarray, b: np.ndarray, lead: int) -> np.ndarray:
  """a b in float32 (lead + in + out) for factors with `lead` leading axes: one matrix product
  per index of those, so that a matrix's values do not depend on how many are folded at once (a
  region of a checkpoint, a device's shard)."""
  rank = a.shape[-1]
  a3 = a.reshape(int(np.prod(a.shape[:lead])), -1, rank).astype(np.float32)
  b3 = b.reshape(a3.shape[0], rank, -1).astype(np.float32)
  return np.matmul(a3, b3).reshape(a.shape[:-1] + b.shape[lead + 1:])


def added(w: np.ndarray, delta: np.ndarray, scale: float) -> np.ndarray:
  """w + scale * delta, computed in float32, in w's dtype."""
  return (w.astype(np.float32) + np.float32(scale) * delta).astype(w.dtype)
