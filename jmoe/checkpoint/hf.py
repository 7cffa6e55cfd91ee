"""Hugging Face checkpoints in and out: local directories of config.json + safetensors.

Import goes one part of one variable at a time (a layer; a block of a layer's experts): it reads
that part's tensors from the (possibly sharded) safetensors files when the checkpoint writer asks
for it (jmoe/checkpoint/streamed.py), so it never holds the model in host memory. Export reads the
checkpoint onto the devices, brings one layer of one variable at a time to the host, and flushes
a safetensors shard as soon as it is full. Every jmoe parameter has one mapping
(hf_mappings.py); a tensor that is missing is an error naming it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmoe.checkpoint.hf_families import Family, check_exportable, family_of_hf
from jmoe.checkpoint.hf_files import (SafetensorsReader, ShardedWriter, copy_tokenizer_files,
                                      read_json, refuse_to_overwrite, written_in_place)
from jmoe.checkpoint.hf_mappings import EXPERT_AXIS, mtp_prefixes, walk
from jmoe.checkpoint.params import read_config, read_variables
from jmoe.checkpoint.streamed import Region, StreamedArray, part_shape, save_streamed
from jmoe.config import (Config, ConfigError, PrecisionConfig, from_config_dict,
                         to_dict)
from jmoe.model.factory import model_factory
from jmoe.ops.lora import fold
from jmoe.ops.params import DTYPES

log = logging.getLogger("jmoe")


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
  stacked_paths = set()
  for path, _, layer, prefix, (to_jmoe, _) in walk(config, family, params, interleaved):
    layers.setdefault(path, []).append((prefix, to_jmoe))
    if layer is not None:
      stacked_paths.add(path)

  def streamed(path: tuple, variable) -> StreamedArray:
    stacked = path in stacked_paths
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
  for path, variable, layer, prefix, (_, to_hf) in walk(config, family, params, interleaved):
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
