"""Pipeline parallelism: the MoE blocks' stack in stages over the mesh's outermost axis, the
micro-batches flowing through them inside the one jitted step.

With S stages (`parallel.pipeline`) and R repeats (`parallel.pipeline_repeats`) the L layers are
cut into S x R contiguous groups of L / (S R); group g runs on stage g mod S, so a micro-batch
passes through the stages R times (circular, or interleaved, stages: a smaller bubble for the
same S). Each iteration of the schedule, every stage runs its group on the micro-batch in front
of it, all stages at once (the stage program vmapped over the stage axis, which shards it),
then hands its output to the next stage (a roll over that axis: one collective-permute). Stage 0
takes micro-batch t mod M at iteration t, new ones first, then those back from the last stage
for their next repeat (which needs M >= S when R > 1). M micro-batches take R M + S - 1
iterations, of which each stage idles S - 1: the bubble is (S - 1) / (R M + S - 1).

The backward pass is the loop's own derivative (forward for all micro-batches, then backward,
as GPipe); `train.remat` applies inside each layer. Router statistics are kept per layer and
micro-batch, from the stages' active iterations only, and come back as means over micro-batches,
as the micro-batch loop of a step without stages gives them.

The stack's parameters keep their [L, ...] shape (checkpoints do not depend on S or R), split
over the stage axis in L / S blocks: with R = 1 those are the stages' groups; with R > 1 the step
regroups them, which moves (R - 1) / R of the stack's parameters between stages each step, and
their gradients back.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
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
  per_group = num_layers // (S * R)
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
    """[L, ...] -> [R, L / (S R), S, ...]: stage s, repeat r holds group r S + s; the stage axis
    after the layers', so that a stage's loop over its layers reads them in place."""
    a = variable[...]
    spec = inner.param_spec(variable.get_metadata().get("axes"), a.shape)
    a = a.reshape(R, S, per_group, *a.shape[1:]).swapaxes(1, 2)
    return variable.replace(jax.lax.with_sharding_constraint(
        a, NamedSharding(inner.mesh, P(None, None, *spec))))

  stage_state = jax.tree.map(to_stages, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  stage_ids = jnp.arange(S)

  def stage_program(layer_state_R, x_BSD, positions_BS, segments_BS, keys_L, repeat, first):
    # One repeat: its slice of the stage's layers (read in place); else the iteration's group.
    layer_state = jax.tree.map(lambda a: a[0] if R == 1 else a[repeat], layer_state_R)
    return run_stack(nnx.merge(graphdef, layer_state), x_BSD, positions_BS, segments_BS,
                     remat=remat, keys=keys_L, first_layer=first, unroll=unroll)

  stages_at_once = jax.vmap(stage_program, in_axes=(2, 0, 0, 0, 0, 0, 0),
                            spmd_axis_name=layout.stage_axes)

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
    keys_SL = None
    if keys_ML is not None:
      groups = (repeat_S * S + stage_ids)[:, None] * per_group + jnp.arange(per_group)
      keys_SL = keys_ML[micro_S[:, None], groups]
    with inner.active():
      y_S, stats_S = stages_at_once(
          stage_state, x_S, take(positions_MBS), take(segments_MBS), keys_SL, repeat_S,
          first_layer + (repeat_S * S + stage_ids) * per_group)
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
        None if keys_ML is None else keys_ML[first_S, :per_group], first_S, first_S)[1]
  stats_RS = jax.tree.map(lambda s: jnp.zeros((R, *s.shape), jnp.float32), stats_shape)
  (_, _, out_M, stats_RS), _ = jax.lax.scan(
      iteration, (x_S, circular_M, out_M, stats_RS), jnp.arange(sched.iterations))
  # [R, S, L / (S R), ...] in layer order (group r S + s), averaged over micro-batches.
  stats_L = jax.tree.map(lambda a: a.reshape(num_layers, *a.shape[3:]) / M, stats_RS)
  y_BSD = out_M.reshape(batch, *out_M.shape[2:])
  return constrain(y_BSD, axes), stats_L
