"""Parameters with the metadata the rest of jmoe reads: logical axes (placement) and a kind.

The kind says what a parameter does, so that nothing downstream guesses it from a name:
  gemm    multiplies activations (projections, experts, the router, the LM head): weight decay;
          counted in model FLOPs (an expert weight, one with an `expert` axis, per chosen expert)
  lookup  an embedding table read by index: weight decay; no FLOPs (unless tied to the head)
  scale   a norm's scale: no weight decay
  bias    added to activations or logits (biases, attention sinks): no weight decay

A hidden layer's weight also says how it is a matrix, for Muon (jmoe/train/muon.py): `matrix`, a
role letter per axis of its own shape: `i` the input side (contracted with the activations), `o`
the output side, `b` an index over separate matrices (experts, fused gate/up). Axes a stack of
layers adds in front are `b` too: the letters are read from the last axis back. Parameters
without it (embeddings, the LM head, the router, norms, biases, LoRA factors) are not matrices
to Muon.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# The dtypes `precision.params` and `precision.compute` may name.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PARAM_KINDS = ("gemm", "lookup", "scale", "bias")
DECAYED_KINDS = ("gemm", "lookup")


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], *,
          std: float | None, dtype, kind: str = "gemm", matrix: str | None = None) -> nnx.Param:
  """A parameter with its logical axis names (`axes`, for the sharding rules in jmoe/parallel/),
  its `kind` and, for a hidden layer's weight, its `matrix` roles (above). std=None initialises
  to ones (norm scales), std=0 to zeros (biases)."""
  assert len(shape) == len(axes), (shape, axes)
  assert kind in PARAM_KINDS, kind
  assert matrix is None or (len(matrix) == len(shape) and set(matrix) <= set("bio")
                            and "i" in matrix and "o" in matrix), (matrix, shape)
  if std is None:
    value = jnp.ones(shape, dtype)
  elif std == 0:
    value = jnp.zeros(shape, dtype)
  else:
    value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
    value = value.astype(dtype)
  if matrix is None:
    return nnx.Param(value, axes=axes, kind=kind)
  return nnx.Param(value, axes=axes, kind=kind, matrix=matrix)


def kind_of(variable: nnx.Variable) -> str:
  return variable.get_metadata()["kind"]


def matrix_roles(variable: nnx.Variable) -> str | None:
  """A role letter (`b`, `i`, `o`) per axis of the variable as it is (a stack's leading axes
  `b`), or None where it is no matrix to Muon."""
  roles = variable.get_metadata().get("matrix")
  return None if roles is None else "b" * (variable.ndim - len(roles)) + roles


# The logical axis a stack of layers' variables lead with (jmoe/model/stack.py; `stage_layers`
# for the stack pipeline stages split).
LAYER_AXES = ("layers", "stage_layers")


def is_stacked(variable: nnx.Variable) -> bool:
  """Whether a variable holds one slice per layer of a stack (its leading logical axis)."""
  axes = variable.get_metadata().get("axes") or ()
  return bool(axes) and axes[0] in LAYER_AXES


def is_expert_weight(variable: nnx.Variable) -> bool:
  """Whether a parameter holds one slice per expert (its logical axes name `expert`)."""
  return "expert" in (variable.get_metadata().get("axes") or ())


class LoRAParam(nnx.Param):
  """A low-rank adapter factor (jmoe/model/lora.py). A parameter like any other, except that with
  `lora.rank > 0` these are the only ones that train."""


# The parameters under the adapters: with LoRA, the frozen model.
FROZEN_PARAMS = nnx.All(nnx.Param, nnx.Not(LoRAParam))


def lora_factors(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], n_in: int,
                 rank: int, dtype, lead: int = 0) -> tuple[LoRAParam, LoRAParam]:
  """(A, B) for a weight of `shape` and `axes` whose first `lead` axes (experts) index separate
  weights, the next `n_in` are contracted with the input and the rest are the output: A is
  lead + in + [rank], drawn with std 1/sqrt(fan-in); B is lead + [rank] + out, zeros, so that
  adapters start as no change."""
  lead_shape, in_shape = shape[:lead], shape[lead:lead + n_in]
  out_shape = shape[lead + n_in:]
  fan_in = int(np.prod(in_shape))
  a = jax.random.truncated_normal(rngs.params(), -2.0, 2.0, lead_shape + in_shape + (rank,),
                                  jnp.float32) / np.sqrt(fan_in)
  a_axes = axes[:lead + n_in] + (None,)
  b_axes = axes[:lead] + (None,) + axes[lead + n_in:]
  return (LoRAParam(a.astype(dtype), axes=a_axes, kind="gemm"),
          LoRAParam(jnp.zeros(lead_shape + (rank,) + out_shape, dtype), axes=b_axes, kind="gemm"))
