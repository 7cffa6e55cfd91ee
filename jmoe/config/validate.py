"""Checks on a whole `Config`, once, with messages that name the key and say what to change.

Every number of the schema has its range in `RANGES`, checked here and nowhere else; the checks
after it are those between keys (top_k <= num_experts, warmup before the last step, ...).

A key that names a variant from a registry is checked against that registry's own names: the
kernels and policies of jmoe/ops/ here; the dispatchers (`moe.dispatcher`) by the MoE layer when it
is built, and the Hugging Face families (`model.family`) by the trainer and the converters, whose
packages sit above this one. Checks that need the devices (does a layout fit them?) live with the
mesh in jmoe/parallel/.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import NamedTuple

from jmoe.config.layout import PIPELINE_SCHEDULES
from jmoe.config.schema import LORA_TARGETS, OPTIMIZERS, Config
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
  problems = [*_numbers(config), *_model(config), *_moe(config), *_train(config),
              *_data(config), *_other(config), *_lora(config)]
  if problems:
    raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


# ---- every number's range, checked here once

INT32 = 2**31 - 1  # sizes, counts and ids are int32 in the compiled step (token ids, indices)


class Range(NamedTuple):
  """An interval such as "[0, 1)" or "(0, inf)"; INT stands for the int32 limit."""
  text: str
  note: str = ""  # what some values mean, e.g. "0: off"

  def bounds(self) -> tuple[float, float]:
    low, high = re.fullmatch(r"[\[(](.+), (.+)[\])]", self.text).groups()
    number = lambda t: INT32 if t == "INT" else float(t)
    return number(low), number(high)

  def __contains__(self, value) -> bool:
    low, high = self.bounds()
    above = value > low if self.text[0] == "(" else value >= low
    below = value < high if self.text[-1] == ")" else value <= high
    return above and below

  def describe(self) -> str:
    low, _ = self.bounds()
    interval = self.text.replace("INT", str(INT32))
    positive = (self.text.startswith("(0,") or self.text.startswith("[1,")
                and self.text.endswith("INT]"))
    note = f" ({self.note})" if self.note else ""
    return f"positive, in {interval}{note}" if positive else f"in {interval}{note}"


# Every int and float of the schema (tests/test_bad_inputs.py holds this table to the schema).
RANGES = {
    "model.vocab_size": Range("[1, INT]"), "model.d_model": Range("[1, INT]"),
    "model.num_layers": Range("[1, INT]"), "model.num_heads": Range("[1, INT]"),
    "model.num_kv_heads": Range("[1, INT]"), "model.head_dim": Range("[1, INT]"),
    "model.d_ff": Range("[1, INT]"),
    "model.rope_theta": Range("(1, inf)", "the base of the rotary wavelengths"),
    "model.norm_eps": Range("(0, inf)"), "model.init_std": Range("(0, inf)"),
    "model.sliding_window": Range("[0, INT]", "0: no window"),
    "model.full_attention_every": Range("[0, INT]", "0: every layer windowed"),
    "model.mtp_depth": Range("[0, INT]"), "model.scan_unroll": Range("[1, INT]"),
    "model.attention_max_documents": Range("[1, INT]"),
    "model.mla.q_lora_rank": Range("[0, INT]", "0: no query latent"),
    "model.mla.kv_lora_rank": Range("[1, INT]"), "model.mla.qk_nope_head_dim": Range("[1, INT]"),
    "model.mla.qk_rope_head_dim": Range("[1, INT]"), "model.mla.v_head_dim": Range("[1, INT]"),
    "model.yarn.factor": Range("[1, inf)", "1: no YaRN scaling"),
    "model.yarn.original_max_len": Range("[1, INT]"),
    "model.yarn.beta_fast": Range("(0, inf)"), "model.yarn.beta_slow": Range("(0, inf)"),
    "model.yarn.mscale": Range("[0, inf)"),
    "model.yarn.mscale_all_dim": Range("[0, inf)", "0: off"),
    "moe.num_experts": Range("[1, INT]"), "moe.top_k": Range("[1, INT]"),
    "moe.d_ff_expert": Range("[1, INT]"), "moe.num_shared_experts": Range("[0, INT]"),
    "moe.first_k_dense": Range("[0, INT]"),
    "moe.dispatch_factor": Range("[1, inf)", "a multiple of the mean load per peer"),
    "moe.dispatch_chunks": Range("[1, INT]"),
    "moe.capacity_factor": Range("[0, inf)", "None or 0: dropless"),
    "moe.expert_blocks": Range("[0, inf)", "0: off"),
    "moe.swiglu_limit": Range("(0, inf)"), "moe.swiglu_alpha": Range("(0, inf)"),
    "moe.router.scaling_factor": Range("(0, inf)"), "moe.router.num_groups": Range("[1, INT]"),
    "moe.router.topk_groups": Range("[1, INT]"), "moe.router.jitter": Range("[0, 1)", "0: off"),
    "moe.balance.aux_loss_coef": Range("[0, inf)"), "moe.balance.z_loss_coef": Range("[0, inf)"),
    "moe.balance.bias_update_rate": Range("[0, inf)", "0: off"),
    **{f"parallel.{group}.{name}": Range("[-1, INT]", "-1: the rest of the devices")
       for group, names in (("dense", ("data", "fsdp", "context", "tensor")),
                            ("expert", ("data", "expert", "tensor"))) for name in names},
    "parallel.pipeline": Range("[1, INT]"), "parallel.pipeline_repeats": Range("[1, INT]"),
    **{f"parallel.pipeline_{end}": Range("[0, INT]", "0: as even as possible")
       for end in ("first", "last")},
    "train.steps": Range("[1, INT]"), "train.batch_size": Range("[1, INT]"),
    "train.micro_batch_size": Range("[0, INT]", "0: the whole batch at once"),
    "train.seed": Range("[0, INT]"), "train.lr": Range("(0, inf)"),
    "train.min_lr_ratio": Range("[0, 1]"), "train.warmup_steps": Range("[0, INT]"),
    "train.weight_decay": Range("[0, inf)"), "train.b1": Range("[0, 1)"),
    "train.b2": Range("[0, 1)"), "train.eps": Range("(0, inf)"),
    "train.grad_clip": Range("[0, inf)", "0: off"), "train.muon_momentum": Range("[0, 1)"),
    "train.qk_clip": Range("[0, inf)", "None or 0: off"), "train.qk_clip_alpha": Range("[0, 1]"),
    "train.mtp_loss_weight": Range("[0, inf)"),
    "train.log_every": Range("[1, INT]"), "train.max_bad_steps": Range("[1, INT]"),
    "train.eval_every": Range("[0, INT]", "0: no evaluation"),
    "data.seq_len": Range("[1, INT]"), "data.eval_fraction": Range("[0, 1)"),
    "data.eval_batches": Range("[1, INT]"), "data.prefetch": Range("[0, INT]"),
    "data.max_corpus_bytes": Range("[1, INT]"),
    "precision.fp8_amax_history": Range("[1, INT]"),
    "checkpoint.every": Range("[0, INT]", "0: only the final save"),
    "checkpoint.keep": Range("[1, INT]"),
    "checkpoint.write_threads": Range("[0, INT]", "0: half the process's cores less one"),
    "checkpoint.staging_gb": Range("[0, inf)", "0: the whole state at once"),
    "lora.rank": Range("[0, INT]", "0: no adapters"), "lora.alpha": Range("(0, inf)"),
}


def numbers(node, prefix: str = ""):
  """(dotted key, value) of every int and float in a config (bools are not numbers here)."""
  for field in dataclasses.fields(node):
    value = getattr(node, field.name)
    if dataclasses.is_dataclass(value):
      yield from numbers(value, f"{prefix}{field.name}.")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      yield prefix + field.name, value


def _numbers(config: Config):
  """Every number is finite (`1e999` parses as inf, `nan` as NaN) and in its key's range."""
  for key, value in numbers(config):
    if isinstance(value, float) and not math.isfinite(value):
      yield f"{key} must be a finite number, got {value}"
    elif value not in RANGES[key]:
      none = "None or " if key in ("moe.capacity_factor", "train.qk_clip") else ""
      yield f"{key} must be {none}{RANGES[key].describe()}, got {value}"


def _one_of(key: str, value, allowed):
  if value not in allowed:
    yield not_one_of(key, value, allowed)


def _model(config: Config):
  m = config.model
  if m.num_kv_heads > 0 and m.num_heads % m.num_kv_heads:
    yield (f"model.num_heads ({m.num_heads}) must be a multiple of model.num_kv_heads "
           f"({m.num_kv_heads}): each key/value head serves a whole group of query heads")
  if m.head_dim % 2:
    yield f"model.head_dim must be even for rotary embeddings, got {m.head_dim}"
  yield from _one_of("model.attention", m.attention, ATTENTIONS)
  yield from _one_of("model.attention_kernel", m.attention_kernel, ["auto", *ATTENTION_KERNELS])
  if m.attention == "mla" and m.mla.qk_rope_head_dim % 2:
    yield f"model.mla.qk_rope_head_dim must be even, got {m.mla.qk_rope_head_dim}"


def _moe(config: Config):
  moe = config.moe
  if moe.top_k > moe.num_experts:
    yield (f"moe.top_k ({moe.top_k}) is larger than moe.num_experts ({moe.num_experts}); "
           f"choose top_k <= num_experts")
  if moe.first_k_dense > config.model.num_layers:
    yield (f"moe.first_k_dense ({moe.first_k_dense}) must be in [0, model.num_layers] = "
           f"[0, {config.model.num_layers}] (all layers dense: a dense model)")
  yield from _one_of("moe.gemm", moe.gemm, ["auto", *GEMM_BACKENDS])
  yield from _one_of("moe.router.score", moe.router.score, ROUTER_SCORES)
  yield from _one_of("moe.balance.aux_loss_type", moe.balance.aux_loss_type, AUX_LOSS_TYPES)
  yield from _one_of("moe.drop_policy", moe.drop_policy, DROP_POLICIES)
  yield from _one_of("moe.activation", moe.activation, GATED_ACTIVATIONS)
  groups, top_groups = moe.router.num_groups, moe.router.topk_groups
  if groups < 1 or top_groups < 1 or moe.num_experts < 1:
    return  # (their ranges are reported)
  if moe.num_experts % groups:
    yield (f"moe.router.num_groups ({groups}) must divide moe.num_experts ({moe.num_experts})")
  elif groups > 1:
    per_group = moe.num_experts // groups
    if per_group < 2:
      yield (f"moe.router.num_groups ({groups}) leaves {per_group} expert per group; groups are "
             f"scored by their two best experts, so use at most {moe.num_experts // 2} groups")
    if top_groups > groups:
      yield f"moe.router.topk_groups ({top_groups}) must be in [1, num_groups={groups}]"
    elif moe.top_k > top_groups * per_group:
      yield (f"moe.top_k ({moe.top_k}) is more than the {top_groups} x {per_group} experts in the "
             f"chosen groups; raise moe.router.topk_groups")


def _train(config: Config):
  t = config.train
  if t.micro_batch > 0 and t.batch_size % t.micro_batch:
    yield (f"train.batch_size ({t.batch_size}) must be a multiple of train.micro_batch_size "
           f"({t.micro_batch_size}); use a divisor of the batch size, or 0 for no accumulation")
  if t.warmup_steps >= t.steps:
    yield f"train.warmup_steps ({t.warmup_steps}) must be in [0, train.steps) = [0, {t.steps})"
  yield from _one_of("train.remat", t.remat, REMAT_POLICIES)
  yield from _one_of("train.optimizer", t.optimizer, OPTIMIZERS)
  if t.qk_clip and config.model.qk_norm:
    yield ("train.qk_clip cannot work with model.qk_norm: the norms undo any scaling of the query "
           "and key projections (and bound the logits themselves); turn one of them off")
  if t.qk_clip and config.lora.rank:
    yield ("train.qk_clip scales the query and key projections, which LoRA (lora.rank > 0) keeps "
           "frozen; turn one of them off")


def _data(config: Config):
  d = config.data
  yield from _one_of("data.packing", d.packing, PACKINGS)
  if not d.source.strip():
    yield "data.source is empty: name files or directories, or use stdlib"
  if config.train.eval_every > 0 and not d.eval_fraction:
    yield "train.eval_every needs held-out documents: set data.eval_fraction (e.g. 0.01)"


BLACKWELL_FORMATS = ("mxfp8", "nvfp4")
FP8_RECIPES = ("current", "delayed", "blockwise")


def _precision(p):
  if p.gemm in BLACKWELL_FORMATS:
    yield (f"precision.gemm={p.gemm} is a block-scaled format of NVIDIA Blackwell GPUs (sm_100 and "
           "newer); jmoe does not run it yet (docs/FP8.md has the plan). On Hopper use "
           "precision.gemm=fp8, or bf16")
    return
  yield from _one_of("precision.gemm", p.gemm, ("bf16", "fp8"))
  yield from _one_of("precision.fp8_recipe", p.fp8_recipe, FP8_RECIPES)
  if p.gemm == "fp8" and p.fp8_recipe == "blockwise" and not p.fp8_experts:
    yield ("precision.fp8_recipe=blockwise scales the expert GEMMs, which "
           "precision.fp8_experts=false leaves in bf16: set fp8_experts=true or use "
           "fp8_recipe=current")
  yield from _one_of("precision.fp8_grad_format", p.fp8_grad_format, FORMATS)
  yield from _one_of("precision.fp8_weight_gradient", p.fp8_weight_gradient,
                     ("auto", "bf16", "fp8"))
  yield from _one_of("precision.fp8_promote", p.fp8_promote, ("never", "long", "always"))
  yield from _one_of("precision.fp8_weight_amax", p.fp8_weight_amax, ("kept", "each_use"))
  if p.gemm == "fp8" and not (p.fp8_dense or p.fp8_experts):
    yield ("precision.gemm=fp8 with fp8_dense=false and fp8_experts=false leaves every GEMM in "
           "bf16: set one of them true, or precision.gemm=bf16")
  if p.gemm == "fp8" and p.fp8_recipe == "delayed" and not p.fp8_dense:
    yield ("precision.fp8_recipe=delayed keeps amax histories for the dense GEMMs, which "
           "fp8_dense=false (the default) leaves in bf16 (the experts always scale from current "
           "values): set precision.fp8_dense=true, or use fp8_recipe=current")
  if p.gemm != "fp8" and p.fp8_dispatch:
    yield "precision.fp8_dispatch needs precision.gemm=fp8"


def _other(config: Config):
  yield from _one_of("precision.params", config.precision.params, DTYPES)
  yield from _one_of("precision.compute", config.precision.compute, DTYPES)
  yield from _one_of("precision.moments", config.precision.moments, DTYPES)
  yield from _precision(config.precision)
  p = config.precision
  if p.gemm == "fp8" and p.fp8_recipe == "blockwise" and config.moe.expert_blocks:
    yield ("precision.fp8_recipe=blockwise runs the expert GEMMs grouped; moe.expert_blocks "
           "would run most rows as per-row scaled blocks: set moe.expert_blocks=0")
  for group in ("dense", "expert"):
    layout = getattr(config.parallel, group)
    sizes = {k: v for k, v in vars(layout).items()}
    for name, size in sizes.items():
      if size == 0:
        yield f"parallel.{group}.{name} must be -1 (the rest of the devices) or positive, got {size}"
    if list(sizes.values()).count(-1) > 1:
      yield f"parallel.{group}: at most one size may be -1, got {sizes}"
  yield from _pipeline(config)
  if config.moe.num_experts % max(config.parallel.expert.expert, 1):
    yield (f"moe.num_experts ({config.moe.num_experts}) must be a multiple of "
           f"parallel.expert.expert ({config.parallel.expert.expert})")
  if config.checkpoint.load_params_config and not config.checkpoint.load_params:
    yield ("checkpoint.load_params_config takes the model's architecture from "
           "checkpoint.load_params: name that checkpoint (--config.checkpoint.load_params=CKPT)")


def _lora(config: Config):
  lora = config.lora
  if lora.rank <= 0:
    return
  targets = [t.strip() for t in lora.targets.split(",") if t.strip()]
  unknown = [t for t in targets if t not in LORA_TARGETS]
  if unknown or not targets:
    yield (f"lora.targets names {unknown or 'nothing'}; give a comma-separated list of "
           f"{', '.join(LORA_TARGETS)}")
  if not config.checkpoint.load_params:
    yield ("lora.rank > 0 trains adapters on a frozen model, read from checkpoint.load_params "
           "(and read again on resume: the run's checkpoints hold only the adapters): name it")


def _pipeline(config: Config):
  p = config.parallel
  yield from _one_of("parallel.pipeline_schedule", p.pipeline_schedule,
                     ["auto", *PIPELINE_SCHEDULES])
  if p.pipeline < 1 or p.pipeline_repeats < 1 or config.train.micro_batch < 1:
    return  # (their ranges are reported)
  if p.pipeline == 1:
    if p.pipeline_repeats > 1:
      yield "parallel.pipeline_repeats > 1 needs pipeline stages: set parallel.pipeline > 1"
    if p.pipeline_layers or p.pipeline_first or p.pipeline_last:
      yield ("parallel.pipeline_layers, pipeline_first and pipeline_last assign layers to "
             "pipeline stages: set parallel.pipeline > 1")
    return
  moe_layers = config.moe_layers
  if moe_layers <= 0:
    yield ("parallel.pipeline splits the MoE layers into stages, and this model has none "
           "(moe.first_k_dense = model.num_layers)")
  elif p.pipeline_first >= 0 and p.pipeline_last >= 0:  # (else their ranges are reported)
    try:
      p.layer_groups(moe_layers)
    except ConfigError as e:
      yield str(e)
  micro = config.train.num_micro_batches
  if p.pipeline_repeats > 1 and micro < p.pipeline:
    yield (f"circular stages (parallel.pipeline_repeats > 1) need at least as many micro-batches "
           f"as stages: train.batch_size / train.micro_batch_size is {micro}, parallel.pipeline "
           f"is {p.pipeline}; lower train.micro_batch_size")
  schedule = p.pipeline_schedule
  if schedule == "1f1b" and p.pipeline_repeats > 1:
    yield ("parallel.pipeline_schedule=1f1b runs each stage's layers once per micro-batch: with "
           "parallel.pipeline_repeats > 1 use pipeline_schedule=interleaved (or gpipe)")
  if schedule == "interleaved" and p.pipeline_repeats == 1:
    yield ("parallel.pipeline_schedule=interleaved visits each stage pipeline_repeats times: set "
           "parallel.pipeline_repeats > 1, or use pipeline_schedule=1f1b")
  if schedule == "interleaved" and micro % p.pipeline:
    yield (f"parallel.pipeline_schedule=interleaved takes the micro-batches in rounds of one per "
           f"stage: train.batch_size / train.micro_batch_size ({micro}) must be a multiple of "
           f"parallel.pipeline ({p.pipeline}); change train.micro_batch_size")
  if config.train.qk_clip and schedule not in ("gpipe", "auto"):
    yield (f"train.qk_clip reads attention's largest logits from GPipe's pipeline schedule only; "
           f"parallel.pipeline_schedule is {schedule}: set parallel.pipeline_schedule=gpipe (or "
           f"auto, which keeps GPipe under QK-clip), or turn train.qk_clip off")
  if config.precision.gemm == "fp8" and config.precision.fp8_recipe == "delayed":
    yield ("precision.fp8_recipe=delayed keeps one amax history per GEMM, which every micro-batch "
           "in the pipeline's stages would update at once: use fp8_recipe=current with "
           "parallel.pipeline > 1")
