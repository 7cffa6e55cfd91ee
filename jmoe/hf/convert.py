"""Hugging Face checkpoints in and out: local directories of config.json + safetensors.

Both directions go one part of one variable at a time (a layer; a block of a layer's experts), on
the host, so neither holds the model in memory nor needs a device. Import reads a part's tensors
from the (possibly sharded) safetensors files when the checkpoint writer asks for it
(jmoe/checkpoint/streamed.py); export reads a part from the checkpoint's chunks and adds its
tensors to a safetensors file, written as soon as it is full. Every jmoe parameter has one mapping
(mappings.py); a tensor that is missing is an error naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import pathlib
from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jmoe.hf.families import Family, check_exportable, family_of_hf
from jmoe.hf.fields import HFFields
from jmoe.hf.files import (SafetensorsReader, ShardedWriter, copy_tokenizer_files,
                                      name_shards, read_json, written_in_place)
from jmoe.hf.mappings import Mapping, mtp_prefixes, walk
from jmoe.checkpoint.params import open_variables, read_config
from jmoe.checkpoint.streamed import (Region, StreamedArray, part_shape, raise_everywhere,
                                      save_streamed, unreadable)
from jmoe.config import (Config, ConfigError, PrecisionConfig, from_config_dict,
                         to_dict)
from jmoe.model.factory import model_factory
from jmoe.ops.lora import fold
from jmoe.ops.params import DTYPES
from jmoe.outputs import check

log = logging.getLogger("jmoe")


PART_BYTES = 1 << 30  # the most bytes of a block of experts that conversion makes at once


def import_hf(hf_dir: str | pathlib.Path, out: str | pathlib.Path,
              params_dtype: str = "float32", overwrite: bool = False,
              part_bytes: int = PART_BYTES) -> Config:
  """Reads a local Hugging Face model directory; writes a jmoe model checkpoint to `out` (which
  must be empty or new, unless `overwrite`; moved into place once complete, jmoe.outputs). One
  part of one variable is read, converted and written at a time (one layer; of the routed
  experts' weights, a block of experts within `part_bytes`), the next made while the last is
  written: the host holds a few parts, never the model. Run in several processes, each reads and
  writes its share of the parts."""
  hf_dir = pathlib.Path(hf_dir)
  output = check(out, directory=True, overwrite=overwrite, inputs={"--hf-dir": hf_dir})
  if not (hf_dir / "config.json").is_file():
    raise ConfigError(f"{hf_dir / 'config.json'} does not exist: pass a local Hugging Face model "
                      f"directory (config.json and *.safetensors)")
  hf = read_json(hf_dir / "config.json")
  family = family_of_hf(hf)
  fields = HFFields(hf, str(hf_dir / "config.json"), family.defaults)
  model_cfg, moe_cfg, interleaved = family.to_jmoe(fields)
  if jax.process_index() == 0:
    fields.warn_unread(family.ignored)
  read = SafetensorsReader(hf_dir)
  if model_cfg.mtp_depth:  # config.json may name modules whose weights were never saved
    present = [f"model.layers.{model_cfg.num_layers + k}.eh_proj.weight" in read.weight_map
               for k in range(model_cfg.mtp_depth)]
    if not all(present):
      log.info("%s: config.json names %d multi-token prediction module(s); the files hold %d",
               hf_dir, model_cfg.mtp_depth, present.index(False))
      model_cfg = dataclasses.replace(model_cfg, mtp_depth=present.index(False))
  try:
    config = from_config_dict(to_dict(Config(model=model_cfg, moe=moe_cfg,
                                             precision=PrecisionConfig(params=params_dtype,
                                                                       compute="float32"))))
  except ConfigError as e:
    raise ConfigError(f"{hf_dir / 'config.json'} describes a model jmoe cannot hold: "
                      f"{str(e).removeprefix('invalid config:').strip()}") from None
  params = nnx.state(nnx.eval_shape(model_factory(config)))
  _check_mtp_copies(read, config, family, hf_dir)
  layers: dict[tuple, list] = {}  # a variable's (HF prefix, mapping) for each layer, or the one
  stacked_paths = set()
  for path, _, layer, prefix, mapping in walk(config, family, params, interleaved):
    layers.setdefault(path, []).append((prefix, mapping))
    if layer is not None:
      stacked_paths.add(path)

  def streamed(path: tuple, variable) -> StreamedArray:
    stacked = path in stacked_paths
    experts = layers[path][0][1].import_blocks
    shape = part_shape(variable.shape, stacked, int(stacked) if experts else None,
                       np.dtype(variable.dtype).itemsize, part_bytes)

    def make(region: Region) -> np.ndarray:
      prefix, mapping = layers[path][region[0].start if stacked else 0]
      layer_shape = shape[1:] if stacked else shape
      block = {"experts": region[int(stacked)]} if experts else {}
      try:
        value = mapping.to_jmoe(lambda name, rows=None: read(prefix + name, rows), layer_shape,
                                **block)
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
  with written_in_place(output, every_process=True) as tmp:
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
              rope_interleave: bool | None = None, overwrite: bool = False,
              part_bytes: int = PART_BYTES) -> pathlib.Path:
  """Writes a jmoe model checkpoint (or a training workdir) as a Hugging Face model directory
  (`out` must be empty or new, unless `overwrite`). One part of one variable is read from the
  checkpoint at a time, on the host (a layer; of the routed experts' weights, a block of experts
  within `part_bytes` where each expert has tensors of its own, as all but GPT-OSS's checkpoints
  do), converted and added to the safetensors file being filled: the host holds that file (at
  most `shard_bytes`) and a part or two, never the model, and no device is used. Run in several
  processes, each reads and writes its share of the parts.

  `rope_interleave` (DeepSeek-V3 only) picks the rotary weight layout; default: interleaved, as
  DeepSeek's own checkpoints are.
  """
  output = check(out, directory=True, overwrite=overwrite, inputs={"--checkpoint": checkpoint})
  with written_in_place(output, every_process=True) as tmp:  # (every process checked the same)
    _export(pathlib.Path(checkpoint), tmp, shard_bytes, dtype, rope_interleave, part_bytes)
  return output.path


@dataclasses.dataclass(frozen=True)
class _Piece:
  """Tensors that export makes at once: one part of one variable, converted."""
  nbytes: int  # of the tensors it makes
  make: Callable[[], dict[str, np.ndarray]]


def _export(checkpoint: pathlib.Path, out: pathlib.Path, shard_bytes: int, dtype: str | None,
            rope_interleave: bool | None, part_bytes: int) -> None:
  """Writes the Hugging Face files into `out`: each process its share of the pieces (into files
  of its own), then the first names them all and writes the index and config.json."""
  config = read_config(checkpoint)
  family = check_exportable(config.model, config.moe)
  if config.model.mtp_depth and not family.mtp_layers and jax.process_index() == 0:
    log.warning("the %d multi-token prediction module(s) are not exported: transformers' "
                "%s has none", config.model.mtp_depth, family.architecture)
  hf = family.to_hf(config.model, config.moe)
  if "rope_interleave" in hf and rope_interleave is not None:
    hf["rope_interleave"] = rope_interleave
  np_dtype = np.dtype(DTYPES[dtype or config.precision.params])
  abstract = nnx.state(nnx.eval_shape(model_factory(config)))
  parts = _Parts(config, open_variables(checkpoint, abstract), np_dtype)
  pieces = parts.pieces(family, abstract, bool(hf.get("rope_interleave", False)), part_bytes)
  index, count = jax.process_index(), jax.process_count()
  error = None
  try:
    writer = ShardedWriter(out, shard_bytes, tag=f"{index:05d}")
    for piece in _share(pieces, count)[index]:
      for name, tensor in piece.make().items():
        writer.add(name, tensor)
    writer.close()
  except Exception as e:  # noqa: BLE001 - raised below, once every process knows
    error = e
  raise_everywhere(error)  # (a collective: every process has written its files)
  if index == 0:
    try:
      files, tensors = name_shards(out, [f"{i:05d}" for i in range(count)])
      hf["dtype"] = str(np_dtype) if np_dtype != np.dtype("bfloat16") else "bfloat16"
      (out / "config.json").write_text(json.dumps(hf, indent=2))
      copy_tokenizer_files(checkpoint, out)
      log.info("%d tensors in %d safetensors file(s), by process: %s", sum(tensors), files,
               " ".join(map(str, tensors)))
    except Exception as e:  # noqa: BLE001 - as above: the others wait for this one
      error = e
  raise_everywhere(error)


def _share(pieces: list[_Piece], count: int) -> list[list[_Piece]]:
  """The pieces of each of `count` processes: each piece, in order, to the one with the fewest
  bytes so far."""
  shares, load = [[] for _ in range(count)], [0] * count
  for piece in pieces:
    i = load.index(min(load))
    shares[i].append(piece)
    load[i] += piece.nbytes
  return shares


class _Parts:
  """A checkpoint's variables, opened (`StoredArray`s by path), read and converted a part at a
  time into Hugging Face tensors of `np_dtype` (float32 for variables that are not parameters,
  such as DeepSeek's selection bias)."""

  def __init__(self, config: Config, stored: dict, np_dtype: np.dtype):
    self.config, self.np_dtype = config, np_dtype
    self.stored = {tuple(str(key.key) for key in path): leaf
                   for path, leaf in jax.tree_util.tree_flatten_with_path(stored)[0]}

  def pieces(self, family: Family, abstract: nnx.State, interleaved: bool, part_bytes: int
             ) -> list[_Piece]:
    """Every piece of the export, in the mapping walk's order: a layer of a variable, or a block
    of experts of it within `part_bytes` where each expert has Hugging Face tensors of its own;
    then the prediction modules' copies of the embedding and head."""
    pieces = []
    for path, variable, layer, prefix, mapping in walk(self.config, family, abstract,
                                                       interleaved):
      out_dtype = self.np_dtype if isinstance(variable, nnx.Param) else np.dtype(np.float32)
      stacked = layer is not None
      axis = int(stacked) if mapping.export_blocks else None
      shape = part_shape(variable.shape, stacked, axis, self.stored[path].dtype.itemsize,
                         part_bytes)
      blocks = [None] if axis is None else [
          slice(i, i + shape[axis]) for i in range(0, variable.shape[axis], shape[axis])]
      for block in blocks:
        region = ((layer,) if stacked else ()) + ((block,) if block else ())
        pieces.append(_Piece(math.prod(shape) * out_dtype.itemsize, functools.partial(
            self.convert, path, region, mapping, block, prefix, out_dtype)))
    table = ("embed", "table")
    head = ("head_DV",) if ("head_DV",) in self.stored else None
    for prefix in mtp_prefixes(self.config, family):  # copies of the shared embedding and head
      nbytes = math.prod(self.stored[table].shape) * self.np_dtype.itemsize
      pieces.append(_Piece(nbytes, functools.partial(
          self.copy, table, False, prefix + "embed_tokens.weight")))
      pieces.append(_Piece(nbytes, functools.partial(
          self.copy, head or table, bool(head), prefix + "shared_head.head.weight")))
    return pieces

  def convert(self, path: tuple[str, ...], region: tuple, mapping: Mapping, block: slice | None,
              prefix: str, out_dtype: np.dtype) -> dict[str, np.ndarray]:
    """The Hugging Face tensors of one part (a LoRA run's adapters folded into it)."""
    value = self.read(path, region)
    lora = path[:-1] + ("lora", path[-1])
    if lora + ("a",) in self.stored:
      value = fold(value, self.read(lora + ("a",), region), self.read(lora + ("b",), region),
                   self.config.lora.scale)
    tensors = mapping.to_hf(value) if block is None else mapping.to_hf(value, experts=block)
    return {prefix + name: np.ascontiguousarray(t, dtype=out_dtype)
            for name, t in tensors.items()}

  def copy(self, path: tuple[str, ...], transpose: bool, name: str) -> dict[str, np.ndarray]:
    value = self.read(path, ())
    return {name: np.ascontiguousarray(value.T if transpose else value, dtype=self.np_dtype)}

  def read(self, path: tuple[str, ...], region: tuple) -> np.ndarray:
    stored = self.stored[path]
    try:
      return stored.read(region)
    except ConfigError:  # (a folded weight names the part that failed)
      raise
    except Exception as e:  # noqa: BLE001 - tensorstore's errors for a damaged chunk
      raise unreadable(stored, ".".join(path), region, e) from None
