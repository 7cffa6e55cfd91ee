"""Pipeline parallelism: the MoE blocks' stack in stages over the mesh's outermost axis, the
micro-batches flowing through them inside the one jitted step.

With S stages (`parallel.pipeline`) and R repeats (`parallel.pipeline_repeats`) the L layers are
cut into S x R contiguous groups (virtual stages), as `parallel.pipeline_layers` or
`pipeline_first` / `pipeline_last` say, else as even as possible; group g runs on stage g mod S, so
a micro-batch passes through the stages R times (circular, or interleaved, stages: a smaller
bubble for the same S). Each iteration of the schedule, every stage runs its group on the
micro-batch in front of it, all stages at once (the stage program vmapped over the stage axis,
which shards it), then hands its output to the next stage (a roll over that axis: one
collective-permute). Stage 0 takes micro-batch t mod M at iteration t, new ones first, then those
back from the last stage for their next repeat (which needs M >= S when R > 1). M micro-batches
take R M + S - 1 iterations, of which each stage idles S - 1: the bubble is (S - 1) / (R M + S - 1).

Uneven groups: since every stage runs the same program, each group gets as many slots as the
largest group has layers, and a slot its group lacks is masked (x passes it unchanged, its router
statistics are zeros that nobody counts, its gradient is exactly zero). A synchronous pipeline's
iteration takes as long as its slowest stage anyway, so the masked slots cost no time beyond that
of the largest group; they cost its memory on every stage.

The backward pass is the loop's own derivative (forward for all micro-batches, then backward,
as GPipe); `train.remat` applies inside each layer. Router statistics are kept per layer and
micro-batch, from the stages' active iterations only, and come back as means over micro-batches,
as the micro-batch loop of a step without stages gives them.

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

  def iteration(carry, t):
    x_S, circular_M, out_M, stats_RS = carry
    step_S = t - stage_ids  # how far each stage is through its R M micro-batch visits
    active_S = (step_S >= 0) & (step_S < R * M)
    step_S = jnp.clip(step_S, 0, R * M - 1)
    micro_S, repeat_S = step_S % M, step_S // M
    # Stage 0 takes a new micro-batch, or one back from the last stage for its next repeat.
    first_input = (x_MBSD[t % M] if R == 1 else
                   jnp.where(t < M, x_MBSD[t % M], circular_M[t % M]))
    x_S = inner.on_stages(x_S.at[0].set(first_input.astype(x_S.dtype)))
    take = lambda a: None if a is None else a[micro_S]
    keys_SP = (None if keys_ML is None else
               keys_ML[micro_S[:, None], slot_table(jnp.asarray(layers_RPS), repeat_S)])
    active_SP = None if active_RPS is None else slot_table(active_RPS, repeat_S)
    with inner.active():
      y_S, stats_S = stages_at_once(
          stage_state, x_S, take(positions_MBS), take(segments_MBS), keys_SP, repeat_S,
          first_layer + starts_RS[repeat_S, stage_ids], active_SP)
    # The last stage's micro-batch: out when it has passed R times, else back to stage 0.
    last = t - (S - 1)
    done = (last >= 0) & (last < R * M)
    last_micro, last_repeat = jnp.clip(last, 0, R * M - 1) % M, jnp.clip(last, 0, R * M - 1) // M
    finished = done & (last_repeat == R - 1)
    out_M = out_M.at[last_micro].set(jnp.where(finished, y_S[S - 1], out_M[last_micro]))
    if R > 1:
      again = done & (last_repeat < R - 1)
      circular_M = circular_M.at[last_micro].set(
          jnp.where(again, y_S[S - 1], circular_M[last_micro]))
    mask = lambda a: jnp.where(active_S.reshape((S,) + (1,) * (a.ndim - 1)), a, 0)
    stats_RS = jax.tree.map(lambda acc, s: acc.at[repeat_S, stage_ids].add(mask(s)),
                            stats_RS, stats_S)
    return (inner.on_stages(jnp.roll(y_S, 1, axis=0)), circular_M, out_M, stats_RS), None

  x_S = inner.on_stages(jnp.zeros((S, *x_MBSD.shape[1:]), x_MBSD.dtype))
  out_M = jnp.zeros_like(x_MBSD)
  circular_M = jnp.zeros_like(x_MBSD) if R > 1 else jnp.zeros((M, 0), x_MBSD.dtype)
  first_S = jnp.zeros((S,), jnp.int32)  # micro-batch 0 in every stage, for the shapes
  with inner.active():
    stats_shape = jax.eval_shape(
        stages_at_once, stage_state, x_S, None if positions_MBS is None else positions_MBS[first_S],
        None if segments_MBS is None else segments_MBS[first_S],
        None if keys_ML is None else keys_ML[first_S, :width], first_S, first_S,
        None if active_RPS is None else active_RPS[0].T)[1]
  stats_RS = jax.tree.map(lambda s: jnp.zeros((R, *s.shape), jnp.float32), stats_shape)
  (_, _, out_M, stats_RS), _ = jax.lax.scan(
      iteration, (x_S, circular_M, out_M, stats_RS), jnp.arange(sched.iterations))
  # [R, S, width, ...] in layer order (each layer from its slot), averaged over micro-batches.
  real = np.nonzero(slots.active.swapaxes(1, 2))  # (repeat, stage, slot) of each layer, in order
  stats_L = jax.tree.map(lambda a: a[real] / M, stats_RS)
  y_BSD = out_M.reshape(batch, *out_M.shape[2:])
  return constrain(y_BSD, axes), stats_L
