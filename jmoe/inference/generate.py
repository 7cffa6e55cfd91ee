"""Sampling continuations of prompts: batched decoding with a cache, or without one (the
reference: the whole sequence again at every step).

Prompts of different lengths share a batch: each row's tokens sit at their own positions, the
row's new token is written after its own prompt, and what lies past it is never seen (causal
attention, jmoe/model/kv_cache.py). Both ways run the same model and sampler, so with the same
seed they give the same tokens (up to float rounding in the logits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmoe.config import ConfigError
from jmoe.parallel import Layout


def sample(logits_BV: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
  """Next tokens [B]: the most likely at temperature 0; else drawn from softmax(logits / T)
  restricted to the smallest set of most likely tokens whose probability reaches `top_p`."""
  if temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV / temperature
  if top_p < 1:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass of the more likely ones
    kept_BV = before_BV < top_p  # the most likely token is always kept
    threshold_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV >= threshold_B1, logits_BV, -jnp.inf)
  return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


@functools.lru_cache(maxsize=8)
def _steps(graphdef: nnx.GraphDef, temperature: float, top_p: float):
  """The jitted prefill, decode step and full-sequence step of one model structure."""

  def pick(logits_BSV, at_B, key):
    """The next tokens, and whether each row's logits were all finite (else the token means
    nothing: argmax and sampling both return some id)."""
    logits_BV = jnp.take_along_axis(logits_BSV, at_B[:, None, None], axis=1)[:, 0]
    return (sample(logits_BV, key, temperature, top_p),
            jnp.all(jnp.isfinite(logits_BV), axis=-1))

  @functools.partial(jax.jit, static_argnames="length")
  def prefill(state, tokens_BP, lengths_B, key, length):
    model = nnx.merge(graphdef, state)
    positions_BP = jnp.broadcast_to(jnp.arange(tokens_BP.shape[1]), tokens_BP.shape)
    logits_BPV, cache = model.decode(tokens_BP, positions_BP, model.init_cache(
        tokens_BP.shape[0], length))
    return *pick(logits_BPV, lengths_B - 1, key), cache

  @jax.jit
  def step(state, cache, tokens_B, positions_B, key):
    logits_B1V, cache = nnx.merge(graphdef, state).decode(tokens_B[:, None], positions_B[:, None],
                                                          cache)
    return *pick(logits_B1V, jnp.zeros_like(positions_B), key), cache

  @jax.jit
  def whole(state, tokens_BT, positions_B, key):
    logits_BTV, _ = nnx.merge(graphdef, state)(tokens_BT)
    return pick(logits_BTV, positions_B - 1, key)

  return prefill, step, whole


def generate(model: nnx.Module, layout: Layout, prompts: list[list[int]], *,
             max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             cache: bool = True) -> list[list[int]]:
  """`max_new_tokens` new tokens after each prompt, the rows data-parallel on `layout`."""
  if not prompts or any(not p for p in prompts):
    raise ConfigError("every prompt needs at least one token")
  if max_new_tokens < 1:
    raise ConfigError(f"max new tokens {max_new_tokens}: give at least 1")
  if temperature < 0 or not 0 < top_p <= 1:
    raise ConfigError(f"temperature {temperature} must be >= 0 and top-p {top_p} in (0, 1]")
  devices = layout.mesh.devices.size
  rows = -(-len(prompts) // devices) * devices  # padded with copies of the first prompt
  padded = prompts + [prompts[0]] * (rows - len(prompts))
  lengths_B = np.asarray([len(p) for p in padded], np.int32)
  longest, total = int(lengths_B.max()), int(lengths_B.max()) + max_new_tokens
  tokens_BT = np.zeros((rows, total), np.int32)
  for b, p in enumerate(padded):
    tokens_BT[b, :len(p)] = p
  graphdef, state = nnx.split(model)
  prefill, step, whole = _steps(graphdef, float(temperature), float(top_p))
  put = lambda a: jax.device_put(a, layout.batch)
  keys = jax.random.split(jax.random.key(seed), max_new_tokens)
  new_BN = np.zeros((rows, max_new_tokens), np.int32)
  with layout.active():
    if cache:
      token_B, finite_B, kv = prefill(state, put(tokens_BT[:, :longest]), put(lengths_B),
                                      keys[0], length=total)
    for t in range(max_new_tokens):
      positions_B = lengths_B + t  # where the row's next token goes
      if not cache:
        token_B, finite_B = whole(state, put(tokens_BT), put(positions_B), keys[t])
      elif t:
        token_B, finite_B, kv = step(state, kv, put(new_BN[:, t - 1]), put(positions_B - 1),
                                     keys[t])
      bad = np.flatnonzero(~np.asarray(finite_B)[:len(prompts)])
      if bad.size:
        raise ConfigError(f"the model's logits for new token {t + 1} of prompt {bad[0] + 1} are "
                          f"not finite (NaN or inf; {bad.size} prompt(s) so): its parameters are "
                          f"not finite, or overflow; nothing was generated")
      new_BN[:, t] = np.asarray(token_B)
      tokens_BT[np.arange(rows), positions_B] = new_BN[:, t]
  return [new_BN[b].tolist() for b in range(len(prompts))]
