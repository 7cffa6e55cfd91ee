"""How each supported Hugging Face architecture maps onto jmoe: config fields and tensor names.

A family is data, not code paths: a config translation in each direction and the names of its
tensors. The tensor layouts are the same for every family (PyTorch Linear weights are [out, in]);
`convert.py` does the reshaping. Import reads config.json through `HFFields` (fields.py): each field
that changes what the model computes is read with its type and range and mapped, or refused by
name; export writes only what transformers runs as jmoe does (`check_exportable`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from jmoe.hf.common import (COMMON_DEFAULTS, common_fields, common_to_hf,
                                       no_attention_bias, require_silu, unquantized)
from jmoe.hf.fields import HFFields
from jmoe.config import (BalanceConfig, ConfigError, MLAConfig, ModelConfig, MoEConfig,
                         RouterConfig)
from jmoe.errors import choice

log = logging.getLogger("jmoe")


@dataclasses.dataclass(frozen=True)
class Family:
  architecture: str  # config.json "architectures"[0]
  model_type: str
  # config.json's fields -> (model, moe, whether the rotary weights are interleaved)
  to_jmoe: Callable[[HFFields], tuple[ModelConfig, MoEConfig, bool]]
  to_hf: Callable[[ModelConfig, MoEConfig], dict]
  defaults: dict  # transformers' defaults for the fields config.json may leave out
  moe_prefix: str  # the MoE block's name inside a layer
  expert_names: tuple[str, str, str]  # gate, up, down projections of one expert
  dense_prefix: str = "mlp"
  dense_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
  router_name: str = "gate"
  fused_experts: bool = False  # all experts in one gate_up_proj [E, D, 2F] (gate, up interleaved)
  # Multi-token prediction modules as layers after the last (DeepSeek-V3's checkpoints)
  mtp_layers: bool = False
  # Fields of its config.json that do not change what transformers computes (derived ones,
  # training or parallelism settings of the original code), besides fields.GENERIC
  ignored: frozenset = frozenset()
  # Other model types whose config.json is this family's (read by its fields and defaults)
  read_as: tuple[str, ...] = ()


# ---- config.json -> jmoe: every field that changes what the model computes is read (with its
# type and range) and mapped, or refused by name; a missing one takes transformers' default for
# the family (its config class, transformers 5), listed in each family's DEFAULTS. The fields
# every family reads alike are in common.py.

QWEN3_DEFAULTS = dict(COMMON_DEFAULTS, num_key_value_heads=4, head_dim=None, rms_norm_eps=1e-6,
                      max_position_embeddings=32768, attention_bias=False,
                      use_sliding_window=False, sliding_window=4096, decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=False)


def _qwen3_first_k_dense(f: HFFields, layers: int) -> int:
  step = f.size("decoder_sparse_step")
  only = f.int_list("mlp_only_layers", null=[])
  outside = [i for i in only if not 0 <= i < layers]
  if outside:
    raise ConfigError(f"{f.source}: mlp_only_layers names layer {outside[0]}; the model has "
                      f"layers 0 to {layers - 1}")
  dense = sorted(set(only) | {i for i in range(layers) if (i + 1) % step})
  if dense != list(range(len(dense))):
    raise ConfigError(f"{f.source}: dense layers {dense} (mlp_only_layers, decoder_sparse_step) "
                      f"are not the first k layers; jmoe supports dense layers only before all "
                      f"MoE layers (moe.first_k_dense)")
  return len(dense)


def _qwen3_to_jmoe(f: HFFields) -> tuple[ModelConfig, MoEConfig, bool]:
  no_attention_bias(f)
  require_silu(f)
  unquantized(f)
  common = common_fields(f, 10_000.0)
  window = 0
  if f.flag("use_sliding_window"):
    window = f.size("sliding_window", null=0, low=0)
    if window and f.size("max_window_layers", default=common["num_layers"]) < common["num_layers"]:
      raise ConfigError(f"{f.source}: max_window_layers below num_hidden_layers with a sliding "
                        f"window is not supported (transformers 5 windows every layer, older "
                        f"ones only the layers from max_window_layers on)")
  f.read.update(("sliding_window", "max_window_layers"))  # (not used without the window)
  model = ModelConfig(**common, d_ff=f.size("intermediate_size"), qk_norm=True,
                      sliding_window=window, family="qwen3_moe")
  moe = MoEConfig(num_experts=f.size("num_experts", "num_local_experts"),
                  top_k=f.size("num_experts_per_tok"),
                  d_ff_expert=f.size("moe_intermediate_size"),
                  first_k_dense=_qwen3_first_k_dense(f, common["num_layers"]),
                  router=RouterConfig(score="softmax", norm_topk_prob=f.flag("norm_topk_prob")),
                  balance=BalanceConfig(aux_loss_coef=f.number("router_aux_loss_coef",
                                                               open_low=False)))
  return model, moe, False


def _qwen3_to_hf(m: ModelConfig, moe: MoEConfig) -> dict:
  return dict(common_to_hf(m), architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
              intermediate_size=m.d_ff, moe_intermediate_size=moe.d_ff_expert,
              num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
              norm_topk_prob=moe.router.norm_topk_prob, decoder_sparse_step=1,
              mlp_only_layers=list(range(moe.first_k_dense)),
              use_sliding_window=bool(m.sliding_window), sliding_window=m.sliding_window or None,
              router_aux_loss_coef=moe.balance.aux_loss_coef)


MIXTRAL_DEFAULTS = dict(COMMON_DEFAULTS, num_key_value_heads=None, head_dim=None,
                        rms_norm_eps=1e-5, max_position_embeddings=4096 * 32,
                        sliding_window=None, router_jitter_noise=0.0)


def _mixtral_to_jmoe(f: HFFields) -> tuple[ModelConfig, MoEConfig, bool]:
  require_silu(f)  # (transformers' Mixtral has no attention biases)
  unquantized(f)
  d_ff = f.size("intermediate_size")
  model = ModelConfig(**common_fields(f, 1e6), d_ff=d_ff,
                      sliding_window=f.size("sliding_window", low=0, null=0) or 0,
                      family="mixtral")
  jitter = f.number("router_jitter_noise", open_low=False)
  if jitter >= 1:
    raise ConfigError(f"{f.source}: router_jitter_noise must be below 1, got {jitter}")
  moe = MoEConfig(num_experts=f.size("num_local_experts", "num_experts"),
                  top_k=f.size("num_experts_per_tok"), d_ff_expert=d_ff,
                  router=RouterConfig(score="softmax", norm_topk_prob=True, jitter=jitter),
                  balance=BalanceConfig(aux_loss_coef=f.number("router_aux_loss_coef",
                                                               open_low=False)))
  return model, moe, False


def _mixtral_to_hf(m: ModelConfig, moe: MoEConfig) -> dict:
  return dict(common_to_hf(m), architectures=["MixtralForCausalLM"], model_type="mixtral",
              intermediate_size=moe.d_ff_expert, num_local_experts=moe.num_experts,
              num_experts_per_tok=moe.top_k, sliding_window=m.sliding_window or None,
              router_jitter_noise=moe.router.jitter,
              router_aux_loss_coef=moe.balance.aux_loss_coef)


DEEPSEEK_DEFAULTS = dict(COMMON_DEFAULTS, num_key_value_heads=None, head_dim=None,
                         rms_norm_eps=1e-6, max_position_embeddings=4096, attention_bias=False,
                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                         kv_lora_rank=512, q_lora_rank=1536, n_shared_experts=1,
                         first_k_dense_replace=3, n_group=8, topk_group=4, norm_topk_prob=True,
                         routed_scaling_factor=2.5, rope_interleave=True,
                         num_nextn_predict_layers=1, scoring_func="sigmoid",
                         topk_method="noaux_tc", moe_layer_freq=1)


def _deepseek_to_jmoe(f: HFFields) -> tuple[ModelConfig, MoEConfig, bool]:
  no_attention_bias(f)
  require_silu(f)
  unquantized(f)
  common = common_fields(f, 10_000.0, all_dim_ok=True)
  if common["num_kv_heads"] != common["num_heads"]:
    raise ConfigError(f"{f.source}: num_key_value_heads ({common['num_kv_heads']}) must equal "
                      f"num_attention_heads ({common['num_heads']}): latent attention has a key "
                      f"and a value for each query head")
  f.equals("scoring_func", "sigmoid", "DeepSeek-V3's router scores with sigmoid")
  f.equals("topk_method", "noaux_tc", "DeepSeek-V3 chooses experts by noaux_tc")
  f.equals("moe_layer_freq", 1, "every layer after first_k_dense_replace is an MoE layer")
  nope, rope = f.size("qk_nope_head_dim"), f.size("qk_rope_head_dim")
  common.update(head_dim=nope + rope)
  model = ModelConfig(**common, d_ff=f.size("intermediate_size"), attention="mla",
                      mla=MLAConfig(q_lora_rank=f.size("q_lora_rank", null=0),
                                    kv_lora_rank=f.size("kv_lora_rank"), qk_nope_head_dim=nope,
                                    qk_rope_head_dim=rope, v_head_dim=f.size("v_head_dim")),
                      family="deepseek_v3",
                      mtp_depth=f.size("num_nextn_predict_layers", "num_mtp_layers", low=0,
                                       null=0))
  moe = MoEConfig(
      num_experts=f.size("n_routed_experts", "num_local_experts"),
      top_k=f.size("num_experts_per_tok"), d_ff_expert=f.size("moe_intermediate_size"),
      num_shared_experts=f.size("n_shared_experts", low=0, null=0),
      first_k_dense=f.size("first_k_dense_replace", low=0, null=0),
      router=RouterConfig(score="sigmoid", norm_topk_prob=f.flag("norm_topk_prob"),
                          scaling_factor=f.number("routed_scaling_factor"),
                          num_groups=f.size("n_group", null=1),
                          topk_groups=f.size("topk_group", null=1)),
      # DeepSeek-V3's recipe: a small sequence-wise balance loss and the selection bias.
      balance=BalanceConfig(aux_loss_coef=0.0001, aux_loss_type="seq", bias_update_rate=0.001))
  return model, moe, f.flag("rope_interleave")


def _deepseek_to_hf(m: ModelConfig, moe: MoEConfig) -> dict:
  return dict(common_to_hf(m), architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
              intermediate_size=m.d_ff, moe_intermediate_size=moe.d_ff_expert,
              n_routed_experts=moe.num_experts, n_shared_experts=moe.num_shared_experts,
              num_experts_per_tok=moe.top_k, first_k_dense_replace=moe.first_k_dense,
              n_group=moe.router.num_groups, topk_group=moe.router.topk_groups,
              norm_topk_prob=moe.router.norm_topk_prob,
              routed_scaling_factor=moe.router.scaling_factor,
              q_lora_rank=m.mla.q_lora_rank or None, kv_lora_rank=m.mla.kv_lora_rank,
              qk_nope_head_dim=m.mla.qk_nope_head_dim, qk_rope_head_dim=m.mla.qk_rope_head_dim,
              v_head_dim=m.mla.v_head_dim, rope_interleave=True,
              num_nextn_predict_layers=m.mtp_depth,
              # Latent attention has a key and value per query head, whatever model.num_kv_heads
              # says (jmoe's MLA does not read it; transformers' fails unless they are equal).
              num_key_value_heads=m.num_heads,
              head_dim=m.mla.qk_rope_head_dim,  # transformers' rotary size for DeepSeek
              max_position_embeddings=max(m.yarn.original_max_len,
                                          int(m.yarn.original_max_len * m.yarn.factor)))


GPT_OSS_DEFAULTS = dict(COMMON_DEFAULTS, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                        max_position_embeddings=131072, sliding_window=128, attention_bias=True,
                        swiglu_limit=7.0)
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


def _full_attention_every(f: HFFields, layers: int) -> tuple[int, bool]:
  """(model.full_attention_every, whether any layer is windowed) for GPT-OSS's layer_types."""
  default = [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
  kinds = f.value("layer_types", default=default, null=default)
  if (not isinstance(kinds, list) or len(kinds) != layers or
      not set(kinds) <= {"sliding_attention", "full_attention"}):
    raise ConfigError(f"{f.source}: layer_types must list sliding_attention or full_attention "
                      f"for each of the {layers} layers, got {kinds!r}")
  windowed = [kind == "sliding_attention" for kind in kinds]
  for every in range(layers + 1):  # 0: all windowed; k: layer i full where i % k == k - 1
    if windowed == [not every or i % every != every - 1 for i in range(layers)]:
      return every, any(windowed)
  raise ConfigError(f"{f.source}: layer_types {kinds} is not a pattern jmoe has (windowed "
                    f"layers with every k-th layer full: model.full_attention_every)")


def _gpt_oss_to_jmoe(f: HFFields) -> tuple[ModelConfig, MoEConfig, bool]:
  unquantized(f, allowed=("mxfp4",))
  layers = f.size("num_hidden_layers")
  every, any_window = _full_attention_every(f, layers)
  window = f.size("sliding_window", low=0, null=0) if any_window else 0
  f.read.add("sliding_window")
  f.equals("swiglu_limit", 7.0, "transformers' GPT-OSS clamps its experts at 7.0")
  d_ff = f.size("intermediate_size")
  model = ModelConfig(**common_fields(f, 150_000.0, GPT_OSS_ROPE), d_ff=d_ff, sliding_window=window,
                      full_attention_every=every if window else 0,
                      attention_bias=f.flag("attention_bias"), attention_sinks=True,
                      family="gpt_oss")
  moe = MoEConfig(num_experts=f.size("num_local_experts", "num_experts"),
                  top_k=f.size("num_experts_per_tok"), d_ff_expert=d_ff, expert_bias=True,
                  activation="clamped_swiglu", swiglu_limit=7.0, swiglu_alpha=1.702,
                  router=RouterConfig(score="softmax_topk", bias=True),
                  balance=BalanceConfig(aux_loss_coef=f.number("router_aux_loss_coef",
                                                               open_low=False)))
  return model, moe, False


def _gpt_oss_to_hf(m: ModelConfig, moe: MoEConfig) -> dict:
  kinds = ["sliding_attention" if m.windowed(i) else "full_attention" for i in range(m.num_layers)]
  return dict(common_to_hf(m), architectures=["GptOssForCausalLM"], model_type="gpt_oss",
              intermediate_size=moe.d_ff_expert, num_local_experts=moe.num_experts,
              num_experts_per_tok=moe.top_k, sliding_window=m.sliding_window or None,
              layer_types=kinds, attention_bias=m.attention_bias, swiglu_limit=moe.swiglu_limit,
              router_aux_loss_coef=moe.balance.aux_loss_coef)


FAMILIES = {
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "qwen3_moe", _qwen3_to_jmoe, _qwen3_to_hf,
                        QWEN3_DEFAULTS, moe_prefix="mlp",
                        expert_names=("gate_proj", "up_proj", "down_proj")),
    "mixtral": Family("MixtralForCausalLM", "mixtral", _mixtral_to_jmoe, _mixtral_to_hf,
                      MIXTRAL_DEFAULTS, moe_prefix="block_sparse_moe",
                      expert_names=("w1", "w3", "w2")),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", "deepseek_v3", _deepseek_to_jmoe,
                          _deepseek_to_hf, DEEPSEEK_DEFAULTS, moe_prefix="mlp",
                          expert_names=("gate_proj", "up_proj", "down_proj"), mtp_layers=True,
                          ignored=frozenset(("qk_head_dim", "pretraining_tp",
                                             "aux_loss_alpha", "seq_aux", "ep_size")),
                          # Kimi K2's checkpoints: DeepSeek-V3's architecture and fields under a
                          # model type of their own, which transformers reads as DeepSeek-V3's
                          # too (models/kimi_k25/configuration_kimi_k25.py).
                          read_as=("kimi_k2",)),
    "gpt_oss": Family("GptOssForCausalLM", "gpt_oss", _gpt_oss_to_jmoe, _gpt_oss_to_hf,
                      GPT_OSS_DEFAULTS, moe_prefix="mlp",
                      expert_names=("gate_up_proj", "gate_up_proj", "down_proj"),
                      router_name="router", fused_experts=True,
                      ignored=frozenset(("hidden_act", "experts_per_token",
                                         "initial_context_length"))),
}


def family_of_hf(hf: dict) -> Family:
  for family in FAMILIES.values():
    if hf.get("model_type") in (family.model_type, *family.read_as) or family.architecture in (
        hf.get("architectures") or []):
      if hf.get("model_type") in family.read_as:
        log.info("model_type %s is read as %s (%s)", hf["model_type"], family.model_type,
                 family.architecture)
      return family
  raise ConfigError(
      f"unsupported architecture {hf.get('architectures')} (model_type {hf.get('model_type')!r}); "
      f"jmoe converts {sorted(f.architecture for f in FAMILIES.values())}")


def check_family(name: str) -> None:
  """A ConfigError unless `model.family` is "" (none) or a family jmoe converts."""
  if name:
    choice("model.family", name, FAMILIES)


def check_exportable(m: ModelConfig, moe: MoEConfig) -> Family:
  """The family a jmoe config exports to, after checking that the family can express it."""
  if m.family not in FAMILIES:
    raise ConfigError(f"model.family is {m.family!r}; set it to one of {sorted(FAMILIES)} to "
                      f"export to Hugging Face")
  r, y = moe.router, m.yarn
  yarn = {"model.yarn.mscale > 0 with model.yarn.mscale_all_dim (transformers then ignores mscale)":
          not (y.factor > 1 and y.mscale_all_dim and not y.mscale)}
  if m.family != "deepseek_v3":
    yarn["model.yarn.mscale_all_dim=0 (transformers scales the attention logits by it for "
         "DeepSeek-V3 only)"] = not (y.factor > 1 and y.mscale_all_dim)
  plain = {"no attention bias or sinks": not (m.attention_bias or m.attention_sinks),
           "no expert biases, plain SwiGLU": not moe.expert_bias and moe.activation == "swiglu"}
  if m.family == "gpt_oss":
    needs = {"model.attention=gqa": m.attention == "gqa", "attention bias and sinks":
             m.attention_bias and m.attention_sinks, "moe.router.score=softmax_topk with bias":
             r.score == "softmax_topk" and r.bias, "expert biases": moe.expert_bias,
             "clamped_swiglu with alpha 1.702": moe.activation == "clamped_swiglu" and
             moe.swiglu_alpha == 1.702, "no shared experts, groups or selection bias":
             not moe.num_shared_experts and r.num_groups == 1 and
             moe.balance.bias_update_rate == 0, "model.qk_norm=False": not m.qk_norm,
             "moe.first_k_dense=0": not moe.first_k_dense, "moe.swiglu_limit=7 (transformers' "
             "fixed clamp)": moe.swiglu_limit == 7.0, "moe.router.scaling_factor=1":
             r.scaling_factor == 1.0}
  elif m.family == "deepseek_v3":
    needs = {"model.attention=mla": m.attention == "mla", "moe.router.score=sigmoid":
             r.score == "sigmoid", "no router bias": not r.bias, "moe.balance.bias_update_rate > 0 "
             "(the selection bias)": moe.balance.bias_update_rate > 0,
             "model.sliding_window=0": not m.sliding_window, "model.qk_norm=False": not m.qk_norm,
             **plain}
  else:
    needs = {"model.attention=gqa": m.attention == "gqa", "moe.router.score=softmax":
             r.score == "softmax", "no router groups, bias or scaling": r.num_groups == 1 and
             not r.bias and r.scaling_factor == 1.0, "no shared experts": not moe.num_shared_experts,
             "no selection bias": moe.balance.bias_update_rate == 0,
             "model.full_attention_every=0 (the window on every layer, or on none)":
             not (m.sliding_window and m.full_attention_every), **plain}
    if m.family == "mixtral":
      needs.update({"model.qk_norm=False": not m.qk_norm, "moe.first_k_dense=0":
                    not moe.first_k_dense, "moe.router.norm_topk_prob=True": r.norm_topk_prob})
    else:
      needs["model.qk_norm=True"] = m.qk_norm
  missing = [what for what, ok in {**needs, **yarn}.items() if not ok]
  if missing:
    raise ConfigError(f"model.family={m.family} needs {', '.join(missing)}")
  return FAMILIES[m.family]
