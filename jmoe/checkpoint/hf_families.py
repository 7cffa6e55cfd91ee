"""How each supported Hugging Face architecture maps onto jmoe: config fields and tensor names.

A family is data, not code paths: a config translation in each direction and the names of its
tensors. The tensor layouts are the same for every family (PyTorch Linear weights are [out, in]);
`hf.py` does the reshaping.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jmoe.config import (BalanceConfig, ConfigError, MLAConfig, ModelConfig, MoEConfig,
                         RouterConfig, YarnConfig)
from jmoe.errors import choice


@dataclasses.dataclass(frozen=True)
class Family:
  architecture: str  # config.json "architectures"[0]
  model_type: str
  to_jmoe: Callable[[dict], tuple[ModelConfig, MoEConfig]]
  to_hf: Callable[[ModelConfig, MoEConfig], dict]
  moe_prefix: str  # the MoE block's name inside a layer
  expert_names: tuple[str, str, str]  # gate, up, down projections of one expert
  dense_prefix: str = "mlp"
  dense_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
  router_name: str = "gate"
  fused_experts: bool = False  # all experts in one gate_up_proj [E, D, 2F] (gate, up interleaved)
  # Multi-token prediction modules as layers after the last (DeepSeek-V3's checkpoints)
  mtp_layers: bool = False


def _get(hf: dict, key: str, *alternatives: str, default: Any = ConfigError) -> Any:
  for k in (key, *alternatives):
    if hf.get(k) is not None:
      return hf[k]
  if default is ConfigError:
    raise ConfigError(f"config.json lacks {key!r}, which this architecture needs")
  return default


def _rope(hf: dict) -> dict:
  """rope_theta and yarn for ModelConfig from rope_parameters (or the older rope_scaling)."""
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  kind = rope.get("rope_type", rope.get("type", "default"))
  theta = float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))
  if kind in ("default", None):
    return dict(rope_theta=theta)
  if kind != "yarn":
    raise ConfigError(f"rope type {kind!r} is not supported; jmoe has default and yarn")
  if rope.get("attention_factor") is not None:
    raise ConfigError("rope_parameters.attention_factor is not supported; give mscale instead")
  original = rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
  return dict(rope_theta=theta, yarn=YarnConfig(
      factor=float(rope["factor"]), original_max_len=int(original),
      beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
      mscale=float(rope.get("mscale") or 1.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
      truncate=bool(rope.get("truncate", True))))


def _rope_to_hf(m: ModelConfig) -> dict:
  if m.yarn.factor <= 1:
    return {"rope_type": "default", "rope_theta": m.rope_theta}
  y = m.yarn
  return {"rope_type": "yarn", "rope_theta": m.rope_theta, "factor": y.factor,
          "original_max_position_embeddings": y.original_max_len, "beta_fast": y.beta_fast,
          "beta_slow": y.beta_slow, "mscale": y.mscale, "mscale_all_dim": y.mscale_all_dim,
          "truncate": y.truncate}


def _common(hf: dict) -> dict:
  d_model, heads = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
  return dict(vocab_size=_get(hf, "vocab_size"), d_model=d_model,
              num_layers=_get(hf, "num_hidden_layers"), num_heads=heads,
              num_kv_heads=_get(hf, "num_key_value_heads", default=heads),
              head_dim=_get(hf, "head_dim", default=d_model // heads),
              **_rope(hf), norm_eps=float(_get(hf, "rms_norm_eps")),
              tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _no_attention_bias(hf: dict) -> None:
  if hf.get("attention_bias"):
    raise ConfigError("attention_bias=true is not supported for this architecture")


def _common_to_hf(m: ModelConfig) -> dict:
  return dict(vocab_size=m.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.num_layers,
              num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
              head_dim=m.head_dim, rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
              rope_parameters=_rope_to_hf(m),
              hidden_act="silu", attention_bias=False, initializer_range=m.init_std)


def _qwen3_first_k_dense(hf: dict) -> int:
  layers = _get(hf, "num_hidden_layers")
  step = hf.get("decoder_sparse_step", 1) or 1
  dense = sorted(set(hf.get("mlp_only_layers") or []) |
                 {i for i in range(layers) if (i + 1) % step})
  if dense != list(range(len(dense))):
    raise ConfigError(f"dense layers {dense} are not the first k layers; jmoe supports dense "
                      f"layers only before all MoE layers (moe.first_k_dense)")
  return len(dense)


def _qwen3_to_jmoe(hf: dict) -> tuple[ModelConfig, MoEConfig]:
  _no_attention_bias(hf)
  window = hf.get("sliding_window") if hf.get("use_sliding_window") else 0
  model = ModelConfig(**_common(hf), d_ff=_get(hf, "intermediate_size"), qk_norm=True,
                      sliding_window=window or 0, family="qwen3_moe")
  moe = MoEConfig(num_experts=_get(hf, "num_experts", "num_local_experts"),
                  top_k=_get(hf, "num_experts_per_tok"),
                  d_ff_expert=_get(hf, "moe_intermediate_size"),
                  first_k_dense=_qwen3_first_k_dense(hf),
                  router=RouterConfig(score="softmax",
                                      norm_topk_prob=bool(hf.get("norm_topk_prob", False))))
  return model, moe


def _qwen3_to_hf(m: ModelConfig, moe: MoEConfig) -> dict:
  return dict(_common_to_hf(m), architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
              intermediate_size=m.d_ff, moe_intermediate_size=moe.d_ff_expert,
              num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
              norm_topk_prob=moe.router.norm_topk_prob, decoder_sparse_step=1,
              mlp_only_layers=list(range(moe.first_k_dense)),
              use_sliding_window=bool(m.sliding_window), sliding_window=m.sliding_window or None,
              router_aux_loss_coef=moe.balance.aux_loss_coef)


def _mixtral_to_jmoe(hf: dict) -> tuple[ModelConfig, MoEConfig]:
  _no_attention_bias(hf)
  d_ff = _get(hf, "intermediate_size")
  model = ModelConfig(**_common(hf), d_ff=d_ff, sliding_window=hf.get("sliding_window") or 0,
                      family="mixtral")
  moe = MoEConfig(num_experts=_get(hf, "num_local_experts"), top_k=_get(hf, "num_experts_per_tok"),
                  d_ff_expert=d_ff, router=RouterConfig(score="softmax", norm_topk_prob=True))
  return model, moe


def _mixtral_to_hf(m: ModelConfig, moe: MoEConfig) -> dict:
  return dict(_common_to_hf(m), architectures=["MixtralForCausalLM"], model_type="mixtral",
              intermediate_size=moe.d_ff_expert, num_local_experts=moe.num_experts,
              num_experts_per_tok=moe.top_k, sliding_window=m.sliding_window or None,
              router_aux_loss_coef=moe.balance.aux_loss_coef)


def _deepseek_to_jmoe(hf: dict) -> tuple[ModelConfig, MoEConfig]:
  _no_attention_bias(hf)
  common = _common(hf)
  nope, rope = _get(hf, "qk_nope_head_dim"), _get(hf, "qk_rope_head_dim")
  common.update(num_kv_heads=common["num_heads"], head_dim=nope + rope)
  model = ModelConfig(**common, d_ff=_get(hf, "intermediate_size"), attention="mla",
                      mla=MLAConfig(q_lora_rank=hf.get("q_lora_rank") or 0,
                                    kv_lora_rank=_get(hf, "kv_lora_rank"), qk_nope_head_dim=nope,
                                    qk_rope_head_dim=rope, v_head_dim=_get(hf, "v_head_dim")),
                      family="deepseek_v3", mtp_depth=hf.get("num_nextn_predict_layers") or 0)
  moe = MoEConfig(
      num_experts=_get(hf, "n_routed_experts", "num_local_experts"),
      top_k=_get(hf, "num_experts_per_tok"), d_ff_expert=_get(hf, "moe_intermediate_size"),
      num_shared_experts=hf.get("n_shared_experts") or 0,
      first_k_dense=hf.get("first_k_dense_replace") or 0,
      router=RouterConfig(score="sigmoid", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                          scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
                          num_groups=hf.get("n_group") or 1, topk_groups=hf.get("topk_group") or 1),
      # DeepSeek-V3's recipe: a small sequence-wise balance loss and the selection bias.
      balance=BalanceConfig(aux_loss_coef=0.0001, aux_loss_type="seq", bias_update_rate=0.001))
  return model, moe


def _deepseek_to_hf(m: ModelConfig, moe: MoEConfig) -> dict:
  return dict(_common_to_hf(m), architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
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
              head_dim=m.mla.qk_rope_head_dim,  # transformers' rotary size for DeepSeek
              max_position_embeddings=max(m.yarn.original_max_len,
                                          int(m.yarn.original_max_len * m.yarn.factor)))


def _gpt_oss_to_jmoe(hf: dict) -> tuple[ModelConfig, MoEConfig]:
  layers, window = _get(hf, "num_hidden_layers"), hf.get("sliding_window") or 0
  kinds = hf.get("layer_types") or ["sliding_attention"] * layers
  alternating = [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
  if kinds == alternating:
    full_every = 2
  elif set(kinds) == {"sliding_attention"}:
    full_every = 0
  elif set(kinds) == {"full_attention"}:
    full_every, window = 0, 0
  else:
    raise ConfigError(f"layer_types {kinds} is not a pattern jmoe has (all sliding, all full, or "
                      f"alternating from sliding)")
  d_ff = _get(hf, "intermediate_size")
  model = ModelConfig(**_common(hf), d_ff=d_ff, sliding_window=window if window else 0,
                      full_attention_every=full_every if window else 0,
                      attention_bias=bool(hf.get("attention_bias", True)), attention_sinks=True,
                      family="gpt_oss")
  moe = MoEConfig(num_experts=_get(hf, "num_local_experts"), top_k=_get(hf, "num_experts_per_tok"),
                  d_ff_expert=d_ff, expert_bias=True, activation="clamped_swiglu",
                  swiglu_limit=float(hf.get("swiglu_limit") or 7.0), swiglu_alpha=1.702,
                  router=RouterConfig(score="softmax_topk", bias=True))
  return model, moe


def _gpt_oss_to_hf(m: ModelConfig, moe: MoEConfig) -> dict:
  kinds = ["sliding_attention" if m.windowed(i) else "full_attention" for i in range(m.num_layers)]
  return dict(_common_to_hf(m), architectures=["GptOssForCausalLM"], model_type="gpt_oss",
              intermediate_size=moe.d_ff_expert, num_local_experts=moe.num_experts,
              num_experts_per_tok=moe.top_k, sliding_window=m.sliding_window or None,
              layer_types=kinds, attention_bias=m.attention_bias, swiglu_limit=moe.swiglu_limit,
              router_aux_loss_coef=moe.balance.aux_loss_coef)


FAMILIES = {
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "qwen3_moe", _qwen3_to_jmoe, _qwen3_to_hf,
                        moe_prefix="mlp", expert_names=("gate_proj", "up_proj", "down_proj")),
    "mixtral": Family("MixtralForCausalLM", "mixtral", _mixtral_to_jmoe, _mixtral_to_hf,
                      moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2")),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", "deepseek_v3", _deepseek_to_jmoe,
                          _deepseek_to_hf, moe_prefix="mlp",
                          expert_names=("gate_proj", "up_proj", "down_proj"), mtp_layers=True),
    "gpt_oss": Family("GptOssForCausalLM", "gpt_oss", _gpt_oss_to_jmoe, _gpt_oss_to_hf,
                      moe_prefix="mlp", expert_names=("gate_up_proj", "gate_up_proj", "down_proj"),
                      router_name="router", fused_experts=True),
}


def family_of_hf(hf: dict) -> Family:
  for family in FAMILIES.values():
    if hf.get("model_type") == family.model_type or family.architecture in (
        hf.get("architectures") or []):
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
  r = moe.router
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
             "moe.first_k_dense=0": not moe.first_k_dense}
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
             "no selection bias": moe.balance.bias_update_rate == 0, **plain}
    if m.family == "mixtral":
      needs.update({"model.qk_norm=False": not m.qk_norm, "moe.first_k_dense=0":
                    not moe.first_k_dense, "moe.router.norm_topk_prob=True": r.norm_topk_prob})
    else:
      needs["model.qk_norm=True"] = m.qk_norm
  missing = [what for what, ok in needs.items() if not ok]
  if missing:
    raise ConfigError(f"model.family={m.family} needs {', '.join(missing)}")
  return FAMILIES[m.family]
