"""Expert parallelism: tokens travel to the devices that hold their experts, and back.

The MoE layer runs inside `shard_map` over every mesh axis, each device holding T local tokens,
E_loc = E / EP experts and (with expert-tensor parallelism) 1/ETP of each expert's FFN width.
Two dispatchers, one signature:

  allgather  gather the tokens of the EP x ETP group, run the local experts on the rows routed to
             them, reduce-scatter the partial outputs back. Simple, dropless, moves every token.
  alltoall   (after an all-gather over ETP) send each routed row only to its expert's device with a
             fixed-size `all_to_all`, and back. Dropless: each peer's buffer holds all T*K rows of
             the sender (the worst case), so nothing is dropped whatever the routing.

Both count the rows per local expert inside the shard: no host synchronisation.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from jmoe.moe.combine import combine
from jmoe.moe.dispatch import dispatch
from jmoe.moe.experts import GroupedGemm, expert_ffn
from jmoe.parallel import ExpertAxes, Layout

ExpertFn = Callable[[jax.Array, jax.Array], jax.Array]  # (rows x_XD, group_sizes_E) -> y_XD


def _local_choice(expert_ids_TK, num_local, axes: ExpertAxes):
  """Expert ids relative to this device's experts; ids on other devices become `num_local`."""
  offset = jax.lax.axis_index(axes.expert) * num_local if axes.expert else 0
  local_TK = expert_ids_TK - offset
  mine_TK = (local_TK >= 0) & (local_TK < num_local)
  return jnp.where(mine_TK, local_TK, num_local), mine_TK


def _run_local(x_XD, local_ids_XK, num_local, expert_fn):
  """Sorts rows by local expert (foreign rows last, as an extra group the GEMMs skip), computes."""
  d = dispatch(x_XD, local_ids_XK, num_local + 1)
  return expert_fn(d.x_XD, d.group_sizes_E[:num_local]), d


def allgather_dispatch(x_TD, expert_ids_TK, weights_TK, num_local: int, axes: ExpertAxes,
                       expert_fn: ExpertFn) -> jax.Array:
  group = axes.expert + axes.tensor
  if group:
    x_TD, expert_ids_TK, weights_TK = (
        jax.lax.all_gather(a, group, axis=0, tiled=True) for a in (x_TD, expert_ids_TK, weights_TK))
  local_TK, mine_TK = _local_choice(expert_ids_TK, num_local, axes)
  y_XD, d = _run_local(x_TD, local_TK, num_local, expert_fn)
  y_TD = combine(y_XD, d, jnp.where(mine_TK, weights_TK, 0.0))
  if group:  # sums the other devices' experts (and ETP partial sums), keeps this device's tokens
    y_TD = jax.lax.psum_scatter(y_TD, group, scatter_dimension=0, tiled=True)
  return y_TD


def alltoall_dispatch(x_TD, expert_ids_TK, weights_TK, num_local: int, axes: ExpertAxes,
                      expert_fn: ExpertFn) -> jax.Array:
  if axes.tensor:  # every device of an ETP group computes the same rows on its slice of F
    x_TD, expert_ids_TK, weights_TK = (
        jax.lax.all_gather(a, axes.tensor, axis=0, tiled=True)
        for a in (x_TD, expert_ids_TK, weights_TK))
  num_tokens, top_k = expert_ids_TK.shape
  num_rows, peers = num_tokens * top_k, axes.num_expert_shards
  ids_X = expert_ids_TK.reshape(-1)
  dest_X = ids_X // num_local
  # Slot of each row in the send buffer: its destination's block, then its rank among the rows
  # going there. A block holds num_rows slots, so no row is ever dropped.
  order_X = jnp.argsort(dest_X, stable=True)
  rows_per_dest = jnp.zeros((peers,), jnp.int32).at[dest_X].add(1)
  first_of_dest = jnp.cumsum(rows_per_dest) - rows_per_dest
  sorted_dest_X = dest_X[order_X]
  slot_X = jnp.zeros_like(order_X).at[order_X].set(
      sorted_dest_X * num_rows + jnp.arange(num_rows) - first_of_dest[sorted_dest_X])

  send_x = jnp.zeros((peers * num_rows, x_TD.shape[1]), x_TD.dtype).at[slot_X].set(
      jnp.repeat(x_TD, top_k, axis=0))
  send_e = jnp.full((peers * num_rows,), num_local, jnp.int32).at[slot_X].set(ids_X % num_local)
  if axes.expert:
    send_x = jax.lax.all_to_all(send_x, axes.expert, 0, 0, tiled=True)
    send_e = jax.lax.all_to_all(send_e, axes.expert, 0, 0, tiled=True)
  y_RD, d = _run_local(send_x, send_e[:, None], num_local, expert_fn)
  y_RD = combine(y_RD, d, jnp.ones((y_RD.shape[0], 1), jnp.float32))  # un-sort; empty slots 0
  if axes.expert:
    y_RD = jax.lax.all_to_all(y_RD, axes.expert, 0, 0, tiled=True)
  y_TKD = y_RD[slot_X].reshape(num_tokens, top_k, -1)
  y_TD = jnp.einsum("tkd,tk->td", y_TKD, weights_TK.astype(y_TKD.dtype),
                    preferred_element_type=jnp.float32).astype(y_TKD.dtype)
  if axes.tensor:
    y_TD = jax.lax.psum_scatter(y_TD, axes.tensor, scatter_dimension=0, tiled=True)
  return y_TD


DISPATCHERS = {"allgather": allgather_dispatch, "alltoall": alltoall_dispatch}


def sharded_experts(layout: Layout, dispatcher: str, x_TD: jax.Array, expert_ids_TK: jax.Array,
                    weights_TK: jax.Array, w_in_ED2F: jax.Array, w_out_EFD: jax.Array,
                    gemm: GroupedGemm) -> jax.Array:
  """Dispatch, expert FFN and combine for tokens split over every device of `layout`."""
  axes = layout.expert_axes
  num_local = w_in_ED2F.shape[0] // axes.num_expert_shards
  exchange = DISPATCHERS[dispatcher]

  def body(x_TD, expert_ids_TK, weights_TK, w_in_ED2F, w_out_EFD):
    expert_fn = lambda x_XD, sizes_E: expert_ffn(x_XD, sizes_E, w_in_ED2F, w_out_EFD, gemm)
    return exchange(x_TD, expert_ids_TK, weights_TK, num_local, axes, expert_fn)

  tokens = P(axes.tokens)
  expert, tensor = axes.expert or None, axes.tensor or None
  return jax.shard_map(
      body, mesh=layout.mesh,
      in_specs=(tokens, tokens, tokens, P(expert, None, None, tensor), P(expert, tensor, None)),
      out_specs=tokens)(x_TD, expert_ids_TK, weights_TK, w_in_ED2F, w_out_EFD)
