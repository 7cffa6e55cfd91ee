"""The MoE blocks' stack set out in pipeline stages, for any schedule (jmoe/model/pipeline.py):
which layers each stage's slots hold, each stage's parameters, its program over one micro-batch,
the micro-batches' inputs, and what a schedule costs (its bubble, the micro-batches in flight).

Letters: S stages, R repeats (virtual stages per stage), M micro-batches, P a stage's layer slots
(`width`), L the stack's layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jmoe.model.block import LayerStats
from jmoe.model.stack import depth, run_stack
from jmoe.parallel import Layout, constrain, stage_balance


@dataclasses.dataclass(frozen=True)
class Schedule:
  """GPipe: every micro-batch's forward pass, then every backward pass (the loop's derivative);
  1F1B / interleaved: each iteration every stage runs one forward and one backward slot, the
  backward recomputing its stage's forward from the input kept for it."""
  stages: int
  repeats: int
  micro_batches: int
  kind: str = "gpipe"

  @property
  def slots(self) -> int:
    """R M + S - 1: the forward iterations every stage runs (R M visits and the S - 1 of the
    fill), and as many backward ones."""
    return self.repeats * self.micro_batches + self.stages - 1

  @property
  def iterations(self) -> int:
    """Forward iterations (GPipe), or iterations of the 1F1B loop, whose forward slots run in
    the first R M + S - 1 and backward slots in the last R M + S - 1."""
    return self.slots if self.kind == "gpipe" else self.slots + self.repeats * self.stages - 1

  @property
  def bubble(self) -> float:
    """The share of its forward (and of its backward) slots a stage idles: the same for every
    schedule of the same S, R and M (1F1B's loop skips the slots no stage uses)."""
    return (self.stages - 1) / self.slots

  @property
  def in_flight(self) -> int:
    """Micro-batches whose activations a stage holds at once (at most): all of them under
    GPipe (every layer's, as `train.remat` keeps them); else the stage inputs its backward
    slots will need, at most 2 R S - 1 (stage s: 2 R S - 2 s - 1), and one visit's layers."""
    visits = self.repeats * self.micro_batches
    return visits if self.kind == "gpipe" else min(visits, 2 * self.repeats * self.stages - 1)


def bubble_fraction(stages: int, repeats: int, micro_batches: int) -> float:
  return Schedule(stages, repeats, micro_batches).bubble


@dataclasses.dataclass(frozen=True)
class Slots:
  """Where the stack's layers sit in the stages' programs: group g = r S + s (stage s, repeat r)
  holds `counts[g]` consecutive layers in the first of its `width` slots."""
  counts: tuple[int, ...]
  stages: int

  @property
  def width(self) -> int:
    return max(self.counts)

  @property
  def even(self) -> bool:
    return len(set(self.counts)) == 1

  @property
  def starts(self) -> np.ndarray:
    """[R, S]: each group's first layer in the stack."""
    return np.cumsum((0,) + self.counts[:-1]).reshape(-1, self.stages)

  @property
  def active(self) -> np.ndarray:
    """[R, width, S]: whether a slot holds one of its group's layers."""
    counts_RS = np.asarray(self.counts).reshape(-1, self.stages)
    return np.arange(self.width)[None, :, None] < counts_RS[:, None, :]

  @property
  def layers(self) -> np.ndarray:
    """[R, width, S]: the stack's layer in each slot; a masked slot repeats its group's last."""
    last_RS = self.starts + np.asarray(self.counts).reshape(-1, self.stages) - 1
    return np.minimum(self.starts[:, None, :] + np.arange(self.width)[None, :, None],
                      last_RS[:, None, :])

  def describe(self) -> str:
    """The balance: MoE layers per stage, and per group (virtual stage) where R > 1."""
    return stage_balance(self.counts, self.stages)


def slots_of(layout: Layout, num_layers: int) -> Slots:
  return Slots(layout.layer_groups(num_layers), layout.stages)


class Stages:
  """`stack` in `layout`'s stages for `micro_batches` micro-batches of a batch whose positions
  and segment ids are given: `stage_state` places the stack's parameters, `run` runs every
  stage's program at once, each on its micro-batch and repeat."""

  def __init__(self, stack: nnx.Module, layout: Layout, micro_batches: int,
               positions_BS: jax.Array, segment_ids_BS: jax.Array | None, *, remat: str,
               rng: jax.Array | None, first_layer: int, unroll: int,
               axes: tuple[str | None, ...]):
    self.layout, self.axes = layout, axes
    self.S, self.R, self.M = layout.stages, layout.repeats, micro_batches
    self.graphdef, self.state = nnx.split(stack)
    num_layers = depth(stack)
    self.slots = slots = slots_of(layout, num_layers)
    self.width = slots.width
    self.layers_RPS = jnp.asarray(slots.layers)
    self.active_RPS = None if slots.even else jnp.asarray(slots.active)
    self.starts_RS = jnp.asarray(slots.starts)
    self.first_layer, self.remat, self.unroll = first_layer, remat, unroll
    self.inner = layout.inside_stages()
    self.stage_ids = jnp.arange(self.S)
    self.positions_MBS, self.segments_MBS = map(self.by_micro, (positions_BS, segment_ids_BS))
    # Each micro-batch's noise: a key per layer, as the step without stages draws them.
    self.keys_ML = (None if rng is None else
                    jax.vmap(lambda m: jax.random.split(jax.random.fold_in(rng, m), num_layers))(
                        jnp.arange(micro_batches)))
    self._at_once = jax.vmap(self._program, in_axes=(2, 0, 0, 0, 0, 0, 0, 0),
                             spmd_axis_name=layout.stage_axes)

  def by_micro(self, a):
    """[B, ...] -> [M, B / M, ...], each micro-batch split as inside a stage."""
    if a is None:
      return None
    a = self._micro_over_stages(a.reshape(self.M, a.shape[0] // self.M, *a.shape[1:]))
    with self.inner.active():
      return constrain(a, (None, *self.axes[:a.ndim - 1]))

  def from_micro(self, a_M):
    """[M, B / M, ...] -> [B, ...], `by_micro`'s inverse (placed by the caller)."""
    a_M = self._micro_over_stages(a_M)
    return a_M.reshape(a_M.shape[0] * a_M.shape[1], *a_M.shape[2:])

  def _micro_over_stages(self, a_M):
    """[M, B / M, ...] with the micro-batches split over the stages and each one's sequences as
    inside a stage, where the stages divide M: the step between the batch's split (sequences
    over the stages and their devices) and the stages' copies (each micro-batch whole on every
    stage). From the batch the devices of a stage trade sequences (an all-to-all), then the
    stages gather; asked for in one move, XLA's partitioner gathered the whole batch onto every
    device ("involuntary full rematerialization"), 896 GiB a GPU in Megatron's PP 16 plan.
    Where the stages do not divide M the cut stays one move (and XLA may gather)."""
    if self.M % self.S or self.S == 1:
      return a_M
    spec = self.inner.activation_spec((None, *self.axes[:a_M.ndim - 1]), a_M.shape)
    return jax.lax.with_sharding_constraint(a_M, NamedSharding(
        self.inner.mesh, P(self.layout.stage_axes, *spec[1:])))

  def stage_state(self, state: nnx.State) -> nnx.State:
    """The stack's [L, ...] parameters as [R, width, S, ...]: stage s, repeat r holds group
    r S + s; the stage axis after the layers', so that a stage's loop over its layers reads them
    in place. Equal groups are a reshape; uneven ones a gather (whose gradient adds the slots
    back into the stack)."""
    S, R, width, slots, layout = self.S, self.R, self.width, self.slots, self.layout

    def off_stages(entry):  # a placement without the stage axis (where it stored the stack)
      entry = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,))
                    if a is not None and a not in layout.stage_axes)
      return entry or None

    def to_stages(variable):
      a = variable[...]
      spec = self.inner.param_spec(variable.get_metadata().get("axes"), a.shape)
      if slots.even:
        a = a.reshape(R, S, width, *a.shape[1:]).swapaxes(1, 2)
      else:
        a = a[np.asarray(slots.layers).reshape(-1)].reshape(R, width, S, *a.shape[1:])
      spec = P(None, None, layout.stage_axes, *map(off_stages, spec[1:]))
      return variable.replace(
          jax.lax.with_sharding_constraint(a, NamedSharding(self.inner.mesh, spec)))

    return jax.tree.map(to_stages, state, is_leaf=lambda x: isinstance(x, nnx.Variable))

  def _program(self, layer_state_R, x_BSD, positions_BS, segments_BS, keys_P, repeat, first,
               active_P):
    # One repeat: its slice of the stage's layers (read in place); else the iteration's group.
    layer_state = jax.tree.map(lambda a: a[0] if self.R == 1 else a[repeat], layer_state_R)
    return run_stack(nnx.merge(self.graphdef, layer_state), x_BSD, positions_BS, segments_BS,
                     remat=self.remat, keys=keys_P, first_layer=first, unroll=self.unroll,
                     active=active_P)

  def slot_table(self, table_RPS, repeat_S):
    """[S, width]: each stage's row of an [R, width, S] table, for its repeat."""
    return table_RPS[repeat_S[:, None], jnp.arange(self.width)[None, :], self.stage_ids[:, None]]

  def run(self, stage_state: nnx.State, x_S: jax.Array, micro_S: jax.Array,
          repeat_S: jax.Array):
    """Every stage at once: stage s runs its group for repeat `repeat_S[s]` on `x_S[s]`, which
    is micro-batch `micro_S[s]`; returns (y_S, router stats_S per slot)."""
    take = lambda a: None if a is None else a[micro_S]
    keys_SP = (None if self.keys_ML is None else
               self.keys_ML[micro_S[:, None], self.slot_table(self.layers_RPS, repeat_S)])
    active_SP = None if self.active_RPS is None else self.slot_table(self.active_RPS, repeat_S)
    with self.inner.active():
      return self._at_once(stage_state, self.inner.on_stages(x_S), take(self.positions_MBS),
                           take(self.segments_MBS), keys_SP, repeat_S,
                           self.first_layer + self.starts_RS[repeat_S, self.stage_ids], active_SP)

  def zero_stats(self, stage_state: nnx.State, x_S: jax.Array) -> LayerStats:
    """Totals to start from, shaped as the stats of every stage for each repeat, [S, R, width,
    ...]: router stats at zero, attention's largest logits (with train.qk_clip) at -inf."""
    first_S = jnp.zeros((self.S,), jnp.int32)
    shape = jax.eval_shape(self.run, stage_state, x_S, first_S, first_S)[1]
    start = lambda fill: lambda s: self.inner.on_stages(
        jnp.full((self.S, self.R, *s.shape[1:]), fill, jnp.float32))
    return LayerStats(router=jax.tree.map(start(0.0), shape.router),
                      max_logit_H=jax.tree.map(start(-jnp.inf), shape.max_logit_H))

  def add_stats(self, stats_SR: LayerStats, stats_S: LayerStats, repeat_S, on_S) -> LayerStats:
    """Each stage's stats taken into its repeat's row where `on_S`: router stats added (for
    their means), largest logits kept."""
    row = jax.nn.one_hot(repeat_S, self.R, dtype=bool) & on_S[:, None]
    where = lambda s, fill: jnp.where(row.reshape(row.shape + (1,) * (s.ndim - 1)), s[:, None],
                                      fill)
    return LayerStats(
        router=jax.tree.map(lambda acc, s: acc + where(s, 0), stats_SR.router, stats_S.router),
        max_logit_H=jax.tree.map(lambda acc, s: jnp.maximum(acc, where(s, -jnp.inf)),
                                 stats_SR.max_logit_H, stats_S.max_logit_H))

  def stats_by_layer(self, stats_SR: LayerStats) -> LayerStats:
    """[S, R, width, ...] in layer order (each layer from its slot): router stats averaged over
    micro-batches, largest logits as they are."""
    real = np.nonzero(self.slots.active.swapaxes(1, 2))  # (repeat, stage, slot) of each layer
    in_order = lambda a: a.swapaxes(0, 1)[real]
    return LayerStats(router=jax.tree.map(lambda a: in_order(a) / self.M, stats_SR.router),
                      max_logit_H=jax.tree.map(in_order, stats_SR.max_logit_H))

  def stage_copies(self, a_M):
    """Each stage's copy of an [M, ...] array (the batch outside the stages is split over them)."""
    return self.inner.on_stages(jnp.broadcast_to(a_M, (self.S, *a_M.shape)))

  def per_micro(self, fn):
    """`fn` of one stage's [M, ...] buffer, vmapped over the stages: each updates only its own."""
    return jax.vmap(fn, spmd_axis_name=self.layout.stage_axes)
