"""Each attention head's largest scaled logit, scale q.k, over the query/key pairs attention sees:
what QK-clip (train.qk_clip) reads after each step, and what it logs.

cuDNN's fused kernels return the softmax's log-sum-exp, not its maximum (the log-sum-exp only
bounds it: max <= lse <= max + log(keys seen)), so the maximum is taken here for every kernel the
same way: Q K^T a block of `block` queries at a time (scores [B, H, block, T], never [S, T]),
under the same pattern of visible keys as the kernels' (causal, the window where it applies,
within each packed document; padding queries, segment id 0, see nothing), in float32. Its cost is
one more Q K^T in the forward pass, no backward (its inputs' gradient is stopped): about a seventh
of attention's FLOPs in a training step (forward Q K^T and P V, backward five products of the
same size). The sinks are no product of W_q and W_k and are left out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmoe.ops.attention_kernels import _heads_major, _logits, visible

BLOCK = 256  # queries per block


def max_logit(q_BSHA: jax.Array, k_BTGA: jax.Array, *, scale: float, window: int = 0,
              windowed=True, segment_ids: jax.Array | None = None,
              block: int = BLOCK) -> jax.Array:
  """[H]: the largest scale q.k of each query head over the batch (-inf where a head sees no key);
  arguments as jmoe/ops/attention.py's `attention` takes them."""
  q_BSHA, k_BTGA = jax.lax.stop_gradient(q_BSHA), jax.lax.stop_gradient(k_BTGA)
  b, s, h, a = q_BSHA.shape
  g = k_BTGA.shape[2]
  k_BGTA = k_BTGA.transpose(0, 2, 1, 3)
  block = s if s % block else block

  def one(start, q_BCHA):  # [H]: the heads' maxima over the queries from `start` on
    allowed = visible(s, 0, segment_ids, start, block)
    if window:  # the window applies where `windowed` holds (possibly traced)
      allowed &= jnp.logical_not(windowed) | visible(s, window, None, start, block)
    if segment_ids is not None:  # padding queries attend to nothing
      queries_BC = jax.lax.dynamic_slice_in_dim(segment_ids, start, block, axis=1)
      allowed &= (queries_BC > 0)[:, None, None, :, None]
    logits_BGRCT = jnp.where(allowed, _logits(_heads_major(q_BCHA, g), k_BGTA, scale), -jnp.inf)
    return jnp.max(logits_BGRCT, axis=(0, 3, 4)).reshape(h)

  if block == s:
    return one(0, q_BSHA)
  q_NBCHA = q_BSHA.reshape(b, s // block, block, h, a).swapaxes(0, 1)
  starts = jnp.arange(s // block) * block
  return jnp.max(jax.lax.map(lambda x: one(*x), (starts, q_NBCHA)), axis=0)
