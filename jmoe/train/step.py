"""The jitted training step: forward and backward over micro-batches, one optimizer update."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jmoe.config import Config
from jmoe.train.loss import balance_losses, cross_entropy_sum, mtp_inputs, mtp_loss
from jmoe.train.state import TrainState


def make_loss_fn(graphdef: nnx.GraphDef, config: Config) -> Callable:
  """loss(params, rest, tokens_BS1, num_targets, num_micro, rng) -> (loss, metrics) for one
  micro-batch.

  The micro-batch's share of the global loss: its summed token losses over all targets of the
  global batch, plus its balancing terms over the number of micro-batches. `rng` (or None) drives
  training-time noise.
  """

  depth = config.model.mtp_depth

  def loss_fn(params, rest, tokens_BS1, num_targets, num_micro, rng=None):
    model = nnx.merge(graphdef, params, rest)
    inputs_BS = tokens_BS1[:, :-1]
    metrics = {}
    if depth:
      logits_BSV, mtp_BKSV, stats = model.with_mtp(inputs_BS, mtp_inputs(tokens_BS1, depth),
                                                   rng=rng)
      num_sequences = num_targets // inputs_BS.shape[1]
      metrics["mtp_loss"] = mtp_loss(mtp_BKSV, tokens_BS1, num_sequences,
                                     config.train.mtp_loss_weight)
    else:
      logits_BSV, stats = model(inputs_BS, rng=rng)
    lm_loss = cross_entropy_sum(logits_BSV, tokens_BS1[:, 1:]) / num_targets
    aux_loss, z_loss = balance_losses(stats, config.moe.balance)
    aux_loss, z_loss = aux_loss / num_micro, z_loss / num_micro
    metrics.update({"lm_loss": lm_loss, "aux_loss": aux_loss, "z_loss": z_loss,
                    "expert_load": stats.load_E / num_micro,
                    "dropped_fraction": jnp.mean(stats.dropped_fraction) / num_micro})
    return lm_loss + aux_loss + z_loss + metrics.get("mtp_loss", 0.0), metrics

  return loss_fn


def make_train_step(graphdef: nnx.GraphDef, config: Config,
                    optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule) -> Callable[[TrainState, dict], tuple]:
  grad_fn = jax.value_and_grad(make_loss_fn(graphdef, config), has_aux=True)
  micro = config.train.micro_batch_size or config.train.batch_size
  num_micro = config.train.batch_size // micro

  bias_rate = config.moe.balance.bias_update_rate
  step_key = jax.random.key(config.train.seed + 1)  # training noise; distinct from the init key

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    tokens_BS1 = batch["tokens"]
    num_targets = tokens_BS1.shape[0] * (tokens_BS1.shape[1] - 1)
    rng = jax.random.fold_in(step_key, state.step)

    def one(tokens, index):
      (loss, metrics), grads = grad_fn(state.params, state.rest, tokens, num_targets, num_micro,
                                       jax.random.fold_in(rng, index))
      return grads, {"loss": loss, **metrics}

    if num_micro == 1:
      grads, metrics = one(tokens_BS1, 0)
    else:
      tokens_MBS1 = tokens_BS1.reshape(num_micro, micro, -1)

      def accumulate(carry, xs):
        grads, metrics = one(*xs)
        return jax.tree.map(jnp.add, carry, (grads, metrics)), None

      zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(one, tokens_MBS1[0], 0))
      (grads, metrics), _ = jax.lax.scan(accumulate, zeros, (tokens_MBS1, jnp.arange(num_micro)))

    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["lr"] = schedule(state.step)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    rest = state.rest
    if bias_rate > 0:  # aux-loss-free balancing, outside the gradient
      model = nnx.merge(graphdef, params, rest)
      model.update_expert_bias(metrics["expert_load"], bias_rate)
      rest = nnx.state(model, nnx.Not(nnx.Param))
    new_state = state.replace(step=state.step + 1, params=params, rest=rest, opt_state=opt_state)
    return new_state, metrics

  return train_step
