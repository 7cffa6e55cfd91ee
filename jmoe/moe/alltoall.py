"""The all-to-all dispatcher: each routed copy goes only to its expert's device, and back.

After gathering over ETP (every device of an expert-tensor group computes the same rows on its
slice of F), a device sorts its routed copies by destination into one fixed-size block per peer
and exchanges the blocks with one `all_to_all`; the received rows are sorted by local expert for
the experts, and the results travel back the same way. Dropless: each peer's block holds all of
the sender's T*K rows (the worst case), so nothing overflows whatever the routing. With a capacity
factor the blocks shrink to what the peer's experts may take. With `fp8` the token rows travel as
float8 (jmoe/ops/exchange.py); their gradients, and the results, in full precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jmoe.moe.capacity import rank_within_expert
from jmoe.moe.combine import unsort, weighted_sum
from jmoe.moe.dispatch import Dispatcher, rows_by_local_expert
from jmoe.ops.exchange import all_gather, all_to_all, reduce_scatter
from jmoe.ops.rows import gather_copies, inverse_permutation, move_rows


@struct.dataclass
class AllToAllContext:
  order_P: jax.Array  # received row r of the sort by local expert is buffer row order_P[r]
  inverse_P: jax.Array  # buffer row p went to sorted row inverse_P[p]
  slot_X: jax.Array  # each routed copy's row in the send buffer (P: none)
  source_P: jax.Array  # the copy each send-buffer row holds (X: none)
  weights_TK: jax.Array
  dropped_fraction: jax.Array


class AllToAllDispatcher(Dispatcher):

  def dispatch(self, x_TD, expert_ids_TK, weights_TK):
    axes, num_local = self.axes, self.num_local
    expert_ids_TK, weights_TK, dropped, max_rows_per_expert = self._apply_capacity(
        expert_ids_TK, weights_TK)
    mean_rows = self._mean_rows(*expert_ids_TK.shape)
    if axes.tensor:
      x_TD, expert_ids_TK, weights_TK = map(all_gather(axes.tensor),
                                            (x_TD, expert_ids_TK, weights_TK))
    num_tokens, top_k = expert_ids_TK.shape
    num_rows, peers = num_tokens * top_k, axes.num_expert_shards
    # Rows per peer in the fixed-size buffers: all of this device's rows (dropless, the worst
    # case), or what the peer's experts can take under a capacity.
    block = num_rows if max_rows_per_expert is None else min(num_rows,
                                                             num_local * max_rows_per_expert)
    ids_X = expert_ids_TK.reshape(-1)
    routed_X = ids_X < num_local * peers  # dropped copies carry the id E
    dest_X = jnp.where(routed_X, ids_X // num_local, peers)
    rank_X = rank_within_expert(dest_X, peers + 1)
    slot_X = jnp.where(routed_X & (rank_X < block), dest_X * block + rank_X, peers * block)

    source_P = inverse_permutation(slot_X, peers * block)
    send_PD = gather_copies(x_TD, source_P, slot_X.reshape(num_tokens, top_k))
    expert_P = jnp.full((peers * block,), num_local, jnp.int32).at[slot_X].set(
        ids_X % num_local, mode="drop")
    if axes.expert:
      send_PD = all_to_all(axes.expert, self.fp8)(send_PD)
      expert_P = all_to_all(axes.expert)(expert_P)
    # Empty slots carry the id `num_local`, the group the GEMMs skip.
    rows, s = rows_by_local_expert(send_PD, expert_P[:, None], num_local, mean_rows)
    return rows, AllToAllContext(order_P=s.order_X, inverse_P=s.inverse_X, slot_X=slot_X,
                                 source_P=source_P, weights_TK=weights_TK,
                                 dropped_fraction=dropped)

  def combine(self, y_XD, context: AllToAllContext):
    axes = self.axes
    num_tokens, top_k = context.weights_TK.shape
    y_PD = unsort(y_XD, context.order_P, context.inverse_P)
    if axes.expert:
      y_PD = all_to_all(axes.expert)(y_PD)
    y_TKD = move_rows(y_PD, context.slot_X, context.source_P).reshape(num_tokens, top_k, -1)
    y_TD = weighted_sum(y_TKD, context.weights_TK)
    if axes.tensor:
      y_TD = reduce_scatter(axes.tensor)(y_TD)
    return y_TD
