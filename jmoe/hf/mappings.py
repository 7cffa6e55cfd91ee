"""The mapping between jmoe's parameters and a Hugging Face checkpoint's tensors: for each jmoe
parameter (one layer of it), a pair of functions, to jmoe from named tensors and back. The layouts
are the same for every family (PyTorch Linear weights are [out, in]); the names come from the
family (families.py). `walk` goes over a model's parameters with the mapping of each.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, NamedTuple

import numpy as np
from flax import nnx

from jmoe.hf.families import Family
from jmoe.config import Config, ConfigError

# ---- the mapping: a jmoe parameter (one layer of it) <-> named Hugging Face tensors

Get = Callable[..., np.ndarray]  # (name[, rows: a slice of the leading axis]) -> the tensor


class Mapping(NamedTuple):
  to_jmoe: Callable[..., np.ndarray]  # (get, shape) -> one layer of the jmoe parameter
  to_hf: Callable[..., dict[str, np.ndarray]]  # (one layer) -> {name: tensor}
  # Which directions take a block of experts (`experts=`, a slice of the leading expert axis),
  # so that conversion makes a layer of them a block at a time: import reads only the block's
  # tensors (or rows); export writes only its tensors, where each expert has tensors of its own.
  import_blocks: bool = False
  export_blocks: bool = False


def _linear(name: str, in_dims: int):
  """A PyTorch Linear weight [out, in] <-> a jmoe weight whose first `in_dims` axes are `in`."""
  def to_jmoe(get: Get, shape) -> np.ndarray:
    return get(name).T.reshape(shape)

  def to_hf(a: np.ndarray) -> dict[str, np.ndarray]:
    return {name: a.reshape(math.prod(a.shape[:in_dims]), -1).T}

  return Mapping(to_jmoe, to_hf)


def _same(name: str):
  return Mapping(lambda get, shape: get(name).reshape(shape), lambda a: {name: a})


def _flat(name: str):
  """A vector in Hugging Face (e.g. a per-head bias [H * A]) <-> a jmoe array of any shape."""
  return Mapping(lambda get, shape: get(name).reshape(shape), lambda a: {name: a.reshape(-1)})


def _gate_up(gate: str, up: str):
  """Separate gate and up Linear weights [F, D] <-> one [D, 2, F] weight."""
  def to_jmoe(get: Get, shape) -> np.ndarray:
    return np.stack([get(gate).T, get(up).T], axis=1).reshape(shape)

  def to_hf(a: np.ndarray) -> dict[str, np.ndarray]:
    return {gate: a[:, 0].T, up: a[:, 1].T}

  return Mapping(to_jmoe, to_hf)


def _per_expert(num_experts: int, make: Callable[[str], Mapping]):
  """A mapping applied to each expert e (names with `{e}`), stacked along a leading expert axis
  (of the block of `experts` asked for)."""
  def to_jmoe(get: Get, shape, experts: slice = slice(None)) -> np.ndarray:
    out = None
    for i, e in enumerate(range(num_experts)[experts]):  # filled in place: one copy in memory
      one = make(str(e)).to_jmoe(get, shape[1:])
      if out is None:
        out = np.empty((len(range(num_experts)[experts]), *one.shape), one.dtype)
      out[i] = one
    return out

  def to_hf(a: np.ndarray, experts: slice = slice(None)) -> dict[str, np.ndarray]:
    return {k: v for i, e in enumerate(range(num_experts)[experts])
            for k, v in make(str(e)).to_hf(a[i]).items()}

  return Mapping(to_jmoe, to_hf, import_blocks=True, export_blocks=True)


def _expert_rows(mapping):
  """A mapping of tensors whose leading axis is the experts, made (on import) for a block of
  `experts`: only their rows are read. Export writes each tensor whole."""
  return Mapping(lambda get, shape, experts=slice(None): mapping.to_jmoe(
      lambda name: get(name, experts), shape), mapping.to_hf, import_blocks=True)


def _rope_interleaved(mapping, start: int, size: int):
  """Checkpoints that rotate interleaved pairs (x0, x1), (x2, x3)...: the `size` rotary entries
  from `start` on the last axis are reordered into jmoe's half-split layout, and back on export.
  Queries and keys are reordered alike, so attention scores do not change."""
  order = np.concatenate([np.arange(0, size, 2), np.arange(1, size, 2)]) + start

  def permute(a, index):
    out = a.copy()
    out[..., start:start + size] = a[..., index]
    return out

  return Mapping(lambda get, shape: permute(mapping.to_jmoe(get, shape), order),
                 lambda a: mapping.to_hf(permute(a, np.argsort(order) + start)))


def _interleaved_pairs(name: str):
  """A fused [..., 2F] tensor with gate and up interleaved (g0, u0, g1, u1...) <-> [..., 2, F]."""
  def to_jmoe(get: Get, shape) -> np.ndarray:
    t = get(name)
    return np.stack([t[..., 0::2], t[..., 1::2]], axis=-2).reshape(shape)

  def to_hf(a: np.ndarray) -> dict[str, np.ndarray]:
    return {name: np.swapaxes(a, -1, -2).reshape(*a.shape[:-2], -1)}

  return Mapping(to_jmoe, to_hf)


def layer_mappings(family: Family, config: Config, interleaved: bool = False
                   ) -> dict[tuple[str, ...], Mapping]:
  """Mappings for one transformer layer's parameters, by their path inside the block."""
  num_experts, mla = config.moe.num_experts, config.model.mla
  rope = (lambda mapping, start: _rope_interleaved(mapping, start, mla.qk_rope_head_dim)
          ) if interleaved else (lambda mapping, start: mapping)
  gate, up, down = family.dense_names
  egate, eup, edown = family.expert_names
  dense, moe = family.dense_prefix, family.moe_prefix
  expert = lambda name: f"{moe}.experts.{{e}}.{name}.weight"
  mappings = {
      ("attn", "w_q_DHA"): _linear("self_attn.q_proj.weight", 1),
      ("attn", "w_k_DGA"): _linear("self_attn.k_proj.weight", 1),
      ("attn", "w_v_DGA"): _linear("self_attn.v_proj.weight", 1),
      ("attn", "w_o_HAD"): _linear("self_attn.o_proj.weight", 2),
      ("attn", "q_norm", "scale"): _same("self_attn.q_norm.weight"),
      ("attn", "k_norm", "scale"): _same("self_attn.k_norm.weight"),
      ("attn_norm", "scale"): _same("input_layernorm.weight"),
      ("mlp_norm", "scale"): _same("post_attention_layernorm.weight"),
      ("mlp", "w_in_D2F"): _gate_up(f"{dense}.{gate}.weight", f"{dense}.{up}.weight"),
      ("mlp", "w_out_FD"): _linear(f"{dense}.{down}.weight", 1),
      ("mlp", "router_DE"): _linear(f"{moe}.{family.router_name}.weight", 1),
      ("mlp", "router_bias_E"): _same(f"{moe}.{family.router_name}.bias"),
      ("mlp", "w_in_ED2F"): _per_expert(num_experts, lambda e: _gate_up(
          expert(egate).format(e=e), expert(eup).format(e=e))),
      ("mlp", "w_out_EFD"): _per_expert(num_experts,
                                        lambda e: _linear(expert(edown).format(e=e), 1)),
      ("mlp", "shared", "w_in_D2F"): _gate_up(f"{moe}.shared_experts.{gate}.weight",
                                              f"{moe}.shared_experts.{up}.weight"),
      ("mlp", "shared", "w_out_FD"): _linear(f"{moe}.shared_experts.{down}.weight", 1),
      ("mlp", "expert_bias_E"): _same(f"{moe}.gate.e_score_correction_bias"),
      # Projection biases and sinks (GPT-OSS).
      ("attn", "b_q_HA"): _flat("self_attn.q_proj.bias"),
      ("attn", "b_k_GA"): _flat("self_attn.k_proj.bias"),
      ("attn", "b_v_GA"): _flat("self_attn.v_proj.bias"),
      ("attn", "b_o_D"): _same("self_attn.o_proj.bias"),
      ("attn", "sinks_H"): _same("self_attn.sinks"),
  }
  if config.model.attention == "mla":  # multi-head latent attention
    mappings.update({
        ("attn", "w_q_DHA"): rope(_linear("self_attn.q_proj.weight", 1), mla.qk_nope_head_dim),
        ("attn", "w_q_a_DR"): _linear("self_attn.q_a_proj.weight", 1),
        ("attn", "q_a_norm", "scale"): _same("self_attn.q_a_layernorm.weight"),
        ("attn", "w_q_b_RHA"): rope(_linear("self_attn.q_b_proj.weight", 1),
                                    mla.qk_nope_head_dim),
        ("attn", "w_kv_a_DI"): rope(_linear("self_attn.kv_a_proj_with_mqa.weight", 1),
                                    mla.kv_lora_rank),
        ("attn", "kv_a_norm", "scale"): _same("self_attn.kv_a_layernorm.weight"),
        ("attn", "w_kv_b_RHY"): _linear("self_attn.kv_b_proj.weight", 1),
        ("attn", "w_o_HWD"): _linear("self_attn.o_proj.weight", 2),
    })
  if family.fused_experts:
    mappings.update({
        ("mlp", "w_in_ED2F"): _expert_rows(_interleaved_pairs(f"{moe}.experts.gate_up_proj")),
        ("mlp", "b_in_E2F"): _expert_rows(_interleaved_pairs(f"{moe}.experts.gate_up_proj_bias")),
        ("mlp", "w_out_EFD"): _expert_rows(_same(f"{moe}.experts.down_proj")),
        ("mlp", "b_out_ED"): _expert_rows(_same(f"{moe}.experts.down_proj_bias")),
    })
  return mappings


TOP_MAPPINGS = {
    ("embed", "table"): _same("model.embed_tokens.weight"),
    ("final_norm", "scale"): _same("model.norm.weight"),
    ("head_DV",): _linear("lm_head.weight", 1),
}


# A multi-token prediction module k is layer num_layers + k of DeepSeek-V3's checkpoints: a
# decoder layer (its block) with these around it. Its embedding and head are copies of the
# model's own, which jmoe's modules share: export writes them, import checks them.
MTP_MAPPINGS = {
    ("embed_norm", "scale"): _same("enorm.weight"),
    ("hidden_norm", "scale"): _same("hnorm.weight"),
    ("out_norm", "scale"): _same("shared_head.norm.weight"),
    ("w_proj_2DD",): _linear("eh_proj.weight", 1),
}


def mtp_prefixes(config: Config, family: Family) -> list[str]:
  """The Hugging Face name prefix of each multi-token prediction module ([] where the family's
  checkpoints have none)."""
  if not family.mtp_layers:
    return []
  return [f"model.layers.{config.model.num_layers + k}." for k in range(config.model.mtp_depth)]


def walk(config: Config, family: Family, params: nnx.State, interleaved: bool
          ) -> Iterator[tuple]:
  """(path, variable, layer or None, HF name prefix, mapping) for every parameter (and layer) of
  the model."""
  layers = layer_mappings(family, config, interleaved)
  first_moe = config.moe.first_k_dense
  prefixes = mtp_prefixes(config, family)
  for path, variable in nnx.to_flat_state(params):
    path = tuple(str(p) for p in path)
    if "lora" in path:  # adapters: folded into their weights by the exporter
      continue
    if path[0] == "mtp":
      if not prefixes:  # transformers' other models have no multi-token prediction modules
        continue
      inner = path[3:] if path[2] == "block" else path[2:]
      mapping = (layers if path[2] == "block" else MTP_MAPPINGS).get(inner)
      if mapping is None:
        raise ConfigError(f"no Hugging Face mapping for jmoe parameter {'.'.join(path)}")
      yield path, variable, None, prefixes[int(path[1])], mapping
      continue
    if path[0] in ("dense_blocks", "moe_blocks"):
      if path[1:] not in layers:
        raise ConfigError(f"no Hugging Face mapping for jmoe parameter {'.'.join(path)}")
      offset = 0 if path[0] == "dense_blocks" else first_moe
      for layer in range(variable.shape[0]):
        yield path, variable, layer, f"model.layers.{layer + offset}.", layers[path[1:]]
    else:
      if path not in TOP_MAPPINGS:
        raise ConfigError(f"no Hugging Face mapping for jmoe parameter {'.'.join(path)}")
      yield path, variable, None, "", TOP_MAPPINGS[path]
