"""Hugging Face checkpoints in and out: local directories of config.json + safetensors.

Conversion goes one layer of one variable at a time, both ways: import reads the tensors of a
layer from the (possibly sharded) safetensors files when the checkpoint writer asks for that layer
(jmoe/checkpoint/streamed.py); export brings a layer from the devices to the host and the writer
flushes a safetensors shard as soon as it is full. Neither holds the model in host memory.
Every jmoe parameter has one mapping below; a tensor that is missing is an error naming it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
from typing import Callable, Iterator

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmoe.checkpoint.hf_families import Family, check_exportable, family_of_hf
from jmoe.checkpoint.hf_files import (SafetensorsReader, ShardedWriter, copy_tokenizer_files,
                                      read_json, refuse_to_overwrite, written_in_place)
from jmoe.checkpoint.params import read_config, read_variables
from jmoe.checkpoint.streamed import Region, StreamedArray, part_shape, save_streamed
from jmoe.config import (Config, ConfigError, PrecisionConfig, from_config_dict,
                         to_dict)
from jmoe.model.factory import model_factory
from jmoe.ops.lora import fold
from jmoe.ops.params import DTYPES

log = logging.getLogger("jmoe")


# ---- the mapping: a jmoe parameter (one layer of it) <-> named Hugging Face tensors

Get = Callable[..., np.ndarray]  # (name[, rows: a slice of the leading axis]) -> the tensor


def _linear(name: str, in_dims: int):
  """A PyTorch Linear weight [out, in] <-> a jmoe weight whose first `in_dims` axes are `in`."""
  def to_jmoe(get: Get, shape) -> np.ndarray:
    return get(name).T.reshape(shape)

  def to_hf(a: np.ndarray) -> dict[str, np.ndarray]:
    return {name: a.reshape(math.prod(a.shape[:in_dims]), -1).T}

  return to_jmoe, to_hf


def _same(name: str):
  return (lambda get, shape: get(name).reshape(shape)), (lambda a: {name: a})


def _flat(name: str):
  """A vector in Hugging Face (e.g. a per-head bias [H * A]) <-> a jmoe array of any shape."""
  return (lambda get, shape: get(name).reshape(shape)), (lambda a: {name: a.reshape(-1)})


def _gate_up(gate: str, up: str):
  """Separate gate and up Linear weights [F, D] <-> one [D, 2, F] weight."""
  def to_jmoe(get: Get, shape) -> np.ndarray:
    return np.stack([get(gate).T, get(up).T], axis=1).reshape(shape)

  def to_hf(a: np.ndarray) -> dict[str, np.ndarray]:
    return {gate: a[:, 0].T, up: a[:, 1].T}

  return to_jmoe, to_hf


def _per_expert(num_experts: int, make: Callable[[str], tuple]):
  """A mapping applied to each expert e (names with `{e}`), stacked along a leading expert axis
  (on import, of the block of `experts` asked for)."""
  def to_jmoe(get: Get, shape, experts: slice = slice(None)) -> np.ndarray:
    out = None
    for i, e in enumerate(range(num_experts)[experts]):  # filled in place: one copy in memory
      one = make(str(e))[0](get, shape[1:])
      if out is None:
        out = np.empty((len(range(num_experts)[experts]), *one.shape), one.dtype)
      out[i] = one
    return out

  def to_hf(a: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v for e in range(num_experts) for k, v in make(str(e))[1](a[e]).items()}

  return to_jmoe, to_hf


def _expert_rows(mapping):
  """A mapping of tensors whose leading axis is the experts, made (on import) for a block of
  `experts`: only their rows are read."""
  to_jmoe, to_hf = mapping
  return (lambda get, shape, experts=slice(None): to_jmoe(lambda name: get(name, experts), shape),
          to_hf)


def _rope_interleaved(mapping, start: int, size: int):
  """Checkpoints that rotate interleaved pairs (x0, x1), (x2, x3)...: the `size` rotary entries
  from `start` on the last axis are reordered into jmoe's half-split layout, and back on export.
  Queries and keys are reordered alike, so attention scores do not change."""
  to_jmoe, to_hf = mapping
  order = np.concatenate([np.arange(0, size, 2), np.arange(1, size, 2)]) + start

  def permute(a, index):
    out = a.copy()
    out[..., start:start + size] = a[..., index]
    return out

  return ((lambda get, shape: permute(to_jmoe(get, shape), order)),
          (lambda a: to_hf(permute(a, np.argsort(order) + start))))


def _interleaved_pairs(name: str):
  """A fused [..., 2F] tensor with gate and up interleaved (g0, u0, g1, u1...) <-> [..., 2, F]."""
  def to_jmoe(get: Get, shape) -> np.ndarray:
    t = get(name)
    return np.stack([t[..., 0::2], t[..., 1::2]], axis=-2).reshape(shape)

  def to_hf(a: np.ndarray) -> dict[str, np.ndarray]:
    return {name: np.swapaxes(a, -1, -2).reshape(*a.shape[:-2], -1)}

  return to_jmoe, to_hf


def layer_mappings(family: Family, config: Config, interleaved: bool = False
                   ) -> dict[tuple[str, ...], tuple]:
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


# A layer's variables whose first axis is the routed experts: their mappings take a block of
# experts (`experts=slice`), and import makes them a block at a time.
EXPERT_AXIS = {("mlp", "w_in_ED2F"), ("mlp", "w_out_EFD"), ("mlp", "b_in_E2F"),
               ("mlp", "b_out_ED")}


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


def _walk(config: Config, family: Family, params: nnx.State, interleaved: bool
          ) -> Iterator[tuple]:
  """(path, layer or None, HF name prefix, mapping) for every parameter (and layer) of the model."""
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


PART_BYTES = 1 << 30  # the most bytes of a block of experts that import-hf makes at once


def import_hf(hf_dir: str | pathlib.Path, out: str | pathlib.Path,
              params_dtype: str = "float32", overwrite: bool = False,
              part_bytes: int = PART_BYTES) -> Config:
  """Reads a local Hugging Face model directory; writes a jmoe model checkpoint to `out` (which
  must be empty or new, unless `overwrite`). One part of one variable is read, converted and
  written at a time (one layer; of the routed experts' weights, a block of experts within
  `part_bytes`), the next made while the last is written: the host holds a few parts, never the
  model. Run in several processes, each reads and writes its share of the parts."""
  hf_dir, out = pathlib.Path(hf_dir), pathlib.Path(out).absolute()
  refuse_to_overwrite(out, overwrite)
  if not (hf_dir / "config.json").is_file():
    raise ConfigError(f"{hf_dir / 'config.json'} does not exist: pass a local Hugging Face model "
                      f"directory (config.json and *.safetensors)")
  hf = read_json(hf_dir / "config.json")
  family = family_of_hf(hf)
  model_cfg, moe_cfg = family.to_jmoe(hf)
  read = SafetensorsReader(hf_dir)
  if model_cfg.mtp_depth:  # config.json may name modules whose weights were never saved
    present = [f"model.layers.{model_cfg.num_layers + k}.eh_proj.weight" in read.weight_map
               for k in range(model_cfg.mtp_depth)]
    if not all(present):
      log.info("%s: config.json names %d multi-token prediction module(s); the files hold %d",
               hf_dir, model_cfg.mtp_depth, present.index(False))
      model_cfg = dataclasses.replace(model_cfg, mtp_depth=present.index(False))
  config = from_config_dict(to_dict(Config(model=model_cfg, moe=moe_cfg,
                                           precision=PrecisionConfig(params=params_dtype,
                                                                     compute="float32"))))
  params = nnx.state(nnx.eval_shape(model_factory(config)))
  interleaved = bool(hf.get("rope_interleave", False))
  _check_mtp_copies(read, config, family, hf_dir)
  layers: dict[tuple, list] = {}  # a variable's (HF prefix, to_jmoe) for each layer, or the one
  for path, _, _, prefix, (to_jmoe, _) in _walk(config, family, params, interleaved):
    layers.setdefault(path, []).append((prefix, to_jmoe))

  def streamed(path: tuple, variable) -> StreamedArray:
    stacked = path[0] in ("dense_blocks", "moe_blocks")
    experts = path[-2:] in EXPERT_AXIS
    shape = part_shape(variable.shape, stacked, int(stacked) if experts else None,
                       np.dtype(variable.dtype).itemsize, part_bytes)

    def make(region: Region) -> np.ndarray:
      prefix, to_jmoe = layers[path][region[0].start if stacked else 0]
      layer_shape = shape[1:] if stacked else shape
      block = {"experts": region[int(stacked)]} if experts else {}
      try:
        value = to_jmoe(lambda name, rows=None: read(prefix + name, rows), layer_shape, **block)
      except ConfigError:  # a tensor missing or unreadable: its own message
        raise
      except ValueError as e:  # a tensor of another shape than config.json implies
        raise ConfigError(f"{hf_dir}: the tensors under {prefix or 'the top'} for jmoe's "
                          f"{'.'.join(path)} do not have the shapes its config.json implies "
                          f"({variable.shape}): {e}") from None
      return value.reshape(shape)

    return StreamedArray(tuple(variable.shape), np.dtype(variable.dtype), shape, make)

  tree = jax.tree_util.tree_map_with_path(
      lambda keys, variable: streamed(tuple(str(k.key) for k in keys), variable),
      nnx.to_pure_dict(params))
  with written_in_place(out, every_process=True) as tmp:
    save_streamed(tmp, tree, config)
    if jax.process_index() == 0:
      copy_tokenizer_files(hf_dir, tmp)
  _warn_unused(read, hf_dir)
  return config


def _check_mtp_copies(read: SafetensorsReader, config: Config, family: Family,
                      hf_dir: pathlib.Path) -> None:
  """DeepSeek-V3's files hold a copy of the embedding and the LM head for each prediction
  module; jmoe's modules share the model's own, so the copies must equal them."""
  for prefix in mtp_prefixes(config, family):
    own = {"embed_tokens.weight": "model.embed_tokens.weight",
           "shared_head.head.weight": ("model.embed_tokens.weight"
                                       if config.model.tie_embeddings else "lm_head.weight")}
    for name, model_name in own.items():
      if prefix + name in read.weight_map and not np.array_equal(read(prefix + name),
                                                                 read(model_name)):
        raise ConfigError(f"{hf_dir}: {prefix + name} differs from the model's own "
                          f"{'embedding' if 'embed' in name else 'LM head'}, which jmoe's "
                          f"prediction modules share; jmoe cannot hold a separate one")


def _warn_unused(read: SafetensorsReader, hf_dir: pathlib.Path) -> None:
  """Warns of the tensors no process read (each process reads the layers it writes)."""
  names = sorted(read.weight_map)
  used = np.array([name in read.used for name in names])
  if jax.process_count() > 1:
    used = np.asarray(multihost_utils.process_allgather(used)).any(axis=0)
  unused = [name for name, u in zip(names, used) if not u]
  if unused and jax.process_index() == 0:
    log.warning("%d tensors of %s are not used by jmoe, e.g. %s", len(unused), hf_dir, unused[:3])


def export_hf(checkpoint: str | pathlib.Path, out: str | pathlib.Path,
              shard_bytes: int = 4 << 30, dtype: str | None = None,
              rope_interleave: bool | None = None, overwrite: bool = False) -> pathlib.Path:
  """Writes a jmoe model checkpoint (or a training workdir) as a Hugging Face model directory
  (`out` must be empty or new, unless `overwrite`).

  `rope_interleave` (DeepSeek-V3 only) picks the rotary weight layout; default: interleaved, as
  DeepSeek's own checkpoints are.
  """
  out = pathlib.Path(out).absolute()
  refuse_to_overwrite(out, overwrite)  # (every process sees the same answer)
  if jax.process_index() != 0:  # the others hold their part of the model and gather with it
    _export(checkpoint, None, shard_bytes, dtype, rope_interleave)
    return out
  with written_in_place(out) as tmp:
    _export(checkpoint, tmp, shard_bytes, dtype, rope_interleave)
  return out


def _spread(abstract: jax.ShapeDtypeStruct, mesh: Mesh) -> NamedSharding:
  """A variable split over every device along its largest axis that they divide (else whole on
  each): no device, and no host, holds the whole model."""
  axes = [i for i, n in enumerate(abstract.shape) if n % mesh.size == 0]
  if not axes or mesh.size == 1:
    return NamedSharding(mesh, P())
  axis = max(axes, key=lambda i: abstract.shape[i])
  return NamedSharding(mesh, P(*[None] * axis, "devices"))


def _host(x: jax.Array) -> np.ndarray:
  """A (slice of a) spread variable, whole, on this host (a collective with several processes)."""
  if jax.process_count() == 1:
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _export(checkpoint, out: pathlib.Path | None, shard_bytes: int, dtype: str | None,
            rope_interleave: bool | None) -> None:
  """Writes the Hugging Face files into `out` (None: a process other than the first, which only
  takes part in reading and gathering). The model is spread over every device of every process;
  one layer of one variable at a time comes to the host, with a LoRA run's adapters folded in."""
  config = read_config(checkpoint)
  family = check_exportable(config.model, config.moe)
  if config.model.mtp_depth and not family.mtp_layers:
    log.warning("the %d multi-token prediction module(s) are not exported: transformers' "
                "%s has none", config.model.mtp_depth, family.architecture)
  abstract = nnx.state(nnx.eval_shape(model_factory(config)))
  mesh = Mesh(np.array(jax.devices()), ("devices",))
  params = read_variables(checkpoint, abstract, jax.tree.map(lambda a: _spread(a, mesh), abstract))
  np_dtype = np.dtype(DTYPES[dtype or config.precision.params])
  writer = ShardedWriter(out, shard_bytes) if out is not None else None
  add = (lambda name, tensor: writer.add(name, tensor)) if writer else (lambda *_: None)
  hf = family.to_hf(config.model, config.moe)
  if "rope_interleave" in hf and rope_interleave is not None:
    hf["rope_interleave"] = rope_interleave
  interleaved = bool(hf.get("rope_interleave", False))
  take = lambda variable, layer: _host(variable[...] if layer is None else variable[...][layer])
  for path, variable, layer, prefix, (_, to_hf) in _walk(config, family, params, interleaved):
    value = take(variable, layer)
    adapter = _adapter_of(params, path)
    if adapter is not None:
      value = fold(value, take(adapter["a"], layer), take(adapter["b"], layer), config.lora.scale)
    # Parameters in the asked dtype; other state (DeepSeek's selection bias) stays float32.
    out_dtype = np_dtype if isinstance(variable, nnx.Param) else np.dtype(np.float32)
    for name, tensor in to_hf(value).items():
      add(prefix + name, tensor.astype(out_dtype))
  for prefix in mtp_prefixes(config, family):  # the copies of the shared embedding and head
    table = take(params["embed"]["table"], None)
    head = table if params.get("head_DV") is None else take(params["head_DV"], None).T
    add(prefix + "embed_tokens.weight", table.astype(np_dtype))
    add(prefix + "shared_head.head.weight", head.astype(np_dtype))
  if writer is None:
    return
  writer.close()
  hf["dtype"] = str(np_dtype) if np_dtype != np.dtype("bfloat16") else "bfloat16"
  (out / "config.json").write_text(json.dumps(hf, indent=2))
  copy_tokenizer_files(pathlib.Path(checkpoint), out)


def _adapter_of(params: nnx.State, path: tuple[str, ...]):
  """The LoRA factors of the weight at `path`, or None."""
  node = params
  for key in path[:-1] + ("lora",):
    node = node.get(key) if hasattr(node, "get") else None
    if node is None:
      return None
  return node.get(path[-1])
