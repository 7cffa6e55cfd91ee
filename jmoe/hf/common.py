"""The config.json fields every supported family reads and writes alike (rotary embedding and
its YaRN scaling, sizes, norms, activation, attention bias, quantization), for the family
translations in families.py."""

from __future__ import annotations

import logging

from jmoe.hf.fields import HFFields
from jmoe.config import ConfigError, ModelConfig, YarnConfig

log = logging.getLogger("jmoe")


def rope_fields(f: HFFields, default_theta: float, default: dict | None = None,
          all_dim_ok: bool = False) -> dict:
  """rope_theta and yarn for ModelConfig from rope_parameters (or the older rope_scaling, which
  transformers prefers where both are given), as transformers computes them."""
  names = ("rope_scaling", "rope_parameters") if "rope_scaling" in f else ("rope_parameters",
                                                                            "rope_scaling")
  rope = f.mapping(*names, default=default or {})
  if any(isinstance(v, dict) for v in rope.hf.values()):
    raise ConfigError(f"{rope.source}: rotary parameters per kind of layer are not supported; "
                      f"jmoe has one set for every layer")
  theta = rope.number("rope_theta", low=1.0,
                      default=f.number("rope_theta", low=1.0, default=default_theta))
  partial = rope.number("partial_rotary_factor",
                        default=f.number("partial_rotary_factor", default=1.0))
  if partial != 1.0:
    raise ConfigError(f"{rope.source}: partial_rotary_factor={partial} is not supported; jmoe "
                      f"rotates every dim of a head (1.0)")
  kind = rope.text("rope_type", "type", default="default")
  max_len = f.size("max_position_embeddings")
  if kind == "default":
    return dict(rope_theta=theta)
  if kind != "yarn":
    raise ConfigError(f"{rope.source}: rope type {kind!r} is not supported; jmoe has default "
                      f"and yarn")
  if rope.value("attention_factor", default=None) is not None:
    raise ConfigError(f"{rope.source}: attention_factor is not supported; give mscale (and "
                      f"mscale_all_dim) instead")
  original = rope.size("original_max_position_embeddings", default=f.size(
      "original_max_position_embeddings", default=max_len))
  factor = rope.number("factor", low=1.0, open_low=False, null=None, default=None)
  if factor is None:  # transformers then stretches max_position_embeddings / original
    factor = max_len / original
    if factor < 1:
      raise ConfigError(f"{rope.source}: without a factor, max_position_embeddings ({max_len}) "
                        f"over original_max_position_embeddings ({original}) is below 1")
  mscale = rope.number("mscale", open_low=False, default=0.0)
  all_dim = rope.number("mscale_all_dim", open_low=False, default=0.0)
  if all_dim and not all_dim_ok:
    raise ConfigError(f"{rope.source}: mscale_all_dim is not supported for this architecture "
                      f"(jmoe scales the attention logits by it, as DeepSeek-V3 does; "
                      f"transformers does not here)")
  if all_dim and not mscale:
    raise ConfigError(f"{rope.source}: mscale_all_dim without mscale is not supported (jmoe "
                      f"takes mscale / mscale_all_dim where both are given)")
  return dict(rope_theta=theta, yarn=YarnConfig(
      factor=factor, original_max_len=original,
      beta_fast=rope.number("beta_fast", default=32.0),
      beta_slow=rope.number("beta_slow", default=1.0),
      mscale=mscale or 1.0, mscale_all_dim=all_dim, truncate=rope.flag("truncate", default=True)))


def rope_to_hf(m: ModelConfig) -> dict:
  if m.yarn.factor <= 1:
    return {"rope_type": "default", "rope_theta": m.rope_theta}
  y = m.yarn
  return {"rope_type": "yarn", "rope_theta": m.rope_theta, "factor": y.factor,
          "original_max_position_embeddings": y.original_max_len, "beta_fast": y.beta_fast,
          "beta_slow": y.beta_slow, "mscale": y.mscale, "mscale_all_dim": y.mscale_all_dim,
          "truncate": y.truncate}


def common_fields(f: HFFields, default_theta: float, default_rope: dict | None = None,
            all_dim_ok: bool = False) -> dict:
  """The fields every family reads alike."""
  d_model, heads = f.size("hidden_size"), f.size("num_attention_heads")
  kv_heads = f.size("num_key_value_heads", null=None)
  head_dim = f.size("head_dim", null=None)
  dropout = f.number("attention_dropout", open_low=False, default=0.0)
  if dropout:
    log.warning("%s: attention_dropout=%s is not used: jmoe trains without dropout",
                f.source, dropout)
  return dict(vocab_size=f.size("vocab_size"), d_model=d_model,
              num_layers=f.size("num_hidden_layers"), num_heads=heads,
              num_kv_heads=heads if kv_heads is None else kv_heads,
              head_dim=d_model // heads if head_dim is None else head_dim,
              **rope_fields(f, default_theta, default_rope, all_dim_ok),
              norm_eps=f.number("rms_norm_eps"), tie_embeddings=f.flag("tie_word_embeddings"),
              init_std=f.number("initializer_range"))


def require_silu(f: HFFields) -> None:
  """The dense MLPs' and experts' activation: jmoe's SwiGLU gates with SiLU (`swish` alike)."""
  act = f.text("hidden_act")
  if act not in ("silu", "swish"):
    raise ConfigError(f"{f.source}: hidden_act={act!r} is not supported; jmoe's gated MLPs use "
                      f"silu")


def no_attention_bias(f: HFFields) -> None:
  if f.flag("attention_bias"):
    raise ConfigError(f"{f.source}: attention_bias=true is not supported for this architecture")


def unquantized(f: HFFields, allowed: tuple[str, ...] = ()) -> None:
  """Quantized weights other than `allowed` kinds (which the reader dequantizes) are refused:
  their scales would be ignored."""
  if "quantization_config" not in f:
    return
  method = f.mapping("quantization_config").value("quant_method", default=None)
  f.nested.pop("quantization_config")  # its other fields are the quantizer's own
  if method not in allowed:
    raise ConfigError(f"{f.source}: quantization_config (quant_method {method!r}) is not "
                      f"supported: jmoe imports float32, bfloat16 or float16 weights"
                      f"{' (or MXFP4 experts)' if allowed else ''}; convert a dequantized copy")


def common_to_hf(m: ModelConfig) -> dict:
  return dict(vocab_size=m.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.num_layers,
              num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
              head_dim=m.head_dim, rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
              rope_parameters=rope_to_hf(m),
              hidden_act="silu", attention_bias=False, initializer_range=m.init_std)


COMMON_DEFAULTS = dict(tie_word_embeddings=False, hidden_act="silu", initializer_range=0.02,
                       router_aux_loss_coef=0.001)
