"""The batch's loss and gradient with pipeline stages in 1F1B order (interleaved with repeats):
the embedding and the dense layers first run on the whole batch before the stages' loop (their
gradient after it, from the stack input's gradient); the head, the loss and the MTP modules run
on each micro-batch as it leaves the last stage, inside the loop (jmoe/model/pipeline_1f1b.py),
so that its backward pass can start at once. Outside the stages' programs the stage axis is a
data axis, as under GPipe: the head and MTP modules of a micro-batch run on every device."""

from __future__ import annotations

import logging
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import Config
from jmoe.model.block import RESIDUAL_AXES
from jmoe.model.factory import DTYPES
from jmoe.model.pipeline_1f1b import pipeline_value_and_grad
from jmoe.model.stages import Schedule, slots_of
from jmoe.ops.fp8 import Fp8History
from jmoe.parallel import active_layout
from jmoe.train.loss import (balance_losses, head_nll, mtp_inputs, mtp_loss, router_metrics,
                             target_counts, target_masks)
from jmoe.train.state import trainable

STACK = "moe_blocks"  # the model's stack that the stages split

log = logging.getLogger("jmoe")


def make_pipelined_gradients(graphdef: nnx.GraphDef, config: Config) -> Callable:
  """gradients(params, rest, batch, rng) -> (gradients, FP8 histories, metrics), as
  `make_gradients` gives them, under a 1F1B schedule."""
  depth, balance_cfg = config.model.mtp_depth, config.moe.balance
  compute_dtype = DTYPES[config.precision.compute]
  M, micro = config.train.num_micro_batches, config.train.micro_batch
  rounds_possible = config.moe.dispatcher == "alltoall" and config.parallel.expert.expert != 1

  def gradients(params, rest, batch, rng):
    counts = target_counts(batch, depth)
    histories = nnx.split_state(rest, Fp8History, ...)[0]  # (refused with stages: unchanged)
    stack_params = params[STACK]
    head_params = nnx.State({k: v for k, v in params.items() if k != STACK})
    model_of = lambda head: nnx.merge(graphdef, head, nnx.State({STACK: stack_params}), rest)
    key = None if rng is None else jax.random.fold_in(rng, 0)  # as the GPipe step's
    tokens_BN = batch["tokens"]
    tokens_BS = tokens_BN[:, :-1]
    positions_BS = (batch["positions"][:, :-1] if "positions" in batch else
                    jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]), tokens_BS.shape))
    segments_BS = batch["segment_ids"][:, :-1] if "segment_ids" in batch else None
    x_BSD, front_grad = jax.vjp(
        lambda head: model_of(head).front(tokens_BS, positions_BS, segments_BS), head_params)

    def tail(head, trunk_BSD, m):
      """Micro-batch m's share of the loss from its trunk output, and its parts."""
      model = model_of(head)
      rows = lambda a: None if a is None else jax.lax.dynamic_slice_in_dim(a, m * micro, micro)
      part = {k: rows(v) for k, v in batch.items()}
      lm_mask_BS, mtp_mask_BLS = target_masks(part["tokens"], part.get("segment_ids"), depth,
                                              part.get("loss_mask"))
      nll_sum = head_nll(model.head_weights(compute_dtype))
      lm = nll_sum(model.final_norm(trunk_BSD), part["tokens"][:, 1:], lm_mask_BS) / counts["lm"]
      if not depth:
        return lm, {"lm_loss": lm}
      mtp_BLSD, mtp_stats = model.mtp_outputs(
          trunk_BSD, mtp_inputs(part["tokens"], depth), rows(positions_BS), rows(segments_BS),
          rng=None if key is None else jax.random.fold_in(key, m))
      mtp = mtp_loss(mtp_BLSD, part["tokens"], mtp_mask_BLS, counts["mtp"],
                     config.train.mtp_loss_weight, nll_sum)
      balance, _ = router_metrics(mtp_stats.router, balance_cfg, M, rounds_possible)
      return lm + mtp + balance, {"lm_loss": lm, "mtp_loss": mtp, "mtp_stats": mtp_stats}

    model = model_of(head_params)
    loss, parts, stats, d_stack, d_tail, dx_BSD = pipeline_value_and_grad(
        model.moe_blocks, active_layout(), x_BSD, positions_BS, segments_BS, tail, head_params,
        lambda s: sum(balance_losses(s.router, balance_cfg)), wrt=trainable(config), micro_batches=M,
        remat=config.train.remat, rng=key, first_layer=model.first_moe_layer,
        unroll=config.model.scan_unroll, axes=RESIDUAL_AXES)
    d_head = jax.tree.map(jnp.add, front_grad(dx_BSD)[0], d_tail)
    grads = nnx.merge_state(d_head, nnx.State({STACK: d_stack}))
    if depth:  # the MTP modules' stats after the stack's, as means over micro-batches
      stats = jax.tree.map(lambda a, b: jnp.concatenate([a, b / M]), stats, parts["mtp_stats"])
    _, router = router_metrics(stats.router, balance_cfg, 1, rounds_possible)
    metrics = {"loss": loss, **{k: v for k, v in parts.items() if k != "mtp_stats"}, **router}
    return grads, histories, metrics

  return gradients


def log_pipeline(config: Config, layout) -> None:
  """The pipeline's schedule (resolved), bubble, micro-batches in flight and stage balance."""
  micro = config.train.num_micro_batches
  sched = Schedule(layout.stages, layout.repeats, micro, config.parallel.schedule)
  log.info("pipeline: %d micro-batches through %d stages x %d repeat(s), %s: bubble %.1f%% "
           "((S - 1) / (R M + S - 1)), %d micro-batches in flight per stage; %s", micro,
           layout.stages, layout.repeats, sched.kind, 100 * sched.bubble, sched.in_flight,
           slots_of(layout, config.moe_layers).describe())
  if sched.kind != "gpipe" and config.train.remat != "none":
    log.info("pipeline: train.remat=%s under %s: each backward slot recomputes its stage's "
             "forward pass from the stage's input, and inside it the policy recomputes what it "
             "does not keep a second time; train.remat=none recomputes once (the least work) and "
             "keeps one stage visit's activations during its backward slot "
             "(scripts/estimate_memory.py says whether they fit)",
             config.train.remat, sched.kind)
