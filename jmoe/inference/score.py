"""Per-token log-probabilities of token sequences under a model, data-parallel on a layout."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmoe.parallel import Layout


@functools.lru_cache(maxsize=8)
def _logprobs_fn(graphdef: nnx.GraphDef):
  """The jitted scorer of one model structure, kept so that scoring again does not recompile."""

  @jax.jit
  def logprobs(state, tokens_BS):
    logits_BSV, _ = nnx.merge(graphdef, state)(tokens_BS)
    logp_BSV = jax.nn.log_softmax(logits_BSV, axis=-1)
    return jnp.take_along_axis(logp_BSV[:, :-1], tokens_BS[:, 1:, None], axis=-1)[..., 0]

  return logprobs


def score(model: nnx.Module, layout: Layout, sequences: list[list[int]]) -> list[list[float]]:
  """log p(next token) for every position but the last of each sequence."""
  devices = layout.mesh.devices.size
  batch = -(-len(sequences) // devices) * devices
  length = max(len(s) for s in sequences)
  tokens = np.zeros((batch, length), np.int32)  # padding sits after each sequence: causal, unseen
  for i, s in enumerate(sequences):
    tokens[i, :len(s)] = s
  graphdef, state = nnx.split(model)
  logprobs = _logprobs_fn(graphdef)
  with layout.active():
    out = np.asarray(logprobs(state, jax.device_put(tokens, layout.batch)))
  return [out[i, :len(s) - 1].tolist() for i, s in enumerate(sequences)]
