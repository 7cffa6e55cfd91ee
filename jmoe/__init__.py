"""jmoe: Mixture-of-Experts language model training with JAX and Flax NNX.

Tensors are named with their shape, one letter per axis:
  B batch            S sequence          T tokens (B*S flattened)      D model width
  V vocabulary       H query heads       G key/value heads             A head dim
  F hidden (MLP)     E experts           K chosen experts per token    X routed rows (T*K)
  L layers           M micro-batches
e.g. `x_BSD`, `w_up_EDF`, `probs_TE`.
"""

__version__ = "0.1.0"

_API = ("Config", "Trainer", "estimate_memory", "load_config", "load_model", "score")


def __getattr__(name: str):
  """`jmoe.Trainer`, `jmoe.load_config`, ... (jmoe/api.py), imported when first used."""
  if name in _API:
    from jmoe import api
    return getattr(api, name)
  raise AttributeError(f"module 'jmoe' has no attribute {name!r}")
