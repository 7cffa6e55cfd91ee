"""Hugging Face model directories on disk: safetensors read tensor by tensor across (sharded)
files, written in shards with their index, and output directories written in place by every
process of a conversion (jmoe.outputs: a temporary directory moved into place once complete, only
over what was checked)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import secrets
import shutil
from typing import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from jmoe.checkpoint.streamed import raise_everywhere
from jmoe.config import ConfigError
from jmoe.outputs import Output, written

INDEX = "model.safetensors.index.json"


class SafetensorsReader:
  """Looks tensors up by name across the files of one checkpoint directory."""

  def __init__(self, directory: pathlib.Path):
    index = directory / INDEX
    if index.is_file():
      weight_map = read_json(index).get("weight_map")
      if not isinstance(weight_map, dict):
        raise ConfigError(f"{index} has no weight_map; the download is incomplete or damaged")
      files = sorted(set(weight_map.values()))
      missing = [f for f in files if not (directory / f).is_file()]
      if missing:
        raise ConfigError(f"{index} names {missing[0]}, which is not in {directory} (of "
                          f"{len(files)} shards, {len(missing)} are missing): finish the download")
    else:
      files = sorted(p.name for p in directory.glob("*.safetensors"))
      if not files:
        raise ConfigError(f"{directory} has no *.safetensors files (nor {INDEX})")
      weight_map = {}
      for name in files:
        with self._open(directory / name) as f:
          weight_map.update({k: name for k in f.keys()})
    self.directory, self.weight_map = directory, weight_map
    self.used: set[str] = set()

  @staticmethod
  def _open(path: pathlib.Path):
    try:
      return safe_open(path, "np")
    except Exception as e:  # noqa: BLE001 - safetensors' errors for a file it cannot read
      raise ConfigError(f"{path} is not a readable safetensors file ({type(e).__name__}: "
                        f"{str(e)[:200]}); download it again") from None

  def __call__(self, name: str, rows: slice | None = None) -> np.ndarray:
    """The weight `name` (only `rows` of its leading axis, if given), of a floating-point dtype
    and every value finite (checked here, as each is read for conversion); MXFP4 weights
    (`name`_blocks and _scales) dequantized to float32."""
    if name not in self.weight_map and f"{name}_blocks" in self.weight_map:
      value = dequantize_mxfp4(self.read(f"{name}_blocks", rows, MXFP4_DTYPES),
                               self.read(f"{name}_scales", rows, MXFP4_DTYPES), name)
      where = f"the MXFP4 tensors {name}_blocks and {name}_scales"
    else:
      value, where = self.read(name, rows, FLOAT_DTYPES), f"tensor {name!r}"
    bad = value.size - np.count_nonzero(np.isfinite(value))
    if not bad and value.dtype == np.float64:  # finite, but past float32 once converted
      bad = np.count_nonzero(np.abs(value) > np.finfo(np.float32).max)
    if bad:
      raise ConfigError(f"{where} in {self.directory} holds {bad} non-finite value(s) (NaN or "
                        f"inf, or past float32's range) of {value.size}: the checkpoint is "
                        f"damaged; download it again")
    return value

  def read(self, name: str, rows: slice | None, dtypes: tuple[str, ...]) -> np.ndarray:
    """The tensor `name` as stored (only `rows` of its leading axis, if given), which must have
    one of the safetensors `dtypes`."""
    if name not in self.weight_map:
      raise ConfigError(f"tensor {name!r} is missing from {self.directory}")
    self.used.add(name)
    path = self.directory / self.weight_map[name]
    with self._open(path) as f:
      try:
        stored = f.get_slice(name).get_dtype()
        if stored not in dtypes:
          raise ConfigError(f"tensor {name!r} in {path} is {stored}; jmoe imports weights of "
                            f"{', '.join(dtypes)} (a quantized checkpoint: convert a "
                            f"dequantized copy)")
        return f.get_tensor(name) if rows is None else f.get_slice(name)[rows]
      except ConfigError:
        raise
      except Exception as e:  # noqa: BLE001 - a truncated file fails here
        raise ConfigError(f"tensor {name!r} cannot be read from {path} ({type(e).__name__}: "
                          f"{str(e)[:200]}); download it again") from None


# The stored dtypes import takes (converted to the parameters' dtype), and those of MXFP4's
# blocks and scales.
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
MXFP4_DTYPES = ("U8",)


# What a model directory holds for its tokenizer and chat template; carried by import-hf into
# the checkpoint, by training into its workdir, and by export-hf back out.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def copy_tokenizer_files(source: pathlib.Path, target: pathlib.Path, replace: bool = True
                         ) -> list[str]:
  """Copies the `TOKENIZER_FILES` that `source` has into `target` (not over ones already there
  unless `replace`); returns their names."""
  copied = []
  for name in TOKENIZER_FILES:
    if (source / name).is_file() and (replace or not (target / name).exists()):
      shutil.copyfile(source / name, target / name)
      copied.append(name)
  return copied


# The 16 values of a float4 e2m1 nibble (sign, 2 exponent bits, 1 mantissa bit).
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str = "") -> np.ndarray:
  """A weight stored as MXFP4 (GPT-OSS's release): `blocks` [..., out, G, 16] bytes, each two
  e2m1 values (the low nibble first), and `scales` [..., out, G] e8m0 exponents (bias 127), one
  per 32 values along the input axis. Returns the float32 weight [..., in = 32 G, out], the
  layout of the unquantized tensor; every value is exact."""
  if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
    raise ConfigError(f"{name}: MXFP4 blocks {blocks.shape} {blocks.dtype} and scales "
                      f"{scales.shape} {scales.dtype} do not fit together (uint8 [..., G, 16] "
                      f"and uint8 [..., G])")
  values = np.empty(blocks.shape[:-1] + (32,), np.float32)
  values[..., 0::2] = FP4_E2M1[blocks & 0x0F]
  values[..., 1::2] = FP4_E2M1[blocks >> 4]
  values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
  return values.reshape(*blocks.shape[:-2], -1).swapaxes(-1, -2)


def read_json(path: pathlib.Path) -> dict:
  try:
    value = json.loads(path.read_text())
  except (ValueError, OSError) as e:
    raise ConfigError(f"{path} is not valid JSON ({e})") from None
  if not isinstance(value, dict):
    raise ConfigError(f"{path} holds {type(value).__name__}, not a JSON object")
  return value


@contextlib.contextmanager
def written_in_place(output: Output, every_process: bool = False) -> Iterator[pathlib.Path]:
  """The temporary directory beside `output` (checked by `jmoe.outputs.check`) to write into,
  published once the block ends without an error, removed if it fails (jmoe.outputs.written).
  With `every_process`, the processes of a multi-process run all write into the first one's,
  which makes and publishes it; a failure there stops them all."""
  if not every_process or jax.process_count() == 1:
    with written(output) as tmp:
      yield tmp
    return
  pid, number = (int(n) for n in multihost_utils.broadcast_one_to_all(
      np.array([os.getpid(), secrets.randbits(31)], np.int32)))
  tag, first = f"{pid}-{number:08x}", jax.process_index() == 0
  with contextlib.ExitStack() as stack:
    error = None
    if first:
      try:
        stack.enter_context(written(output, tag))
      except ConfigError as e:
        error = e
    raise_everywhere(error)
    yield output.temporary(tag)
    multihost_utils.sync_global_devices(f"jmoe: written {output.path}")
    if first:
      try:
        stack.close()  # publishes
      except ConfigError as e:
        error = e
    raise_everywhere(error)


class ShardedWriter:
  """Writes tensors into safetensors files of at most `shard_bytes`, under names of its own
  (`tag`: one writer per process); `name_shards` then names every writer's files as Hugging Face
  does and writes the index. Holds at most one file's tensors."""

  def __init__(self, directory: pathlib.Path, shard_bytes: int, tag: str = "0"):
    self.directory, self.shard_bytes, self.tag = directory, shard_bytes, tag
    self.pending: dict[str, np.ndarray] = {}
    self.written: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
    self.total = 0

  def add(self, name: str, tensor: np.ndarray) -> None:
    if self.pending and sum(t.nbytes for t in self.pending.values()) + tensor.nbytes > \
        self.shard_bytes:
      self._flush()
    self.pending[name] = np.ascontiguousarray(tensor)
    self.total += tensor.nbytes

  def _flush(self) -> None:
    name = f"part-{self.tag}-{len(self.written):05d}.safetensors"
    try:
      save_file(self.pending, self.directory / name, metadata={"format": "pt"})
    except Exception as e:  # noqa: BLE001 - safetensors says an I/O error in its own type
      code = re.search(r"\(os error (\d+)\)", str(e))
      if code is None:
        raise
      raise OSError(int(code.group(1)), os.strerror(int(code.group(1))),
                    str(self.directory / name)) from None
    self.written.append((name, list(self.pending)))
    self.pending = {}

  def close(self) -> None:
    """Writes what is pending and the list of this writer's files (for `name_shards`)."""
    if self.pending:
      self._flush()
    (self.directory / f".parts-{self.tag}.json").write_text(json.dumps(
        {"files": self.written, "bytes": self.total}))


def name_shards(directory: pathlib.Path, tags: list[str]) -> tuple[int, list[int]]:
  """Renames the files of the closed writers `tags` (in that order) to
  model-0000i-of-0000n.safetensors, or model.safetensors if there is one, and writes the index.
  Returns the number of files and each writer's number of tensors."""
  written, total, counts = [], 0, []
  for tag in tags:
    manifest = directory / f".parts-{tag}.json"
    parts = json.loads(manifest.read_text())
    written += parts["files"]
    total += parts["bytes"]
    counts.append(sum(len(names) for _, names in parts["files"]))
    manifest.unlink()
  n = len(written)
  if n == 1:
    (directory / written[0][0]).rename(directory / "model.safetensors")
    return n, counts
  weight_map = {}
  for i, (tmp, names) in enumerate(written):
    final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    (directory / tmp).rename(directory / final)
    weight_map.update({k: final for k in names})
  (directory / INDEX).write_text(json.dumps(
      {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
  return n, counts
