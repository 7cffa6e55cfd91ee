"""How each supported Hugging Face architecture maps onto jmoe: config fields and tensor names.

A family is data, not code paths: a config translation in each direction and the names of its
tensors. The tensor layouts are the same for every family (PyTorch Linear weights are [out, in]);
`hf.py` does the reshaping.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jmoe.config import ConfigError, ModelConfig, MoEConfig, RouterConfig


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


def _get(hf: dict, key: str, *alternatives: str, default: Any = ConfigError) -> Any:
  for k in (key, *alternatives):
    if hf.get(k) is not None:
      return hf[k]
  if default is ConfigError:
    raise ConfigError(f"config.json lacks {key!r}, which this architecture needs")
  return default


def _rope_theta(hf: dict) -> float:
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind not in ("default", None):
    raise ConfigError(f"rope type {kind!r} is not supported for this architecture yet")
  return float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))


def _common(hf: dict) -> dict:
  if hf.get("attention_bias"):
    raise ConfigError("attention_bias=true is not supported for this architecture")
  d_model, heads = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
  return dict(vocab_size=_get(hf, "vocab_size"), d_model=d_model,
              num_layers=_get(hf, "num_hidden_layers"), num_heads=heads,
              num_kv_heads=_get(hf, "num_key_value_heads", default=heads),
              head_dim=_get(hf, "head_dim", default=d_model // heads),
              rope_theta=_rope_theta(hf), norm_eps=float(_get(hf, "rms_norm_eps")),
              tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _common_to_hf(m: ModelConfig) -> dict:
  return dict(vocab_size=m.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.num_layers,
              num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
              head_dim=m.head_dim, rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
              rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
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


FAMILIES = {
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "qwen3_moe", _qwen3_to_jmoe, _qwen3_to_hf,
                        moe_prefix="mlp", expert_names=("gate_proj", "up_proj", "down_proj")),
    "mixtral": Family("MixtralForCausalLM", "mixtral", _mixtral_to_jmoe, _mixtral_to_hf,
                      moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2")),
}


def family_of_hf(hf: dict) -> Family:
  for family in FAMILIES.values():
    if hf.get("model_type") == family.model_type or family.architecture in (
        hf.get("architectures") or []):
      return family
  raise ConfigError(
      f"unsupported architecture {hf.get('architectures')} (model_type {hf.get('model_type')!r}); "
      f"jmoe converts {sorted(f.architecture for f in FAMILIES.values())}")


def check_exportable(m: ModelConfig, moe: MoEConfig) -> Family:
  """The family a jmoe config exports to, after checking that the family can express it."""
  if m.family not in FAMILIES:
    raise ConfigError(f"model.family is {m.family!r}; set it to one of {sorted(FAMILIES)} to "
                      f"export to Hugging Face")
  problems = []
  if moe.num_shared_experts:
    problems.append("shared experts")
  if moe.router.score != "softmax" or moe.router.num_groups > 1 or moe.router.bias:
    problems.append("a router other than softmax top-k without groups or bias")
  if moe.router.scaling_factor != 1.0:
    problems.append("a router scaling factor")
  if m.family == "mixtral":
    if m.qk_norm or moe.first_k_dense or not moe.router.norm_topk_prob:
      problems.append("qk_norm, dense first layers or unnormalised top-k weights")
  elif not m.qk_norm:
    problems.append("attention without qk_norm")
  if problems:
    raise ConfigError(f"model.family={m.family} cannot express: {', '.join(problems)}")
  return FAMILIES[m.family]
