"""Dispatch: the interface every dispatcher implements, the sort by expert, and the no-mesh case.

The MoE layer runs dispatch -> experts -> combine on each device's share of the tokens, inside
`jax.shard_map` over every mesh axis when a layout is active (`on_expert_shards`). There a
dispatcher

  dispatch(x_TD, expert_ids_TK, weights_TK) -> (Rows, context)
      applies the capacity (if any) to this device's own routed copies, moves each copy to the
      device of its expert, and hands the experts their rows sorted by local expert;
  overflow(context, experts, weights) -> context
      runs the experts on the copies the first exchange could not carry (only the all-to-all
      dispatcher has any: its buffers follow the load, and the rest travels in later rounds);
  combine(y_XD, context) -> y_TD
      moves the experts' outputs back to their tokens and sums each token's k outputs with their
      routing weights.

Dispatchers: `LocalDispatcher` (no mesh: every expert here), `AllGatherDispatcher`
(jmoe/moe/allgather.py) and `AllToAllDispatcher` (jmoe/moe/alltoall.py); `moe.dispatcher` names
one of the last two (`DISPATCHERS` in jmoe/moe/layer.py). All count the rows per local expert on
the device: nothing waits on the host.
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from jmoe.moe.capacity import apply_capacity, expert_capacity
from jmoe.moe.combine import combine
from jmoe.ops.rows import gather_copies, inverse_permutation
from jmoe.parallel import ExpertAxes, Layout


@struct.dataclass
class Rows:
  """What dispatch hands the experts: this device's routed rows, sorted by local expert."""
  x_XD: jax.Array  # rows past sum(group_sizes_E) belong to no expert
  group_sizes_E: jax.Array  # int32 rows per local expert
  # Rows per local expert when routing is balanced: every token's k copies spread over all E
  # experts, and the rows of the EP x ETP group's tokens meet on the devices of their experts.
  mean_rows_per_expert: float = struct.field(pytree_node=False)
  # In FP8: x_XD's rows as the experts' first GEMM quantizes them (`GroupedGemm.quantize_rows`),
  # quantized once per token before the copies were gathered; None: the GEMM quantizes x_XD.
  quantized: Any = None


@struct.dataclass
class Sorted:
  x_XD: jax.Array  # token copies, grouped by expert in expert order
  group_sizes_E: jax.Array  # int32 rows per expert; sums to X
  order_X: jax.Array  # sorted row r holds the flat copy order_X[r] (= token * K + choice)
  inverse_X: jax.Array  # copy j sits in sorted row inverse_X[j]


def rows_by_local_expert(x_TD: jax.Array, local_ids_TK: jax.Array, num_local: int,
                         mean_rows_per_expert: float, quantize=None) -> tuple[Rows, Sorted]:
  """The experts' rows: copies sorted by local expert, those of no local expert (id `num_local`)
  last, as a group the GEMMs skip. `quantize` (x_TD -> float8 rows and their scales, row by
  row): the tokens quantized once and their copies gathered in float8 beside x_XD (which the
  GEMM then does not read: XLA drops its gather from the forward pass)."""
  s = sort_by_expert(x_TD, local_ids_TK, num_local + 1)
  quantized = None
  if quantize is not None:
    token_X = s.order_X // local_ids_TK.shape[1]
    quantized = jax.tree.map(lambda a: jnp.take(a, token_X, axis=0),
                             quantize(jax.lax.stop_gradient(x_TD)))
  return Rows(x_XD=s.x_XD, group_sizes_E=s.group_sizes_E[:num_local],
              mean_rows_per_expert=mean_rows_per_expert, quantized=quantized), s


def sort_by_expert(x_TD: jax.Array, expert_ids_TK: jax.Array, num_experts: int) -> Sorted:
  """Each token's k copies sorted by expert (stable: in token order within an expert). The rows
  are gathered, and so are their gradients (jmoe/ops/rows.py)."""
  num_tokens, top_k = expert_ids_TK.shape
  flat_ids_X = expert_ids_TK.reshape(-1)
  order_X = jnp.argsort(flat_ids_X, stable=True).astype(jnp.int32)
  inverse_X = inverse_permutation(order_X)
  x_XD = gather_copies(x_TD, order_X, inverse_X.reshape(num_tokens, top_k))
  group_sizes_E = jnp.zeros((num_experts,), jnp.int32).at[flat_ids_X].add(1)
  return Sorted(x_XD=x_XD, group_sizes_E=group_sizes_E, order_X=order_X, inverse_X=inverse_X)


class Dispatcher(abc.ABC):
  """Moves routed token copies between this device and the devices of their experts.

  `axes`: the expert layout's mesh axes; `num_local`: the experts on this device;
  `capacity_factor` (None or 0: dropless), `drop_policy` and `dispatch_factor` as in `MoEConfig`;
  `fp8`: token rows cross devices as float8 with row scales.
  """

  def __init__(self, axes: ExpertAxes, num_local: int, capacity_factor: float | None = None,
               drop_policy: str = "probability", fp8: bool = False,
               dispatch_factor: float = 1.25):
    self.axes, self.num_local = axes, num_local
    self.num_experts = axes.num_expert_shards * num_local
    self.capacity_factor, self.drop_policy, self.fp8 = capacity_factor, drop_policy, fp8
    self.dispatch_factor = dispatch_factor

  @abc.abstractmethod
  def dispatch(self, x_TD: jax.Array, expert_ids_TK: jax.Array, weights_TK: jax.Array,
               quantize=None) -> tuple[Rows, Any]:
    """This device's routed copies -> the rows of its local experts, and what combine needs
    (a pytree with the copies' `dropped_fraction` and the `overflow_rounds` the exchange
    needed). `quantize`: how the experts' first GEMM quantizes its rows, for a dispatcher that
    can quantize the tokens before it copies them (`Rows.quantized`); others ignore it."""

  def overflow(self, context: Any, experts: Callable[[Rows, Any], jax.Array], weights) -> Any:
    """The context with the experts' outputs for the copies `dispatch`'s rows left out, computed
    by `experts(rows, weights)`; unchanged when the rows hold every copy, as here."""
    return context

  @abc.abstractmethod
  def combine(self, y_XD: jax.Array, context: Any) -> jax.Array:
    """The experts' outputs for `dispatch`'s rows -> y_TD for this device's tokens."""

  def _apply_capacity(self, expert_ids_TK, weights_TK):
    """(ids, weights, dropped fraction, rows an expert may take from each device of the ETP group
    or None): over-capacity copies get id E and weight 0, decided on this device's tokens."""
    if not self.capacity_factor:
      return expert_ids_TK, weights_TK, jnp.zeros((), jnp.float32), None
    expert_ids_TK, weights_TK, dropped = apply_capacity(
        expert_ids_TK, weights_TK, self.num_experts, self.capacity_factor, self.drop_policy)
    max_rows = self.axes.num_tensor_shards * expert_capacity(
        *expert_ids_TK.shape, self.num_experts, self.capacity_factor)
    return expert_ids_TK, weights_TK, dropped, max_rows

  def _mean_rows(self, num_tokens: int, top_k: int) -> float:
    return (num_tokens * top_k * self.axes.num_expert_shards * self.axes.num_tensor_shards
            / self.num_experts)


@struct.dataclass
class SortedContext:
  order_X: jax.Array  # as in `Sorted`
  inverse_X: jax.Array
  weights_TK: jax.Array  # the routing weights, zero for the copies computed elsewhere
  dropped_fraction: jax.Array
  overflow_rounds: jax.Array  # int32 0: one exchange carries every copy


def local_choice(expert_ids_TK: jax.Array, num_local: int, axes: ExpertAxes):
  """Expert ids relative to this device's experts (ids on other devices become `num_local`), and
  whether each copy's expert is here."""
  offset = jax.lax.axis_index(axes.expert) * num_local if axes.expert else 0
  local_TK = expert_ids_TK - offset
  mine_TK = (local_TK >= 0) & (local_TK < num_local)
  return jnp.where(mine_TK, local_TK, num_local), mine_TK


class LocalDispatcher(Dispatcher):
  """No exchange: the tokens and the experts they chose are on this device. Rows sort by expert
  (copies of no expert here, dropped ones, last: a group the GEMMs skip) and sort back."""

  def dispatch(self, x_TD, expert_ids_TK, weights_TK, quantize=None):
    expert_ids_TK, weights_TK, dropped, _ = self._apply_capacity(expert_ids_TK, weights_TK)
    mean_rows = self._mean_rows(*expert_ids_TK.shape)
    x_TD, expert_ids_TK, weights_TK = self._gather(x_TD, expert_ids_TK, weights_TK)
    local_TK, mine_TK = local_choice(expert_ids_TK, self.num_local, self.axes)
    rows, s = rows_by_local_expert(x_TD, local_TK, self.num_local, mean_rows, quantize)
    return rows, SortedContext(order_X=s.order_X, inverse_X=s.inverse_X,
                               weights_TK=jnp.where(mine_TK, weights_TK, 0.0),
                               dropped_fraction=dropped, overflow_rounds=jnp.zeros((), jnp.int32))

  def combine(self, y_XD, context: SortedContext):
    return self._reduce(combine(y_XD, context.order_X, context.inverse_X, context.weights_TK))

  def _gather(self, x_TD, expert_ids_TK, weights_TK):
    return x_TD, expert_ids_TK, weights_TK

  def _reduce(self, y_TD):
    return y_TD


# One device and no mesh: every exchange is empty.
LOCAL_AXES = ExpertAxes(tokens=(), expert=(), tensor=(), num_expert_shards=1, num_tensor_shards=1)

Stages = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def on_expert_shards(layout: Layout | None, stages: Stages, x_TD, expert_ids_TK, weights_TK,
                     experts, *, check_vma: bool = True
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`stages(axes, x_TD, expert_ids_TK, weights_TK, experts) -> (y_TD, dropped_fraction,
  overflow_rounds)` on each device's share of the tokens and experts: inside `jax.shard_map` over
  `layout`'s mesh (tokens split over every device, experts as the expert layout says), or
  directly without a layout. `experts` is an `ExpertWeights`; `check_vma=False` for GEMMs whose
  gradients drop shard_map's varying-axes types. Returns y_TD, the dropped fraction averaged over
  the devices, and the overflow rounds (the same on every device)."""
  if layout is None:
    return stages(LOCAL_AXES, x_TD, expert_ids_TK, weights_TK, experts)
  axes = layout.expert_axes

  def body(x_TD, expert_ids_TK, weights_TK, experts):
    y_TD, dropped, rounds = stages(axes, x_TD, expert_ids_TK, weights_TK, experts)
    return y_TD, jax.lax.pmean(dropped, axes.tokens), rounds

  tokens = P(axes.tokens)
  return jax.shard_map(
      body, mesh=layout.mesh, in_specs=(tokens, tokens, tokens, experts.specs(axes)),
      out_specs=(tokens, P(), P()), check_vma=check_vma)(x_TD, expert_ids_TK, weights_TK, experts)
