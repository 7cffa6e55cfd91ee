"""Checks on a whole `Config`, once, with messages that name the key and say what to change.

A key that names a variant from a registry is checked against that registry's own names: the
kernels and policies of jmoe/ops/ here; the dispatchers (`moe.dispatcher`) by the MoE layer when it
is built, and the Hugging Face families (`model.family`) by the trainer and the converters, whose
packages sit above this one. Checks that need the devices (does a layout fit them?) live with the
mesh in jmoe/parallel/.
"""

from __future__ import annotations

import dataclasses
import math

from jmoe.config.schema import LORA_TARGETS, Config
from jmoe.errors import ConfigError, not_one_of
from jmoe.ops.activations import GATED_ACTIVATIONS
from jmoe.ops.attention import ATTENTION_KERNELS
from jmoe.ops.fp8 import FORMATS
from jmoe.ops.grouped_gemm import GEMM_BACKENDS
from jmoe.ops.params import DTYPES
from jmoe.ops.remat import REMAT_POLICIES

ROUTER_SCORES = ("softmax", "softmax_topk", "sigmoid")
AUX_LOSS_TYPES = ("global", "micro_batch", "seq")
DROP_POLICIES = ("probability", "position")
PACKINGS = ("concat", "none")
ATTENTIONS = ("gqa", "mla")


def validate(config: Config) -> None:
  problems = [*_finite(config), *_model(config), *_moe(config), *_train(config), *_data(config),
              *_other(config), *_lora(config)]
  if problems:
    raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


def _finite(node, prefix: str = ""):
  """Every float in the config is a finite number (`1e999` parses as inf, `nan` as NaN)."""
  for field in dataclasses.fields(node):
    value = getattr(node, field.name)
    if dataclasses.is_dataclass(value):
      yield from _finite(value, f"{prefix}{field.name}.")
    elif isinstance(value, float) and not math.isfinite(value):
      yield f"{prefix}{field.name} must be a finite number, got {value}"


def _positive(group: str, obj, *names: str):
  for name in names:
    if getattr(obj, name) <= 0:
      yield f"{group}.{name} must be positive, got {getattr(obj, name)}"


def _one_of(key: str, value, allowed):
  if value not in allowed:
    yield not_one_of(key, value, allowed)


def _model(config: Config):
  m = config.model
  yield from _positive("model", m, "vocab_size", "d_model", "num_layers", "num_heads",
                       "num_kv_heads", "head_dim", "d_ff", "rope_theta", "norm_eps", "init_std",
                       "scan_unroll")
  if m.num_kv_heads > 0 and m.num_heads % m.num_kv_heads:
    yield (f"model.num_heads ({m.num_heads}) must be a multiple of model.num_kv_heads "
           f"({m.num_kv_heads}): each key/value head serves a whole group of query heads")
  if m.head_dim % 2:
    yield f"model.head_dim must be even for rotary embeddings, got {m.head_dim}"
  if m.sliding_window < 0 or m.full_attention_every < 0 or m.mtp_depth < 0:
    yield "model.sliding_window, model.full_attention_every and model.mtp_depth must be >= 0"
  yield from _one_of("model.attention", m.attention, ATTENTIONS)
  yield from _one_of("model.attention_kernel", m.attention_kernel, ["auto", *ATTENTION_KERNELS])
  if m.attention == "mla":
    yield from _positive("model.mla", m.mla, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                         "v_head_dim")
    if m.mla.qk_rope_head_dim % 2:
      yield f"model.mla.qk_rope_head_dim must be even, got {m.mla.qk_rope_head_dim}"
  if m.yarn.factor < 1:
    yield f"model.yarn.factor must be >= 1 (1: no YaRN scaling), got {m.yarn.factor}"


def _moe(config: Config):
  moe = config.moe
  yield from _positive("moe", moe, "num_experts", "top_k", "d_ff_expert")
  if moe.top_k > moe.num_experts:
    yield (f"moe.top_k ({moe.top_k}) is larger than moe.num_experts ({moe.num_experts}); "
           f"choose top_k <= num_experts")
  if moe.num_shared_experts < 0:
    yield f"moe.num_shared_experts must be >= 0, got {moe.num_shared_experts}"
  if not 0 <= moe.first_k_dense <= config.model.num_layers:
    yield (f"moe.first_k_dense ({moe.first_k_dense}) must be in [0, model.num_layers] = "
           f"[0, {config.model.num_layers}] (all layers dense: a dense model)")
  yield from _one_of("moe.gemm", moe.gemm, ["auto", *GEMM_BACKENDS])
  if moe.dispatch_factor < 1:
    yield (f"moe.dispatch_factor must be >= 1 (a multiple of the mean load per peer), got "
           f"{moe.dispatch_factor}")
  if moe.dispatch_chunks < 1:
    yield f"moe.dispatch_chunks must be positive, got {moe.dispatch_chunks}"
  if moe.expert_blocks < 0:
    yield f"moe.expert_blocks must be >= 0 (0: off), got {moe.expert_blocks}"
  yield from _one_of("moe.router.score", moe.router.score, ROUTER_SCORES)
  yield from _one_of("moe.balance.aux_loss_type", moe.balance.aux_loss_type, AUX_LOSS_TYPES)
  yield from _one_of("moe.drop_policy", moe.drop_policy, DROP_POLICIES)
  yield from _one_of("moe.activation", moe.activation, GATED_ACTIVATIONS)
  for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
    if getattr(moe.balance, name) < 0:
      yield f"moe.balance.{name} must be >= 0, got {getattr(moe.balance, name)}"
  if moe.capacity_factor is not None and moe.capacity_factor < 0:
    yield f"moe.capacity_factor must be None, 0 (dropless) or positive, got {moe.capacity_factor}"
  if not 0 <= moe.router.jitter < 1:
    yield f"moe.router.jitter must be in [0, 1), got {moe.router.jitter}"
  if moe.router.scaling_factor <= 0:
    yield f"moe.router.scaling_factor must be positive, got {moe.router.scaling_factor}"
  groups, top_groups = moe.router.num_groups, moe.router.topk_groups
  if groups < 1 or moe.num_experts % groups:
    yield (f"moe.router.num_groups ({groups}) must divide moe.num_experts ({moe.num_experts})")
  elif groups > 1:
    per_group = moe.num_experts // groups
    if per_group < 2:
      yield (f"moe.router.num_groups ({groups}) leaves {per_group} expert per group; groups are "
             f"scored by their two best experts, so use at most {moe.num_experts // 2} groups")
    if not 1 <= top_groups <= groups:
      yield f"moe.router.topk_groups ({top_groups}) must be in [1, num_groups={groups}]"
    elif moe.top_k > top_groups * per_group:
      yield (f"moe.top_k ({moe.top_k}) is more than the {top_groups} x {per_group} experts in the "
             f"chosen groups; raise moe.router.topk_groups")


def _train(config: Config):
  t = config.train
  yield from _positive("train", t, "steps", "batch_size", "log_every", "lr", "max_bad_steps")
  if t.micro_batch <= 0 or t.batch_size % t.micro_batch:
    yield (f"train.batch_size ({t.batch_size}) must be a multiple of train.micro_batch_size "
           f"({t.micro_batch_size}); use a divisor of the batch size, or 0 for no accumulation")
  if not 0 <= t.warmup_steps < t.steps:
    yield f"train.warmup_steps ({t.warmup_steps}) must be in [0, train.steps) = [0, {t.steps})"
  if not 0 <= t.min_lr_ratio <= 1:
    yield f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}"
  if t.grad_clip < 0 or t.weight_decay < 0:
    yield "train.grad_clip and train.weight_decay must be >= 0"
  yield from _one_of("train.remat", t.remat, REMAT_POLICIES)


def _data(config: Config):
  d = config.data
  yield from _positive("data", d, "seq_len", "max_corpus_bytes", "eval_batches")
  yield from _one_of("data.packing", d.packing, PACKINGS)
  if not d.source.strip():
    yield "data.source is empty: name files or directories, or use stdlib"
  if not 0 <= d.eval_fraction < 1:
    yield f"data.eval_fraction must be in [0, 1), got {d.eval_fraction}"
  if config.train.eval_every and not d.eval_fraction:
    yield "train.eval_every needs held-out documents: set data.eval_fraction (e.g. 0.01)"
  if config.train.eval_every < 0 or d.prefetch < 0:
    yield "train.eval_every and data.prefetch must be >= 0"


BLACKWELL_FORMATS = ("mxfp8", "nvfp4")


def _precision(p):
  if p.gemm in BLACKWELL_FORMATS:
    yield (f"precision.gemm={p.gemm} is a block-scaled format of NVIDIA Blackwell GPUs (sm_100 and "
           "newer); jmoe does not run it yet (docs/FP8.md has the plan). On Hopper use "
           "precision.gemm=fp8, or bf16")
    return
  yield from _one_of("precision.gemm", p.gemm, ("bf16", "fp8"))
  yield from _one_of("precision.fp8_recipe", p.fp8_recipe, ("current", "delayed"))
  yield from _one_of("precision.fp8_grad_format", p.fp8_grad_format, FORMATS)
  if p.fp8_amax_history < 1:
    yield f"precision.fp8_amax_history must be >= 1, got {p.fp8_amax_history}"
  if p.gemm != "fp8" and p.fp8_dispatch:
    yield "precision.fp8_dispatch needs precision.gemm=fp8"


def _other(config: Config):
  yield from _one_of("precision.params", config.precision.params, DTYPES)
  yield from _one_of("precision.compute", config.precision.compute, DTYPES)
  yield from _one_of("precision.moments", config.precision.moments, DTYPES)
  yield from _precision(config.precision)
  for group in ("dense", "expert"):
    layout = getattr(config.parallel, group)
    sizes = {k: v for k, v in vars(layout).items()}
    for name, size in sizes.items():
      if size == 0 or size < -1:
        yield f"parallel.{group}.{name} must be -1 (the rest of the devices) or positive, got {size}"
    if list(sizes.values()).count(-1) > 1:
      yield f"parallel.{group}: at most one size may be -1, got {sizes}"
  yield from _pipeline(config)
  if config.moe.num_experts % max(config.parallel.expert.expert, 1):
    yield (f"moe.num_experts ({config.moe.num_experts}) must be a multiple of "
           f"parallel.expert.expert ({config.parallel.expert.expert})")
  if config.checkpoint.every < 0 or config.checkpoint.keep < 1:
    yield "checkpoint.every must be >= 0 and checkpoint.keep >= 1"
  if config.checkpoint.load_params_config and not config.checkpoint.load_params:
    yield ("checkpoint.load_params_config takes the model's architecture from "
           "checkpoint.load_params: name that checkpoint (--config.checkpoint.load_params=CKPT)")


def _lora(config: Config):
  lora = config.lora
  if lora.rank < 0:
    yield f"lora.rank must be >= 0 (0: no adapters), got {lora.rank}"
  if lora.rank <= 0:
    return
  targets = [t.strip() for t in lora.targets.split(",") if t.strip()]
  unknown = [t for t in targets if t not in LORA_TARGETS]
  if unknown or not targets:
    yield (f"lora.targets names {unknown or 'nothing'}; give a comma-separated list of "
           f"{', '.join(LORA_TARGETS)}")
  if lora.alpha <= 0:
    yield f"lora.alpha must be positive, got {lora.alpha}"
  if not config.checkpoint.load_params:
    yield ("lora.rank > 0 trains adapters on a frozen model, read from checkpoint.load_params "
           "(and read again on resume: the run's checkpoints hold only the adapters): name it")


def _pipeline(config: Config):
  p = config.parallel
  if p.pipeline < 1 or p.pipeline_repeats < 1:
    yield (f"parallel.pipeline ({p.pipeline}) and parallel.pipeline_repeats "
           f"({p.pipeline_repeats}) must be >= 1")
    return
  if p.pipeline == 1:
    if p.pipeline_repeats > 1:
      yield "parallel.pipeline_repeats > 1 needs pipeline stages: set parallel.pipeline > 1"
    return
  moe_layers = config.model.num_layers - config.moe.first_k_dense
  groups = p.pipeline * p.pipeline_repeats
  if moe_layers <= 0:
    yield ("parallel.pipeline splits the MoE layers into stages, and this model has none "
           "(moe.first_k_dense = model.num_layers)")
  elif moe_layers % groups:
    yield (f"the {moe_layers} MoE layers do not split into parallel.pipeline x "
           f"parallel.pipeline_repeats = {groups} equal groups; choose stages and repeats whose "
           f"product divides {moe_layers}")
  micro = config.train.num_micro_batches
  if p.pipeline_repeats > 1 and micro < p.pipeline:
    yield (f"circular stages (parallel.pipeline_repeats > 1) need at least as many micro-batches "
           f"as stages: train.batch_size / train.micro_batch_size is {micro}, parallel.pipeline "
           f"is {p.pipeline}; lower train.micro_batch_size")
  if config.precision.gemm == "fp8" and config.precision.fp8_recipe == "delayed":
    yield ("precision.fp8_recipe=delayed keeps one amax history per GEMM, which every micro-batch "
           "in the pipeline's stages would update at once: use fp8_recipe=current with "
           "parallel.pipeline > 1")
