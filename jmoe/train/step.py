"""The jitted training step: forward and backward over micro-batches, one optimizer update."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jmoe.config import Config
from jmoe.model.factory import DTYPES
from jmoe.model.qk_clip import clip_factors
from jmoe.moe.layer import keep_weight_amax
from jmoe.ops.attention_kernels import documents_per_row
from jmoe.ops.fp8 import Fp8History, WeightAmax
from jmoe.parallel import Layout
from jmoe.train.loss import (head_nll, mtp_inputs, mtp_loss, router_metrics, target_counts,
                             target_masks)
from jmoe.train.pipelined import make_pipelined_gradients
from jmoe.train.optimizer import AdamW, global_norm, learning_rate
from jmoe.train.state import StateSpec, TrainState, frozen, trainable

log = logging.getLogger(__name__)

MAX_LOGIT = "attention_max_logit"  # the metric: per layer (and, inside the step, per head)


def make_loss_fn(graphdef: nnx.GraphDef, config: Config) -> Callable:
  """loss(params, rest, batch, counts, num_micro, rng) -> (loss, metrics) for one micro-batch.

  `batch` holds `tokens` [B, S + 1] and, for packed rows, `segment_ids` and `positions` alike
  (and `loss_mask`, for chat data: which targets count).
  The micro-batch's share of the global loss: its summed token losses over `counts` (the global
  batch's number of targets: `lm` and, with MTP, `mtp` per module), plus its balancing terms over
  the number of micro-batches. `rng` (or None) drives training-time noise.
  """

  depth = config.model.mtp_depth
  compute_dtype = DTYPES[config.precision.compute]
  # With pipeline stages the micro-batches go through the model together.
  micro_batches = config.train.num_micro_batches if config.parallel.pipeline > 1 else 1
  # Only the all-to-all dispatch over several expert shards has later rounds to count.
  rounds_possible = config.moe.dispatcher == "alltoall" and config.parallel.expert.expert != 1

  def loss_fn(params, rest, batch, counts, num_micro, rng=None):
    model = nnx.merge(graphdef, params, rest)
    nll_sum = head_nll(model.head_weights(compute_dtype))
    tokens_BN = batch["tokens"]
    segments_BN, positions_BN = batch.get("segment_ids"), batch.get("positions")
    inputs = dict(tokens_BS=tokens_BN[:, :-1],
                  positions_BS=None if positions_BN is None else positions_BN[:, :-1],
                  segment_ids_BS=None if segments_BN is None else segments_BN[:, :-1])
    lm_mask_BS, mtp_mask_BLS = target_masks(tokens_BN, segments_BN, depth,
                                            batch.get("loss_mask"))
    metrics = {}
    if depth:
      h_BSD, mtp_BLSD, stats = model.with_mtp(
          next_tokens_BLS=mtp_inputs(tokens_BN, depth), rng=rng, micro_batches=micro_batches,
          **inputs)
      metrics["mtp_loss"] = mtp_loss(mtp_BLSD, tokens_BN, mtp_mask_BLS, counts["mtp"],
                                     config.train.mtp_loss_weight, nll_sum)
    else:
      h_BSD, stats = model.hidden(rng=rng, micro_batches=micro_batches, **inputs)
    lm_loss = nll_sum(h_BSD, tokens_BN[:, 1:], lm_mask_BS) / counts["lm"]
    balance, router = router_metrics(stats.router, config.moe.balance, num_micro,
                                     rounds_possible)
    metrics.update({"lm_loss": lm_loss, **router})
    if stats.max_logit_H is not None:  # [L, H] (a maximum over micro-batches, not a sum)
      metrics[MAX_LOGIT] = stats.max_logit_H
    return lm_loss + balance + metrics.get("mtp_loss", 0.0), metrics

  return loss_fn


def make_gradients(graphdef: nnx.GraphDef, config: Config) -> Callable:
  """gradients(params, rest, batch, rng) -> (the parameters' gradients, the FP8 histories' next
  values, metrics): the batch's loss and its gradient, over its micro-batches: one after another,
  or with pipeline stages all through the stages at once. `rng`: the step's key for training
  noise, or None for none."""
  if config.parallel.pipeline > 1 and config.parallel.schedule != "gpipe":
    return make_pipelined_gradients(graphdef, config)
  loss_fn = make_loss_fn(graphdef, config)

  def split_loss(params, histories, others, *args):
    return loss_fn(params, nnx.merge_state(histories, others), *args)

  # FP8 delayed scaling: the backward pass hands each amax history's next value out as its
  # "gradient" (jmoe/ops/fp8.py), so the histories are differentiated alongside the parameters.
  grad_fn = jax.value_and_grad(split_loss, argnums=(0, 1), has_aux=True)
  micro, num_micro = config.train.micro_batch, config.train.num_micro_batches
  in_one = num_micro == 1 or config.parallel.pipeline > 1

  def gradients(params, rest, batch, rng):
    counts = target_counts(batch, config.model.mtp_depth)
    histories, others = nnx.split_state(rest, Fp8History, ...)

    def one(micro_batch, index, num):
      key = None if rng is None else jax.random.fold_in(rng, index)
      (loss, metrics), (grads, new_histories) = grad_fn(
          params, histories, others, micro_batch, counts, num, key)
      return grads, new_histories, {"loss": loss, **metrics}

    if in_one:  # (the pipeline's statistics are means over the micro-batches already)
      return one(batch, 0, 1)
    micro_batches = jax.tree.map(lambda x: x.reshape(num_micro, micro, *x.shape[1:]), batch)

    def accumulate(carry, xs):
      grads, new_histories, metrics = one(*xs, num_micro)
      # Every micro-batch pushes onto the same history: the largest of their amaxes is kept.
      return (jax.tree.map(jnp.add, carry[0], grads), jax.tree.map(jnp.maximum, carry[1],
                                                                    new_histories),
              {k: (jnp.maximum if k == MAX_LOGIT else jnp.add)(carry[2][k], v)
               for k, v in metrics.items()}), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(
        one, jax.tree.map(lambda x: x[0], micro_batches), 0, num_micro))
    if MAX_LOGIT in zeros[2]:
      zeros[2][MAX_LOGIT] = jnp.full_like(zeros[2][MAX_LOGIT], -jnp.inf)
    (grads, histories, metrics), _ = jax.lax.scan(accumulate, zeros,
                                                  (micro_batches, jnp.arange(num_micro)))
    return grads, histories, metrics

  return gradients


def make_train_step(graphdef: nnx.GraphDef, config: Config,
                    optimizer: AdamW,
                    schedule: optax.Schedule) -> Callable[[TrainState, dict], tuple]:
  gradients = make_gradients(graphdef, config)
  bias_rate = config.moe.balance.bias_update_rate
  step_key = jax.random.key(config.train.seed + 1)  # training noise; distinct from the init key

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    rng = jax.random.fold_in(step_key, state.step)
    grads, histories, metrics = gradients(state.params, state.rest, batch, rng)
    others = nnx.split_state(state.rest, Fp8History, ...)[1]

    # Pipeline stages split the stacks' layers over devices: a layer's slice would move.
    metrics["grad_norm"] = global_norm(grads, by_layer=config.parallel.pipeline == 1)
    metrics["lr"] = schedule(state.step)
    # A step whose gradient is not finite (as a non-finite loss makes it) changes nothing but
    # the step count: its update is selected away inside the optimizer's own pass over the
    # parameters (no extra pass). A non-finite loss counts as a bad step in any case.
    finite = jnp.isfinite(metrics["grad_norm"])
    metrics["skipped"] = 1.0 - (finite & jnp.isfinite(metrics["loss"])).astype(jnp.float32)
    with jax.named_scope("optimizer"):
      params, opt_state = optimizer.apply(grads, state.opt_state, state.params,
                                          metrics["grad_norm"], applied=finite)
    base, others = nnx.split_state(others, frozen(config), ...)  # the frozen model passes by
    rest = nnx.merge_state(histories, others)
    top_LH = metrics.pop(MAX_LOGIT, None)
    # FP8: the expert weights' amaxes for the next step, from the weights just updated (XLA
    # reads them in the update's own pass); frozen weights (LoRA) keep theirs.
    keep_amax = not config.lora.rank and bool(jax.tree.leaves(nnx.filter_state(rest, WeightAmax)))
    if bias_rate > 0 or top_LH is not None or keep_amax:
      model = nnx.merge(graphdef, params, base, rest)
      if bias_rate > 0:  # aux-loss-free balancing, outside the gradient
        model.update_expert_bias(metrics["expert_load"], bias_rate)
      if top_LH is not None:  # QK-clip, after the update (none on a skipped step)
        metrics[MAX_LOGIT] = jnp.max(top_LH, axis=-1)
        eta_LH = jnp.where(finite, clip_factors(top_LH, config.train.qk_clip), 1.0)
        model.clip_attention_logits(eta_LH, config.train.qk_clip_alpha)
        params = nnx.state(model, trainable(config))
      if keep_amax:  # (after QK-clip, which changes attention weights only)
        keep_weight_amax(model)
      rest = nnx.state(model, nnx.Not(nnx.Param))
    old = nnx.split_state(state.rest, frozen(config), ...)[1]
    rest = jax.tree.map(lambda new, old: jnp.where(finite, new, old), rest, old)
    rest = nnx.merge_state(base, rest)
    new_state = state.replace(step=state.step + 1, params=params, rest=rest, opt_state=opt_state)
    return new_state, metrics

  return train_step


def compile_train_step(config: Config, layout: Layout, spec: StateSpec,
                       optimizer: AdamW, batch: dict,
                       compiler_options: dict | None = None, *,
                       documents: int | None = None) -> jax.stages.Compiled:
  """The train step compiled for `layout`: the state placed as `spec` says and donated, the batch
  split as `layout.batch` (`batch`: arrays or ShapeDtypeStructs, for the shapes), with XLA's
  `compiler_options` if given; with pipeline stages on `auto`, the schedule `fitting_schedule`
  picks. `documents`: see `fitting_schedule`."""
  return fitting_schedule(config, layout, spec, optimizer, batch, compiler_options,
                          documents=documents)[1]


def documents_bound(config: Config, documents: int | None = None) -> int | None:
  """The documents per row to compile a train step for (`fitting_schedule`'s `documents`): in a
  run of one process on GPUs, `model.attention_max_documents`, unless `documents` (the most a
  row of the batch holds, counted on the host) is more; else None. With several processes each
  counts only its own rows, and all must run the same program, so the step decides on the
  device there; elsewhere than on GPUs the attention kernel has no branch to leave out."""
  bound = config.model.attention_max_documents
  if (jax.process_count() > 1 or jax.default_backend() != "gpu"
      or (documents is not None and documents > bound)):
    return None
  return bound


def compiled_peak(compiled: jax.stages.Compiled) -> int:
  """Bytes the compiled step takes per device: its arguments (the state, donated, and the
  batch), the outputs that do not reuse them, and its temporaries (XLA's memory analysis)."""
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


def device_memory() -> int | None:
  """The memory XLA may use on one device, or None where the platform sets no limit (CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def fitting_schedule(config: Config, layout: Layout, spec: StateSpec, optimizer: AdamW,
                     batch: dict, compiler_options: dict | None = None,
                     memory: int | None = None, *,
                     documents: int | None = None) -> tuple[Config, jax.stages.Compiled]:
  """(the config with its pipeline schedule resolved, its compiled step). With pipeline stages
  and `parallel.pipeline_schedule=auto`: GPipe's step (no recomputation: the fastest) if it
  needs no more than `memory` bytes per device (default: the device's limit, where it has one),
  else the schedule the stages bound (1F1B, or interleaved with repeats), compiled in its place;
  GPipe stays where no bounded schedule runs or under QK-clip (GPipe only), with a warning.
  `documents`: the step is only for batches whose rows hold at most that many documents each
  (counted on the host; `documents_bound`), so that cuDNN's packed attention runs with no
  branch on the device (jmoe/ops/attention_kernels.py); None: for any batch."""
  if layout.stages == 1 or config.parallel.pipeline_schedule != "auto":
    return config, _compile(config, layout, spec, optimizer, batch, compiler_options, documents)
  micro = config.train.num_micro_batches
  with_schedule = lambda name: dataclasses.replace(config, parallel=dataclasses.replace(
      config.parallel, pipeline_schedule=name))
  gpipe = with_schedule("gpipe")
  compiled = _compile(gpipe, layout, spec, optimizer, batch, compiler_options, documents)
  memory = device_memory() if memory is None else memory
  need = compiled_peak(compiled)
  if memory is None or need <= memory:
    return gpipe, compiled
  bounded = config.parallel.bounded_schedule(micro)
  gib = lambda b: f"{b / 2**30:.1f} GiB"
  if bounded is None or config.train.qk_clip:
    log.warning("pipeline_schedule=auto: GPipe's step needs %s per device, more than the %s it "
                "has, and %s; it stays on GPipe", gib(need), gib(memory),
                "train.qk_clip runs on GPipe only" if config.train.qk_clip else
                f"no bounded schedule runs {micro} micro-batches over {layout.stages} stages x "
                f"{layout.repeats} repeats (interleaved needs a multiple of the stages)")
    return gpipe, compiled
  chosen = with_schedule(bounded)
  compiled = _compile(chosen, layout, spec, optimizer, batch, compiler_options, documents)
  log.info("pipeline_schedule=auto: GPipe's step needs %s per device, more than the %s it has: "
           "%s instead (%s)", gib(need), gib(memory), bounded, gib(compiled_peak(compiled)))
  return chosen, compiled


def _compile(config: Config, layout: Layout, spec: StateSpec, optimizer: AdamW, batch: dict,
             compiler_options: dict | None, documents: int | None) -> jax.stages.Compiled:
  step = make_train_step(spec.graphdef, config, optimizer, learning_rate(config.train))
  # (the model's sharding annotations read the layout while tracing, the attention the bound)
  with layout.active(), documents_per_row(documents):
    return jax.jit(step, in_shardings=(spec.shardings, layout.batch),
                   out_shardings=(spec.shardings, layout.replicated),
                   donate_argnums=0).lower(spec.abstract, batch).compile(compiler_options)


def make_eval_step(graphdef: nnx.GraphDef, config: Config) -> Callable:
  """eval(params, rest, batch) -> (mean next-token loss, number of targets), no noise."""
  loss_fn = make_loss_fn(graphdef, config)

  def eval_step(params, rest, batch):
    counts = target_counts(batch, config.model.mtp_depth)
    _, metrics = loss_fn(params, rest, batch, counts, 1)
    return metrics["lm_loss"], counts["lm"]

  return eval_step


def evaluation_loss(eval_fn, state: TrainState, batches: list[dict]) -> float:
  """The mean next-token loss over every target of the held-out batches."""
  results = jax.device_get([eval_fn(state.params, state.rest, batch) for batch in batches])
  total = sum(float(count) for _, count in results)
  return sum(float(loss) * float(count) for loss, count in results) / max(total, 1.0)
