"""Parameters with the metadata the rest of jmoe reads: logical axes (placement) and a kind.

The kind says what a parameter does, so that nothing downstream guesses it from a name:
  gemm    multiplies activations (projections, experts, the router, the LM head): weight decay;
          counted in model FLOPs (an expert weight, one with an `expert` axis, per chosen expert)
  lookup  an embedding table read by index: weight decay; no FLOPs (unless tied to the head)
  scale   a norm's scale: no weight decay
  bias    added to activations or logits (biases, attention sinks): no weight decay
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# The dtypes `precision.params` and `precision.compute` may name.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PARAM_KINDS = ("gemm", "lookup", "scale", "bias")
DECAYED_KINDS = ("gemm", "lookup")


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], *,
          std: float | None, dtype, kind: str = "gemm") -> nnx.Param:
  """A parameter with its logical axis names (`axes`, for the sharding rules in jmoe/parallel/)
  and its `kind` (above). std=None initialises to ones (norm scales), std=0 to zeros (biases)."""
  assert len(shape) == len(axes), (shape, axes)
  assert kind in PARAM_KINDS, kind
  if std is None:
    value = jnp.ones(shape, dtype)
  elif std == 0:
    value = jnp.zeros(shape, dtype)
  else:
    value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
    value = value.astype(dtype)
  return nnx.Param(value, axes=axes, kind=kind)


def kind_of(variable: nnx.Variable) -> str:
  return variable.get_metadata()["kind"]


def is_expert_weight(variable: nnx.Variable) -> bool:
  """Whether a parameter holds one slice per expert (its logical axes name `expert`)."""
  return "expert" in (variable.get_metadata().get("axes") or ())
