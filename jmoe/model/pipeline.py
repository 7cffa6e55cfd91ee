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

Schedules (`parallel.pipeline_schedule`): here GPipe's, whose backward pass is the loop's own
derivative (forward for all micro-batches, then backward; `train.remat` applies inside each
layer), so that each stage keeps the activations of all R M micro-batch visits; 1F1B and
interleaved 1F1B (jmoe/model/pipeline_1f1b.py) run both passes in one loop and keep at most
2 R S - 1 stage inputs, at the cost of recomputing each stage's forward pass. The stage setup
they share (parameters in stages, the stage program, the bubble) is jmoe/model/stages.py. Router statistics are kept per layer and
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

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.model.stages import Schedule, Slots, Stages, bubble_fraction, slots_of  # noqa: F401
from jmoe.parallel import Layout, constrain


def run_pipeline(stack: nnx.Module, layout: Layout, x_BSD: jax.Array, positions_BS: jax.Array,
                 segment_ids_BS: jax.Array | None, *, micro_batches: int, remat: str,
                 rng: jax.Array | None, first_layer: int, unroll: int,
                 axes: tuple[str | None, ...]):
  """As `run_stack(stack, x_BSD, positions_BS, segment_ids_BS, ...)` (the last x and the stacked
  per-layer outputs, here router stats averaged over micro-batches), in `layout`'s stages in
  GPipe's order; the batch is cut into `micro_batches` micro-batches; `axes`: x's logical axes
  between layers."""
  st = Stages(stack, layout, micro_batches, positions_BS, segment_ids_BS, remat=remat, rng=rng,
              first_layer=first_layer, unroll=unroll, axes=axes)
  S, R, M = st.S, st.R, st.M
  sched = Schedule(S, R, M)
  x_MBSD = st.by_micro(x_BSD)
  stage_state = st.stage_state(st.state)
  is_first, is_last = st.stage_ids == 0, st.stage_ids == S - 1
  # Per stage, by micro-batch: a stage updates only its own slice (no collective in the loop).
  put = st.per_micro(lambda buf_M, m, on, y: buf_M.at[m].set(jnp.where(on, y, buf_M[m])))
  get = st.per_micro(lambda buf_M, m: buf_M[m])

  def iteration(carry, t):
    x_S, circular_SM, out_SM, stats_SR = carry
    step_S = t - st.stage_ids  # how far each stage is through its R M micro-batch visits
    active_S = (step_S >= 0) & (step_S < R * M)
    step_S = jnp.clip(step_S, 0, R * M - 1)
    micro_S, repeat_S = step_S % M, step_S // M
    t_S = jnp.full((S,), t)
    if R > 1:  # stage 0 keeps what the last stage handed it (last iteration) for its next repeat
      back = t - S  # the last stage's step an iteration ago
      again = (back >= 0) & (back < (R - 1) * M)
      circular_SM = put(circular_SM, jnp.clip(back, 0, R * M - 1) % M + 0 * st.stage_ids,
                        is_first & again, x_S)
    # Stage 0 takes a new micro-batch, or one back from the last stage for its next repeat.
    first_S = get(in_SM, t_S % M)
    if R > 1:
      first_S = jnp.where(t < M, first_S, get(circular_SM, t_S % M))
    x_S = jnp.where(is_first.reshape((S,) + (1,) * (x_S.ndim - 1)), first_S.astype(x_S.dtype),
                    x_S)
    y_S, stats_S = st.run(stage_state, x_S, micro_S, repeat_S)
    # The last stage keeps a micro-batch that has passed R times, for after the loop.
    out_SM = put(out_SM, micro_S, is_last & active_S & (repeat_S == R - 1), y_S)
    stats_SR = st.add_stats(stats_SR, stats_S, repeat_S, active_S)
    return (layout.next_stage(y_S, wrap=R > 1), circular_SM, out_SM, stats_SR), None

  # Each stage's copy of the micro-batches (the batch outside the stages is split over them):
  # stage 0 reads its own, and their gradient comes back to the batch once, after the loop.
  in_SM = st.stage_copies(x_MBSD)
  x_S = st.inner.on_stages(jnp.zeros((S, *x_MBSD.shape[1:]), x_MBSD.dtype))
  out_SM = st.stage_copies(jnp.zeros_like(x_MBSD))
  circular_SM = (st.stage_copies(jnp.zeros_like(x_MBSD)) if R > 1 else
                 jnp.zeros((S, M, 0), x_MBSD.dtype))
  stats_SR = st.zero_stats(stage_state, x_S)
  (_, _, out_SM, stats_SR), _ = jax.lax.scan(
      iteration, (x_S, circular_SM, out_SM, stats_SR), jnp.arange(sched.iterations))
  y_BSD = st.from_micro(out_SM[S - 1])
  return constrain(y_BSD, axes), st.stats_by_layer(stats_SR)
