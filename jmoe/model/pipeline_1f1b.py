"""1F1B and interleaved 1F1B: the pipeline's forward and backward passes in one loop, so that a
stage holds the activations of a bounded number of micro-batches, not of all M.

Each iteration (tick) t, every stage runs one forward slot, then the head and loss (`tail`) take
the micro-batch that just left the last stage, then every stage runs one backward slot; the
activations go on to the next stage and the gradients back to the previous one (`Layout`'s
`next_stage` / `previous_stage`: one collective-permute per stage boundary). The activations go
every tick, outside the slots, where the send can overlap the tick's loss and backward slots;
the gradients go inside the backward slot, only in the R M + S - 1 ticks it runs (their send
ends the tick either way, and the first R S - 1 ticks have none to send).

Order (S stages, R repeats, M micro-batches; interleaved needs S | M): stage s's forward visit
n = t - s (0 <= n < R M) is micro-batch k S + (u mod S) at repeat u // S, where n = k R S + u:
the micro-batches go in rounds of S, each round through all R repeats before the next round
starts, so a micro-batch back from the last stage is exactly on time for its next repeat on stage
0. The backward visits run the same rounds with the repeats reversed, stage S - 1's visit b at
tick b + R S - 1 (the tick its last forward visit leaves the stage: the loss's gradient is ready
in that tick) and stage s's S - 1 - s ticks later. R M + R S + S - 2 ticks in all (1F1B: M + 2 S
- 2); the forward slots of the last R S - 1 ticks and the backward slots of the first R S - 1 run
on no stage and are skipped, so a stage idles (S - 1) / (R M + S - 1) of its slots, as under
GPipe.

A forward slot keeps only its stage's input, in a ring of W = min(R M, 2 R S - 1) entries (stage
s's visit waits 2 R S - 2 s - 2 ticks for its backward, so entry n mod W is free again in time);
the backward slot recomputes the stage's forward from it under `jax.vjp` (`train.remat` applies
inside), which costs one more forward pass of the stack per micro-batch than GPipe and keeps one
visit's layer activations at a time. Router statistics come from the forward slots; their
gradient is constant (the balancing terms are sums of per-layer terms, linear in the statistics).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.model.stages import Schedule, Stages
from jmoe.parallel import Layout, constrain

# tail(params, h_BSD, m) -> (loss, aux): micro-batch m's share of the loss from the stack's output
Tail = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]

# The scopes of the three slots' conditionals (profiles and the communication report name them).
SLOTS = ("forward_slot", "loss_slot", "backward_slot")


def pipeline_value_and_grad(stack: nnx.Module, layout: Layout, x_BSD: jax.Array,
                            positions_BS: jax.Array, segment_ids_BS: jax.Array | None,
                            tail: Tail, tail_params: Any, balance: Callable, *,
                            wrt: Any = nnx.Param, micro_batches: int, remat: str, rng: jax.Array | None,
                            first_layer: int, unroll: int, axes: tuple[str | None, ...]):
  """The loss of a batch whose stack input is `x_BSD`, summed over micro-batches of `tail`'s
  losses plus `balance(stats)` (the balancing terms of the stack's router stats, [L, ...], means
  over micro-batches), and its gradient, in `layout`'s stages in 1F1B order (interleaved with
  repeats). Returns (loss, `tail`'s aux summed over micro-batches, the stack's stats [L, ...],
  the gradient of the stack's variables that `wrt` (an nnx filter) selects, `tail_params`'
  gradient, x_BSD's gradient)."""
  st = Stages(stack, layout, micro_batches, positions_BS, segment_ids_BS, remat=remat, rng=rng,
              first_layer=first_layer, unroll=unroll, axes=axes)
  S, R, M = st.S, st.R, st.M
  sched = Schedule(S, R, M, kind="1f1b")
  W = sched.in_flight
  x_MBSD = st.by_micro(x_BSD)
  trained, fixed = nnx.split_state(st.state, wrt, ...)
  trained_state, from_stages = jax.vjp(st.stage_state, trained)
  fixed_state = st.stage_state(fixed)
  run = lambda trained, x_S, micro_S, repeat_S: st.run(
      nnx.merge_state(trained, fixed_state), x_S, micro_S, repeat_S)
  ids = st.stage_ids
  put = st.per_micro(lambda buf, i, on, y: buf.at[i].set(jnp.where(on, y, buf[i])))
  get = st.per_micro(lambda buf, i: buf[i])
  by_stage = lambda on_S, a: on_S.reshape(on_S.shape + (1,) * (a.ndim - 1))

  def visit(n_S):
    """(micro-batch, repeat) of forward visit n: rounds of S micro-batches through R repeats."""
    k, u = n_S // (R * S), n_S % (R * S)
    return k * S + u % S, u // S

  def stats_cotangent(stats_S, on_S):
    flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stats_S)
    ct = jax.grad(lambda s: balance(s) / M)(flat)
    return jax.tree.map(lambda c, a: jnp.where(by_stage(on_S, a), c.reshape(a.shape), 0),
                        ct, stats_S)

  def forward(carry, t):
    x_S, ring_SW, stats_SR = carry
    n_S = t - ids
    on_S = (n_S >= 0) & (n_S < R * M)
    micro_S, repeat_S = visit(jnp.clip(n_S, 0, R * M - 1))
    # Stage 0 takes a new micro-batch on its first repeat; else what the last stage handed it.
    new_S = (ids == 0) & (repeat_S == 0)
    x_S = jnp.where(by_stage(new_S, x_S), get(in_SM, micro_S).astype(x_S.dtype), x_S)
    ring_SW = put(ring_SW, jnp.clip(n_S, 0) % W, on_S, x_S)
    y_S, stats_S = run(trained_state, x_S, micro_S, repeat_S)
    return y_S, ring_SW, st.add_stats(stats_SR, stats_S, repeat_S, on_S)

  def loss_of_last(t, y_S):
    """The tail on what leaves the last stage at tick t (if its last repeat): on every device."""
    n = t - (S - 1)
    micro, repeat = visit(jnp.clip(n, 0, R * M - 1))
    h_BSD = constrain(y_S[S - 1], axes)
    (loss, aux), grad_fn = jax.vjp(lambda p, h: tail(p, h, micro), tail_params, h_BSD)
    d_params, dh_BSD = grad_fn((jnp.ones_like(loss), jax.tree.map(jnp.zeros_like, aux)))
    with st.inner.active():
      dh_S = st.inner.on_stages(jnp.zeros_like(y_S).at[S - 1].set(dh_BSD.astype(y_S.dtype)))
    return loss, aux, d_params, dh_S

  def backward(carry, t, dh_S):
    """(the input gradients handed to the previous stages, dx_SM, the stage's gradient)."""
    g_S, ring_SW, dx_SM, d_stage = carry
    b_S = t - (R * S - 1) - (S - 1 - ids)
    on_S = (b_S >= 0) & (b_S < R * M)
    b_S = jnp.clip(b_S, 0, R * M - 1)
    k_S, w_S = b_S // (R * S), b_S % (R * S)
    repeat_S = R - 1 - w_S // S
    micro_S = k_S * S + w_S % S
    n_S = k_S * R * S + repeat_S * S + w_S % S  # the forward visit it undoes
    # The last stage's last repeat takes the loss's gradient; the rest, what was handed back.
    from_loss = (ids == S - 1) & (repeat_S == R - 1)
    g_S = jnp.where(by_stage(on_S, g_S), jnp.where(by_stage(from_loss, g_S), dh_S, g_S), 0)
    (y_S, stats_S), grad_fn = jax.vjp(
        lambda state, x: run(state, x, micro_S, repeat_S), trained_state, get(ring_SW, n_S % W))
    d_state, dx_S = grad_fn((g_S.astype(y_S.dtype), stats_cotangent(stats_S, on_S)))
    d_stage = jax.tree.map(jnp.add, d_stage, d_state)
    dx_SM = put(dx_SM, micro_S, on_S & (ids == 0) & (repeat_S == 0), dx_S)
    return layout.previous_stage(dx_S, wrap=R > 1), dx_SM, d_stage

  def tick(carry, t):
    (x_S, g_S, ring_SW, dx_SM, stats_SR, d_stage, loss, aux, d_tail) = carry
    # Slots no stage runs this tick are skipped (the predicates depend on t alone, so every
    # device takes the same branch, and the backward slot's send with it).
    with jax.named_scope(SLOTS[0]):
      y_S, ring_SW, stats_SR = jax.lax.cond(
          t < R * M + S - 1, forward, lambda c, t: (c[0], c[1], c[2]),
          (x_S, ring_SW, stats_SR), t)
    n_last = t - (S - 1)
    leaves = (n_last >= 0) & (n_last < R * M) & (visit(jnp.maximum(n_last, 0))[1] == R - 1)
    no_loss = lambda t, y_S: (jnp.zeros_like(loss), jax.tree.map(jnp.zeros_like, aux),
                              jax.tree.map(jnp.zeros_like, d_tail), jnp.zeros_like(y_S))
    with jax.named_scope(SLOTS[1]):
      loss_t, aux_t, d_tail_t, dh_S = jax.lax.cond(leaves, loss_of_last, no_loss, t, y_S)
    with jax.named_scope(SLOTS[2]):
      g_S, dx_SM, d_stage = jax.lax.cond(
          t >= R * S - 1, backward, lambda c, t, dh: (jnp.zeros_like(c[0]), c[2], c[3]),
          (g_S, ring_SW, dx_SM, d_stage), t, dh_S)
    add = lambda a, b: jax.tree.map(jnp.add, a, b)
    return (layout.next_stage(y_S, wrap=R > 1), g_S, ring_SW, dx_SM, stats_SR, d_stage,
            loss + loss_t, add(aux, aux_t), add(d_tail, d_tail_t)), None

  in_SM = st.stage_copies(x_MBSD)  # stage 0 reads its own copy; its gradient: dx_SM[0]
  zeros_S = st.inner.on_stages(jnp.zeros((S, *x_MBSD.shape[1:]), x_MBSD.dtype))
  ring_SW = st.inner.on_stages(jnp.zeros((S, W, *x_MBSD.shape[1:]), x_MBSD.dtype))
  dx_SM = st.stage_copies(jnp.zeros_like(x_MBSD))
  stats_SR = st.zero_stats(nnx.merge_state(trained_state, fixed_state), zeros_S)
  h_shape = jax.ShapeDtypeStruct(x_MBSD.shape[1:], x_MBSD.dtype)
  loss_shape, aux_shape = jax.eval_shape(lambda p, h: tail(p, h, 0), tail_params, h_shape)
  zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
  carry = (zeros_S, zeros_S, ring_SW, dx_SM, stats_SR, zeros(trained_state), zeros(loss_shape),
           zeros(aux_shape), zeros(tail_params))
  (_, _, _, dx_SM, stats_SR, d_stage, loss, aux, d_tail), _ = jax.lax.scan(
      tick, carry, jnp.arange(sched.iterations))
  stats_L = st.stats_by_layer(stats_SR)
  dx_BSD = constrain(st.from_micro(dx_SM[0]), axes)
  return (loss + balance(stats_L), aux, stats_L, from_stages(d_stage)[0], d_tail,
          dx_BSD.astype(x_BSD.dtype))
