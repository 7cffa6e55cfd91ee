"""Pipeline parallelism: the MoE blocks' stack in stages over the mesh's outermost axis, the
micro-batches flowing through them inside the one jitted step.

With S stages (`parallel.pipeline`) and R repeats (`parallel.pipeline_repeats`) the L layers are
cut into S x R contiguous groups (virtual stages), as `parallel.pipeline_layers` or
`pipeline_first` / `pipeline_last` say, else as even as possible; group g runs on stage g mod S, so
a micro-batch passes through the stages R times (circular, or interleaved, stages: a smaller
bubble for the same S). Each iteration of the schedule, every stage runs its group on the
micro-batch in front of it, all stages at once (the stage program vmapped over the stage axis,
which shards it), then hands its output to the next stage (`Layout.next_stage`: one
collective-permute of one micro-batch's activations per stage boundary, and of their gradient
in the backward pass; the last stage sends only when repeats wrap around to stage 0). Stage 0
takes micro-batch t mod M at iteration t, new ones first, then those back from the last stage
for their next repeat (which needs M >= S when R > 1). M micro-batches take R M + S - 1
iterations, of which each stage idles S - 1: the bubble is (S - 1) / (R M + S - 1).

Uneven groups: since every stage runs the same program, each group gets as many slots as the
largest group has layers, and a slot its group lacks is masked (x passes it unchanged, its router
statistics are zeros that nobody counts, its gradient is exactly zero). A synchronous pipeline's
iteration takes as long as its slowest stage anyway, so the masked slots cost no time beyond that
of the largest group; they cost its memory on every stage.

Nothing else crosses the stages inside the loop: each stage keeps its own copy of the
micro-batches (stage 0 reads its inputs there, the last stage writes its outputs, stage 0 keeps
those the last stage hands back for their next repeat) and its own router statistics, all
updated per stage (vmapped over the stage axis); the outputs leave the last stage once, after
the loop, as the inputs came in once before it. (Before, a roll over the stage axis also sent
the slice stage 0 drops, and the inputs, outputs and their gradients were broadcast over the
stages every iteration: measured by scripts/comm_volume.py on tests/test_traffic.py's PP 2
model, collective-permute 1.28 -> 0.75, all-gather 2.69 -> 0.66 and all-reduce 6.00 -> 5.23
MiB per device and step.)

The backward pass is the loop's own derivative (forward for all micro-batches, then backward,
as GPipe); `train.remat` applies inside each layer. Router statistics are kept per layer and
micro-batch, from the stages' active iterations only, and come back as means over micro-batches,
as the micro-batch loop of a step without stages gives them; attention's largest logits (with
train.qk_clip) as their maxima.

The stack's parameters keep their [L, ...] shape (checkpoints do not depend on S, R or the
groups), split over the stage axis in L / S blocks where S divides L: with R = 1 and equal groups
those are the stages' groups; otherwise the step regroups them (a reshape for equal groups, a
gather of layer indices for uneven ones), which moves some of the stack's parameters between
stages each step, and their gradients back.
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
from jmoe.parallel import Layout, constrain


@dataclasses.dataclass(frozen=True)
class Schedule:
  stages: int
  repeats: int
  micro_batches: int

  @property
  def iterations(self) -> int:
    return self.repeats * self.micro_batches + self.stages - 1

  @property
  def bubble(self) -> float:
    """The share of iterations a stage idles."""
    return (self.stages - 1) / self.iterations


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
    counts_RS = np.asarray(self.counts).reshape(-1, self.stages)
    per_stage = ", ".join(str(c) for c in counts_RS.sum(0))
    text = f"MoE layers per stage: {per_stage}"
    if counts_RS.shape[0] > 1:
      text += (" (per virtual stage, each stage's repeats: "
               + ", ".join("+".join(str(c) for c in counts_RS[:, s]) for s in range(self.stages))
               + ")")
    if not self.even:
      text += f"; each group runs {self.width} slots, masked where it has fewer layers"
    return text


def slots_of(layout: Layout, num_layers: int) -> Slots:
  return Slots(layout.layer_groups(num_layers), layout.stages)


def _accumulate(acc_SR: LayerStats, stats_S: LayerStats, on_SR: jax.Array) -> LayerStats:
  """The stages' stats of one iteration added into their (stage, repeat) totals where `on_SR`:
  router stats summed (for their means), largest logits kept."""
  where = lambda s, fill: jnp.where(on_SR.reshape(on_SR.shape + (1,) * (s.ndim - 1)),
                                    s[:, None], fill)
  return LayerStats(
      router=jax.tree.map(lambda acc, s: acc + where(s, 0), acc_SR.router, stats_S.router),
      max_logit_H=jax.tree.map(lambda acc, s: jnp.maximum(acc, where(s, -jnp.inf)),
                               acc_SR.max_logit_H, stats_S.max_logit_H))


def run_pipeline(stack: nnx.Module, layout: Layout, x_BSD: jax.Array, positions_BS: jax.Array,
                 segment_ids_BS: jax.Array | None, *, micro_batches: int, remat: str,
                 rng: jax.Array | None, first_layer: int, unroll: int,
                 axes: tuple[str | None, ...]):
  """As `run_stack(stack, x_BSD, positions_BS, segment_ids_BS, ...)` (the last x and the stacked
  per-layer outputs, here router stats averaged over micro-batches), in `layout`'s stages; the
  batch is cut into `micro_batches` micro-batches; `axes`: x's logical axes between layers."""
  sched = Schedule(layout.stages, layout.repeats, micro_batches)
  S, R, M = sched.stages, sched.repeats, sched.micro_batches
  graphdef, state = nnx.split(stack)
  num_layers = depth(stack)
  slots = slots_of(layout, num_layers)
  width = slots.width
  layers_RPS, active_RPS = slots.layers, None if slots.even else jnp.asarray(slots.active)
  starts_RS = jnp.asarray(slots.starts)
  batch = x_BSD.shape[0]
  micro = batch // M
  inner = layout.inside_stages()

  def by_micro(a):  # [B, ...] -> [M, B / M, ...], each micro-batch split as inside a stage
    if a is None:
      return None
    a = a.reshape(M, micro, *a.shape[1:])
    with inner.active():
      return constrain(a, (None, *axes[:a.ndim - 1]))

  x_MBSD, positions_MBS, segments_MBS = map(by_micro, (x_BSD, positions_BS, segment_ids_BS))
  # Each micro-batch's noise: a key per layer, as the step without stages draws them.
  keys_ML = (None if rng is None else
             jax.vmap(lambda m: jax.random.split(jax.random.fold_in(rng, m), num_layers))(
                 jnp.arange(M)))

  def to_stages(variable):
    """[L, ...] -> [R, width, S, ...]: stage s, repeat r holds group r S + s; the stage axis
    after the layers', so that a stage's loop over its layers reads them in place. Equal groups
    are a reshape; uneven ones a gather (whose gradient adds the slots back into the stack)."""
    a = variable[...]
    spec = inner.param_spec(variable.get_metadata().get("axes"), a.shape)
    if slots.even:
      a = a.reshape(R, S, width, *a.shape[1:]).swapaxes(1, 2)
    else:
      a = a[layers_RPS.reshape(-1)].reshape(R, width, S, *a.shape[1:])
    spec = P(None, None, layout.stage_axes, *map(off_stages, spec[1:]))
    return variable.replace(jax.lax.with_sharding_constraint(a, NamedSharding(inner.mesh, spec)))

  def off_stages(entry):  # a placement without the stage axis (where it stored the stack)
    entry = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,))
                  if a is not None and a not in layout.stage_axes)
    return entry or None

  stage_state = jax.tree.map(to_stages, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  stage_ids = jnp.arange(S)

  def stage_program(layer_state_R, x_BSD, positions_BS, segments_BS, keys_P, repeat, first,
                    active_P):
    # One repeat: its slice of the stage's layers (read in place); else the iteration's group.
    layer_state = jax.tree.map(lambda a: a[0] if R == 1 else a[repeat], layer_state_R)
    return run_stack(nnx.merge(graphdef, layer_state), x_BSD, positions_BS, segments_BS,
                     remat=remat, keys=keys_P, first_layer=first, unroll=unroll, active=active_P)

  stages_at_once = jax.vmap(stage_program, in_axes=(2, 0, 0, 0, 0, 0, 0, 0),
                            spmd_axis_name=layout.stage_axes)

  def slot_table(table_RPS, repeat_S):
    """[S, width]: each stage's row of an [R, width, S] table, for its repeat."""
    return table_RPS[repeat_S[:, None], jnp.arange(width)[None, :], stage_ids[:, None]]

  is_first, is_last = stage_ids == 0, stage_ids == S - 1
  # Per stage, by micro-batch: a stage updates only its own slice (no collective in the loop).
  per_stage = lambda f: jax.vmap(f, spmd_axis_name=layout.stage_axes)
  put = per_stage(lambda buf_M, m, on, y: buf_M.at[m].set(jnp.where(on, y, buf_M[m])))
  get = per_stage(lambda buf_M, m: buf_M[m])

  def iteration(carry, t):
    x_S, circular_SM, out_SM, stats_SR = carry
    step_S = t - stage_ids  # how far each stage is through its R M micro-batch visits
    active_S = (step_S >= 0) & (step_S < R * M)
    step_S = jnp.clip(step_S, 0, R * M - 1)
    micro_S, repeat_S = step_S % M, step_S // M
    t_S = jnp.full((S,), t)
    if R > 1:  # stage 0 keeps what the last stage handed it (last iteration) for its next repeat
      back = t - S  # the last stage's step an iteration ago
      again = (back >= 0) & (back < (R - 1) * M)
      circular_SM = put(circular_SM, jnp.clip(back, 0, R * M - 1) % M + 0 * stage_ids,
                        is_first & again, x_S)
    # Stage 0 takes a new micro-batch, or one back from the last stage for its next repeat.
    first_S = get(in_SM, t_S % M)
    if R > 1:
      first_S = jnp.where(t < M, first_S, get(circular_SM, t_S % M))
    x_S = jnp.where(is_first.reshape((S,) + (1,) * (x_S.ndim - 1)), first_S.astype(x_S.dtype),
                    x_S)
    take = lambda a: None if a is None else a[micro_S]
    keys_SP = (None if keys_ML is None else
               keys_ML[micro_S[:, None], slot_table(jnp.asarray(layers_RPS), repeat_S)])
    active_SP = None if active_RPS is None else slot_table(active_RPS, repeat_S)
    with inner.active():
      y_S, stats_S = stages_at_once(
          stage_state, inner.on_stages(x_S), take(positions_MBS), take(segments_MBS), keys_SP,
          repeat_S, first_layer + starts_RS[repeat_S, stage_ids], active_SP)
    # The last stage keeps a micro-batch that has passed R times, for after the loop.
    out_SM = put(out_SM, micro_S, is_last & active_S & (repeat_S == R - 1), y_S)
    stats_SR = _accumulate(stats_SR, stats_S, jax.nn.one_hot(repeat_S, R, dtype=bool)
                           & active_S[:, None])
    return (layout.next_stage(y_S, wrap=R > 1), circular_SM, out_SM, stats_SR), None

  # Each stage's copy of the micro-batches (the batch outside the stages is split over them):
  # stage 0 reads its own, and their gradient comes back to the batch once, after the loop.
  stage_copies = lambda a_M: inner.on_stages(jnp.broadcast_to(a_M, (S, *a_M.shape)))
  in_SM = stage_copies(x_MBSD)
  x_S = inner.on_stages(jnp.zeros((S, *x_MBSD.shape[1:]), x_MBSD.dtype))
  out_SM = stage_copies(jnp.zeros_like(x_MBSD))
  circular_SM = (stage_copies(jnp.zeros_like(x_MBSD)) if R > 1 else
                 jnp.zeros((S, M, 0), x_MBSD.dtype))
  first_S = jnp.zeros((S,), jnp.int32)  # micro-batch 0 in every stage, for the shapes
  with inner.active():
    stats_shape = jax.eval_shape(
        stages_at_once, stage_state, x_S, None if positions_MBS is None else positions_MBS[first_S],
        None if segments_MBS is None else segments_MBS[first_S],
        None if keys_ML is None else keys_ML[first_S, :width], first_S, first_S,
        None if active_RPS is None else active_RPS[0].T)[1]
  stats_SR = jax.tree.map(
      lambda s: inner.on_stages(jnp.zeros((S, R, *s.shape[1:]), jnp.float32)), stats_shape)
  if stats_SR.max_logit_H is not None:  # (maxima start from nothing seen)
    stats_SR = stats_SR.replace(max_logit_H=jnp.full_like(stats_SR.max_logit_H, -jnp.inf))
  (_, _, out_SM, stats_SR), _ = jax.lax.scan(
      iteration, (x_S, circular_SM, out_SM, stats_SR), jnp.arange(sched.iterations))
  out_M = out_SM[S - 1]
  # [S, R, width, ...] in layer order (each layer from its slot), averaged over micro-batches.
  real = np.nonzero(slots.active.swapaxes(1, 2))  # (repeat, stage, slot) of each layer, in order
  in_order = lambda a: a.swapaxes(0, 1)[real]
  stats_L = LayerStats(router=jax.tree.map(lambda a: in_order(a) / M, stats_SR.router),
                       max_logit_H=jax.tree.map(in_order, stats_SR.max_logit_H))
  y_BSD = out_M.reshape(batch, *out_M.shape[2:])
  return constrain(y_BSD, axes), stats_L
