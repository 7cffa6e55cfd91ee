"""Expert parallelism: tokens travel to the devices that hold their experts, and back.

The MoE layer runs inside `shard_map` over every mesh axis, each device holding T local tokens,
E_loc = E / EP experts and (with expert-tensor parallelism) 1/ETP of each expert's FFN width.
Two dispatchers, one signature:

  allgather  gather the tokens of the EP x ETP group, run the local experts on the rows routed to
             them, reduce-scatter the partial outputs back. Simple, dropless, moves every token.
  alltoall   (after an all-gather over ETP) send each routed row only to its expert's device with a
             fixed-size `all_to_all`, and back. Dropless: each peer's buffer holds all T*K rows of
             the sender (the worst case), so nothing is dropped whatever the routing. With a
             capacity factor the buffers shrink to what the peer's experts may take.

Both count the rows per local expert inside the shard: no host synchronisation. With `fp8_dispatch`
the token rows cross the exchange as E4M3 with one float32 scale per row (about half the bytes of
bf16); their gradients travel back in full precision.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from jmoe.config import MoEConfig
from jmoe.model.fp8 import E4M3, amax, quantize, scale_for
from jmoe.moe.capacity import apply_capacity, expert_capacity, rank_within_expert
from jmoe.moe.combine import combine, weighted_sum
from jmoe.moe.dispatch import dispatch
from jmoe.moe.experts import (ExpertGemms, blocked_expert_ffn, block_capacity, expert_ffn,
                              gated_activation, tracks_varying_axes)
from jmoe.parallel import ExpertAxes, Layout

ExpertFn = Callable[[jax.Array, jax.Array], jax.Array]  # (rows x_XD, group_sizes_E) -> y_XD


def fp8_exchange(send: Callable, back: Callable) -> Callable:
  """`send` (a collective over rows) carrying E4M3 rows and their scales; the gradient goes
  through `back`, the transpose of `send`, in the gradient's own dtype."""

  @jax.custom_vjp
  def exchange(x_RD):
    scale_R1 = scale_for(amax(x_RD, axis=1, keepdims=True), E4M3)
    moved = send(quantize(x_RD, scale_R1, E4M3)).astype(jnp.float32) * send(scale_R1)
    return moved.astype(x_RD.dtype)

  exchange.defvjp(lambda x_RD: (exchange(x_RD), None), lambda _, dy_RD: (back(dy_RD),))
  return exchange


def _all_gather(axes, fp8: bool):
  gather = lambda a: jax.lax.all_gather(a, axes, axis=0, tiled=True)
  if not fp8:
    return gather
  return fp8_exchange(gather, lambda a: jax.lax.psum_scatter(a, axes, scatter_dimension=0,
                                                             tiled=True))


def _all_to_all(axes, fp8: bool):
  exchange = lambda a: jax.lax.all_to_all(a, axes, 0, 0, tiled=True)
  return fp8_exchange(exchange, exchange) if fp8 else exchange


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
                       expert_fn: ExpertFn, max_rows_per_expert: int | None = None,
                       fp8: bool = False) -> jax.Array:
  del max_rows_per_expert  # every gathered row is computed where its expert lives
  group = axes.expert + axes.tensor
  if group:
    gather = _all_gather(group, False)
    x_TD = _all_gather(group, fp8)(x_TD)
    expert_ids_TK, weights_TK = gather(expert_ids_TK), gather(weights_TK)
  local_TK, mine_TK = _local_choice(expert_ids_TK, num_local, axes)
  y_XD, d = _run_local(x_TD, local_TK, num_local, expert_fn)
  y_TD = combine(y_XD, d, jnp.where(mine_TK, weights_TK, 0.0))
  if group:  # sums the other devices' experts (and ETP partial sums), keeps this device's tokens
    y_TD = jax.lax.psum_scatter(y_TD, group, scatter_dimension=0, tiled=True)
  return y_TD


def alltoall_dispatch(x_TD, expert_ids_TK, weights_TK, num_local: int, axes: ExpertAxes,
                      expert_fn: ExpertFn, max_rows_per_expert: int | None = None,
                      fp8: bool = False) -> jax.Array:
  if axes.tensor:  # every device of an ETP group computes the same rows on its slice of F
    x_TD, expert_ids_TK, weights_TK = map(_all_gather(axes.tensor, False),
                                          (x_TD, expert_ids_TK, weights_TK))
  num_tokens, top_k = expert_ids_TK.shape
  num_rows, peers = num_tokens * top_k, axes.num_expert_shards
  # Rows per peer in the fixed-size buffers: all of this device's rows (dropless, the worst case),
  # or what the peer's experts can take under a capacity.
  block = num_rows if max_rows_per_expert is None else min(num_rows,
                                                           num_local * max_rows_per_expert)
  ids_X = expert_ids_TK.reshape(-1)
  routed_X = ids_X < num_local * peers  # dropped copies carry the id E
  dest_X = jnp.where(routed_X, ids_X // num_local, peers)
  rank_X = rank_within_expert(dest_X, peers + 1)
  slot_X = jnp.where(routed_X & (rank_X < block), dest_X * block + rank_X, peers * block)

  send_x = jnp.zeros((peers * block, x_TD.shape[1]), x_TD.dtype).at[slot_X].set(
      jnp.repeat(x_TD, top_k, axis=0), mode="drop")
  send_e = jnp.full((peers * block,), num_local, jnp.int32).at[slot_X].set(
      ids_X % num_local, mode="drop")
  if axes.expert:
    send_x = _all_to_all(axes.expert, fp8)(send_x)
    send_e = _all_to_all(axes.expert, False)(send_e)
  y_RD, d = _run_local(send_x, send_e[:, None], num_local, expert_fn)
  y_RD = combine(y_RD, d, jnp.ones((y_RD.shape[0], 1), jnp.float32))  # un-sort; empty slots 0
  if axes.expert:
    y_RD = _all_to_all(axes.expert, False)(y_RD)
  y_TKD = y_RD.at[slot_X].get(mode="fill", fill_value=0).reshape(num_tokens, top_k, -1)
  y_TD = weighted_sum(y_TKD, weights_TK)
  if axes.tensor:
    y_TD = jax.lax.psum_scatter(y_TD, axes.tensor, scatter_dimension=0, tiled=True)
  return y_TD


DISPATCHERS = {"allgather": allgather_dispatch, "alltoall": alltoall_dispatch}


def _experts_on_shard(cfg: MoEConfig, axes: ExpertAxes, x_TD, expert_ids_TK, weights_TK,
                      experts: dict[str, jax.Array], gemms: ExpertGemms, fp8_dispatch: bool):
  """One device's part: capacity (decided on its own tokens), exchange, experts, combine."""
  num_local = experts["w_in_ED2F"].shape[0]
  num_experts = axes.num_expert_shards * num_local
  dropped, max_rows = jnp.zeros((), jnp.float32), None
  if cfg.capacity_factor:
    expert_ids_TK, weights_TK, dropped = apply_capacity(
        expert_ids_TK, weights_TK, num_experts, cfg.capacity_factor, cfg.drop_policy)
    max_rows = axes.num_tensor_shards * expert_capacity(*expert_ids_TK.shape, num_experts,
                                                        cfg.capacity_factor)
  if "b_out_ED" in experts and axes.tensor:  # the ETP partial sums add the down bias once
    first = (jax.lax.axis_index(axes.tensor) == 0).astype(experts["b_out_ED"].dtype)
    experts = dict(experts, b_out_ED=experts["b_out_ED"] * first)
  activation = gated_activation(cfg)
  if gemms.block_factor:
    # The mean rows per local expert: every token's K copies spread over all E experts, and the
    # rows of the EP x ETP group's tokens meet on the devices of their experts.
    mean_rows = (x_TD.shape[0] * expert_ids_TK.shape[1] * axes.num_expert_shards
                 * axes.num_tensor_shards / num_experts)
    capacity = block_capacity(mean_rows, gemms.block_factor)
    expert_fn = lambda x_XD, sizes_E: blocked_expert_ffn(
        x_XD, sizes_E, experts, capacity, gemms.batched, gemms.grouped, activation, axes.tokens)
  else:
    expert_fn = lambda x_XD, sizes_E: expert_ffn(x_XD, sizes_E, experts, gemms.grouped, activation)
  y_TD = DISPATCHERS[cfg.dispatcher](x_TD, expert_ids_TK, weights_TK, num_local, axes, expert_fn,
                                     max_rows, fp8_dispatch)
  return y_TD, dropped


# One device and no mesh: the same code with every exchange empty.
_NO_AXES = ExpertAxes(tokens=(), expert=(), tensor=(), num_expert_shards=1, num_tensor_shards=1)


def local_experts(cfg: MoEConfig, x_TD, expert_ids_TK, weights_TK, experts: dict[str, jax.Array],
                  gemms: ExpertGemms, fp8_dispatch: bool = False) -> tuple[jax.Array, jax.Array]:
  """Dispatch, expert FFN and combine with all tokens and experts in one place (nothing crosses
  devices, so `fp8_dispatch` changes nothing)."""
  return _experts_on_shard(cfg, _NO_AXES, x_TD, expert_ids_TK, weights_TK, experts, gemms, False)


def sharded_experts(layout: Layout, cfg: MoEConfig, x_TD: jax.Array, expert_ids_TK: jax.Array,
                    weights_TK: jax.Array, experts: dict[str, jax.Array],
                    gemms: ExpertGemms, fp8_dispatch: bool = False) -> tuple[jax.Array, jax.Array]:
  """Dispatch, expert FFN and combine for tokens split over every device of `layout`.

  Returns the output and the fraction of routed copies dropped for capacity (0 when dropless).
  """
  axes = layout.expert_axes

  def body(x_TD, expert_ids_TK, weights_TK, experts):
    y_TD, dropped = _experts_on_shard(cfg, axes, x_TD, expert_ids_TK, weights_TK, experts, gemms,
                                      fp8_dispatch)
    return y_TD, jax.lax.pmean(dropped, axes.tokens)

  tokens = P(axes.tokens)
  expert, tensor = axes.expert or None, axes.tensor or None
  specs = {"w_in_ED2F": P(expert, None, None, tensor), "w_out_EFD": P(expert, tensor, None),
           "b_in_E2F": P(expert, None, tensor), "b_out_ED": P(expert, None)}
  return jax.shard_map(
      body, mesh=layout.mesh,
      in_specs=(tokens, tokens, tokens, {k: specs[k] for k in experts}),
      out_specs=(tokens, P()), check_vma=tracks_varying_axes(gemms.grouped))(
          x_TD, expert_ids_TK, weights_TK, experts)
