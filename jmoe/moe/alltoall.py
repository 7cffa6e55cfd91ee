"""The all-to-all dispatcher: each routed copy goes only to its expert's device, and back, in
buffers sized to the load.

After gathering over ETP (every device of an expert-tensor group computes the same rows on its
slice of F), a device sorts its routed copies by expert, which sorts them by destination too, and
sends each peer a block of b rows in one `all_to_all`:

  b = ceil(moe.dispatch_factor x the mean copies per peer), at most all of the device's copies.

Each block travels with how many of its rows each of the peer's experts takes (a few int32s), so
no per-row ids cross devices. A device that sends a peer more than b copies sends the rest in
further rounds of the same exchange, after the first round's experts: all devices learn, from one
`pmax`, how many rounds the most loaded pair of devices needs, so every device takes part in the
same collectives, and no copy is dropped. The rounds run in a loop (`late_rows`) whose backward
pass computes each round again instead of keeping it, so they cost nothing when routing fits the
blocks and memory stays at one round's buffers when it does not. The `overflow_rounds` metric
counts them; raise `moe.dispatch_factor` if it is often above 0 (at or above the expert-parallel
size the first round always carries everything, in the worst-case buffers, and the program
has no later rounds).

With a capacity factor the blocks are no larger than what the peer's experts may take. With `fp8`
the token rows travel as float8 (jmoe/ops/exchange.py); their gradients, and the results, in full
precision.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.ad_checkpoint import checkpoint_name

from jmoe.moe.combine import unsort, weighted_sum
from jmoe.moe.dispatch import Dispatcher, Rows, rows_by_local_expert
from jmoe.ops.exchange import all_gather, all_to_all, reduce_scatter, varying_like
from jmoe.ops.remat import zeros_with
from jmoe.ops.rows import gather_copies, inverse_permutation, move_rows, row_groups

Experts = Callable[[Rows, object], jax.Array]  # (rows, expert weights) -> y_XD


@struct.dataclass
class Routes:
  """Where this device's routed copies go: the same for every round of the exchange."""
  peer_X: jax.Array  # each copy's destination (P: dropped, it goes nowhere)
  rank_X: jax.Array  # its place among this device's copies to that peer, sorted by expert
  first_E: jax.Array  # expert e's first such place on its peer
  count_E: jax.Array  # its copies from this device
  block: int = struct.field(pytree_node=False)  # rows per peer per round
  # False when one round always carries every copy (blocks of all rows, or of all a capacity
  # lets the peer's experts take): the program then has no later rounds at all.
  may_overflow: bool = struct.field(pytree_node=False)


@struct.dataclass
class AllToAllContext:
  x_TD: jax.Array  # the tokens (gathered over ETP), for the rounds after the first
  routes: Routes
  slot_X: jax.Array  # each copy's row in the first round's send buffer (P * block: none)
  source_P: jax.Array  # the copy each send-buffer row holds (X: none)
  order_P: jax.Array  # received row r of the sort by local expert is buffer row order_P[r]
  inverse_P: jax.Array  # buffer row p went to sorted row inverse_P[p]
  weights_TK: jax.Array
  dropped_fraction: jax.Array
  overflow_rounds: jax.Array  # int32: rounds after the first, the same on every device
  late_XD: jax.Array | None = None  # the later rounds' outputs, in copy order (zeros elsewhere)


class AllToAllDispatcher(Dispatcher):

  def dispatch(self, x_TD, expert_ids_TK, weights_TK, quantize=None):
    axes = self.axes
    expert_ids_TK, weights_TK, dropped, max_rows_per_expert = self._apply_capacity(
        expert_ids_TK, weights_TK)
    mean_rows = self._mean_rows(*expert_ids_TK.shape)
    if axes.tensor:
      x_TD, expert_ids_TK, weights_TK = map(all_gather(axes.tensor),
                                            (x_TD, expert_ids_TK, weights_TK))
    # Kept with the rows they sent (remat `exchanges`): a recomputed routing that differed from
    # the forward's in a near tie would send the kept rows' gradients to the wrong copies.
    expert_ids_TK, weights_TK = (checkpoint_name(a, "moe_dispatched")
                                 for a in (expert_ids_TK, weights_TK))
    routes = self._routes(expert_ids_TK.reshape(-1), max_rows_per_expert)
    rows, (slot_X, source_P, s) = self._round(x_TD, routes, 0, mean_rows)
    return rows, AllToAllContext(
        x_TD=x_TD, routes=routes, slot_X=slot_X, source_P=source_P, order_P=s.order_X,
        inverse_P=s.inverse_X, weights_TK=weights_TK, dropped_fraction=dropped,
        overflow_rounds=self._rounds_after_first(routes))

  def overflow(self, context: AllToAllContext, experts: Experts, weights) -> AllToAllContext:
    if not context.routes.may_overflow:
      return context
    mean_rows = self._mean_rows(*context.weights_TK.shape) / self.axes.num_tensor_shards
    late = late_rows(lambda x_TD, w, routes, r: self._late_round(x_TD, w, routes, r, experts,
                                                                 mean_rows),
                     context.x_TD, weights, context.routes, context.overflow_rounds)
    return context.replace(late_XD=late)

  def combine(self, y_XD, context: AllToAllContext):
    axes = self.axes
    num_tokens, top_k = context.weights_TK.shape
    y_XD = self._back(y_XD, context.order_P, context.inverse_P, context.slot_X, context.source_P)
    if context.late_XD is not None:
      y_XD = y_XD + context.late_XD
    y_TD = weighted_sum(y_XD.reshape(num_tokens, top_k, -1), context.weights_TK)
    if axes.tensor:
      y_TD = reduce_scatter(axes.tensor)(y_TD)
    return y_TD

  # ---- the rounds

  def _routes(self, ids_X: jax.Array, max_rows_per_expert: int | None) -> Routes:
    """Sorted by expert, each peer's copies are a contiguous run: a copy's rank in it decides
    its round (rank // block) and its row in that round's block."""
    num_local, peers = self.num_local, self.axes.num_expert_shards
    num_rows = ids_X.shape[0]
    block = min(num_rows, math.ceil(self.dispatch_factor * num_rows / peers))
    most = num_rows  # that one peer may be sent
    if max_rows_per_expert is not None:  # a capacity bounds what a peer's experts take
      most = min(most, num_local * max_rows_per_expert)
      block = min(block, most)
    count_E1 = jnp.zeros((self.num_experts + 1,), jnp.int32).at[ids_X].add(1)  # E: dropped
    start_E1 = jnp.cumsum(count_E1) - count_E1
    peer_start_P1 = jnp.append(start_E1[:-1:num_local], start_E1[-1])
    order_X = jnp.argsort(ids_X, stable=True)
    position_X = inverse_permutation(order_X.astype(jnp.int32))
    peer_X = ids_X // num_local  # dropped copies (id E) get P
    peer_E = jnp.arange(self.num_experts) // num_local
    return Routes(peer_X=peer_X, rank_X=position_X - peer_start_P1[peer_X],
                  first_E=start_E1[:-1] - peer_start_P1[peer_E], count_E=count_E1[:-1],
                  block=block, may_overflow=block < most)

  def _rounds_after_first(self, routes: Routes) -> jax.Array:
    """Rounds past the first that the most loaded (device, peer) pair needs, agreed by all."""
    if not routes.may_overflow:
      return jnp.zeros((), jnp.int32)
    per_peer_P = jnp.sum(routes.count_E.reshape(-1, self.num_local), axis=1)
    rounds = jnp.max(-(-per_peer_P // routes.block)) - 1
    return jax.lax.pmax(jnp.maximum(rounds, 0), self.axes.tokens)

  def _round(self, x_TD, routes: Routes, r, mean_rows: float):
    """Round r's exchange: the rows each local expert receives, and how to send results back."""
    peers, block = self.axes.num_expert_shards, routes.block
    num_tokens = x_TD.shape[0]
    first = r * block
    in_round_X = (routes.peer_X < peers) & (routes.rank_X >= first) & (
        routes.rank_X < first + block)
    slot_X = jnp.where(in_round_X, routes.peer_X * block + routes.rank_X - first, peers * block)
    source_P = inverse_permutation(slot_X, peers * block)
    send_PD = gather_copies(x_TD, source_P, slot_X.reshape(num_tokens, -1))
    # How many of each block's rows go to each of the peer's experts (in expert order).
    taken_E = jnp.clip(jnp.minimum(routes.first_E + routes.count_E, first + block)
                       - jnp.maximum(routes.first_E, first), 0)
    # (named so that a remat policy may keep what crossed rather than exchange it again)
    received_PD = checkpoint_name(all_to_all(self.axes.expert, self.fp8)(send_PD),
                                  "moe_dispatched")
    taken_PL = checkpoint_name(all_to_all(self.axes.expert)(
        taken_E.reshape(peers, self.num_local)), "moe_dispatched")
    # Empty rows get the id `num_local`, the group the GEMMs skip.
    local_P = jax.vmap(row_groups, in_axes=(0, None))(taken_PL, block).reshape(-1)
    rows, s = rows_by_local_expert(received_PD, local_P[:, None], self.num_local, mean_rows)
    return rows, (slot_X, source_P, s)

  def _back(self, y_XD, order_P, inverse_P, slot_X, source_P):
    """A round's expert outputs back to this device, in copy order (zeros for copies of other
    rounds)."""
    y_PD = checkpoint_name(all_to_all(self.axes.expert)(unsort(y_XD, order_P, inverse_P)),
                           "moe_returned")
    return move_rows(y_PD, slot_X, source_P)

  def _late_round(self, x_TD, weights, routes: Routes, r, experts: Experts, mean_rows: float):
    rows, (slot_X, source_P, s) = self._round(x_TD, routes, r, mean_rows)
    return self._back(experts(rows, weights), s.order_X, s.inverse_X, slot_X, source_P)


def late_rows(one_round: Callable, x_TD: jax.Array, weights, constant, rounds: jax.Array
              ) -> jax.Array:
  """sum over r in 1..rounds of one_round(x_TD, weights, constant, r) (each [X, D], its round's
  copies), in a loop; differentiable in x_TD and the (float) weights, not in `constant` (integer
  arrays). Every array one_round uses comes in through the arguments; weights shared by several
  devices come varying over x_TD's axes (`varying_like`), or their gradients would be summed
  over the devices in every round. The backward pass runs the
  rounds again, one at a time, so no round's buffers are kept: nothing at all when `rounds` is 0."""

  def forward(x_TD, weights, constant, rounds):
    shape = jax.eval_shape(one_round, x_TD, weights, constant, 1)
    zeros = varying_like(jnp.zeros_like(x_TD, shape=shape.shape, dtype=shape.dtype), shape)
    return jax.lax.fori_loop(1, rounds + 1,
                             lambda r, y: y + one_round(x_TD, weights, constant, r), zeros)

  @jax.custom_vjp
  def run(x_TD, weights, constant, rounds):
    return forward(x_TD, weights, constant, rounds)

  def run_fwd(x_TD, weights, constant, rounds):
    return forward(x_TD, weights, constant, rounds), (x_TD, weights, constant, rounds)

  def run_bwd(residuals, dy):
    x_TD, weights, constant, rounds = residuals
    # The float32 sums start from zeros made once dy exists: as constants, XLA made every
    # layer's zeros in one kernel early in the backward pass and held them all until each
    # layer's rounds ran (9 GiB of the Qwen3-30B-A3B EP-2 bench's 48, compiled for H200s).
    as_f32 = lambda tree: jax.tree.map(
        lambda a: varying_like(zeros_with(a.shape, jnp.float32, dy), a), tree)

    def one(r, grads):
      pull = jax.vjp(lambda x, w: one_round(x, w, constant, r), x_TD, weights)[1]
      return jax.tree.map(lambda g, d: g + d.astype(jnp.float32), grads, pull(dy))

    dx, dw = jax.lax.fori_loop(1, rounds + 1, one, as_f32((x_TD, weights)))
    cast = lambda tree, like: jax.tree.map(lambda g, a: g.astype(a.dtype), tree, like)
    # Cast here, so that the float32 sums end here (left to XLA, casts fused into later
    # kernels kept some of them: 0.4 GiB more on that bench).
    dx, dw = jax.lax.optimization_barrier((cast(dx, x_TD), cast(dw, weights)))
    return dx, dw, jax.tree.map(lambda _: None, constant), None

  run.defvjp(run_fwd, run_bwd)
  return run(x_TD, weights, constant, rounds)

