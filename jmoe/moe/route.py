"""Route: from router logits to each token's k experts, their weights, and the balancing terms.

Scores (`router.score`):
  softmax       softmax over all experts; the k best are chosen
  softmax_topk  the k best logits are chosen, then softmax over those k (Mixtral's form)
  sigmoid       an independent sigmoid per expert (DeepSeek-V3)
Selection may add a per-expert bias (aux-loss-free balancing) and may be group-limited: experts
fall in `num_groups` equal groups, each scored by the sum of its two best selection scores, and a
token chooses only among the experts of its `topk_groups` best groups. The bias steers selection
only; weights come from the unbiased scores. Ties go to the lower index everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jmoe.config import RouterConfig


@struct.dataclass
class RouterStats:
  """What a layer's router reports, returned explicitly (one per MoE layer after the layer scan)."""
  aux_loss: jax.Array  # balance loss E * sum_e f_e * p_e, averaged over balance groups; 1 = balanced
  z_loss: jax.Array  # mean over tokens of logsumexp(logits)^2
  load_E: jax.Array  # fraction of the T*K routed token copies that chose each expert
  dropped_fraction: jax.Array  # of the T*K copies, the share dropped for capacity (0 if dropless)
  # exchanges the all-to-all dispatch needed after its first (0: every device's copies fit
  # moe.dispatch_factor's buffers)
  overflow_rounds: jax.Array


@struct.dataclass
class Routing:
  expert_ids_TK: jax.Array  # int32
  weights_TK: jax.Array  # float32
  stats: RouterStats


def _limit_to_groups(select_TE: jax.Array, num_groups: int, topk_groups: int) -> jax.Array:
  """Sets the selection scores of experts outside each token's best groups to -inf."""
  num_tokens, num_experts = select_TE.shape
  select_TUe = select_TE.reshape(num_tokens, num_groups, num_experts // num_groups)
  group_score_TU = jnp.sum(jax.lax.top_k(select_TUe, 2)[0], axis=-1)
  _, best_groups_Tu = jax.lax.top_k(group_score_TU, topk_groups)
  keep_TU = jnp.zeros((num_tokens, num_groups), bool).at[
      jnp.arange(num_tokens)[:, None], best_groups_Tu].set(True)
  return jnp.where(keep_TU[:, :, None], select_TUe, -jnp.inf).reshape(num_tokens, num_experts)


def balance_loss(probs_TE: jax.Array, expert_ids_TK: jax.Array, num_groups: int) -> jax.Array:
  """E * sum_e f_e * p_e in each of `num_groups` equal contiguous token groups, averaged.

  f_e: the share of the group's routed copies that chose e (no gradient); p_e: the mean score.
  One group: the whole batch (global); one per sequence: DeepSeek's sequence-wise loss.
  """
  num_tokens, num_experts = probs_TE.shape
  top_k = expert_ids_TK.shape[1]
  per_group = num_tokens // num_groups
  group_T = jnp.arange(num_tokens) // per_group
  counts_QE = jnp.zeros((num_groups, num_experts), jnp.float32).at[
      group_T[:, None], expert_ids_TK].add(1.0)
  f_QE = jax.lax.stop_gradient(counts_QE / (per_group * top_k))
  p_QE = probs_TE.reshape(num_groups, per_group, num_experts).mean(axis=1)
  return num_experts * jnp.mean(jnp.sum(f_QE * p_QE, axis=-1))


def route(logits_TE: jax.Array, cfg: RouterConfig, top_k: int, *,
          expert_bias_E: jax.Array | None = None, balance_groups: int = 1) -> Routing:
  logits_TE = logits_TE.astype(jnp.float32)
  num_tokens, num_experts = logits_TE.shape
  if cfg.score == "sigmoid":
    scores_TE = jax.nn.sigmoid(logits_TE)
    # The balance loss wants a distribution per token: the sigmoid scores normalised.
    probs_TE = scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True)
  else:
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    scores_TE = logits_TE if cfg.score == "softmax_topk" else probs_TE

  select_TE = jax.lax.stop_gradient(scores_TE)
  if expert_bias_E is not None:
    select_TE = select_TE + expert_bias_E
  if cfg.num_groups > 1:
    select_TE = _limit_to_groups(select_TE, cfg.num_groups, cfg.topk_groups)
  _, expert_ids_TK = jax.lax.top_k(select_TE, top_k)
  if cfg.force_balanced:  # (shaped like the chosen ids, so as batched under a pipeline's vmap)
    expert_ids_TK = expert_ids_TK * 0 + (
        (jnp.arange(num_tokens)[:, None] * top_k + jnp.arange(top_k)) % num_experts)
  weights_TK = jnp.take_along_axis(scores_TE, expert_ids_TK, axis=-1)
  if cfg.score == "softmax_topk":
    weights_TK = jax.nn.softmax(weights_TK, axis=-1)
  elif cfg.norm_topk_prob:
    weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + 1e-20)
  weights_TK = weights_TK * cfg.scaling_factor

  counts_E = jnp.zeros((num_experts,), jnp.float32).at[expert_ids_TK.reshape(-1)].add(1.0)
  stats = RouterStats(
      aux_loss=balance_loss(probs_TE, expert_ids_TK, balance_groups),
      z_loss=jnp.mean(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1))),
      load_E=counts_E / (num_tokens * top_k),
      dropped_fraction=jnp.zeros((), jnp.float32), overflow_rounds=jnp.zeros((), jnp.float32))
  return Routing(expert_ids_TK=expert_ids_TK.astype(jnp.int32), weights_TK=weights_TK,
                 stats=stats)
