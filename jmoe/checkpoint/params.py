"""Model checkpoints: a model's variables (Orbax) and its config (JSON) in one directory.

    CKPT/config.json   the jmoe config the model belongs to
    CKPT/model/        an Orbax checkpoint of every model variable (parameters, expert biases)

`jmoe.convert import-hf` and `jmoe.convert upcycle` write these. Whatever reads a model (scoring,
export, `checkpoint.load_params`) also takes a training workdir and reads the model variables of
its latest checkpoint, without its optimizer state. A LoRA run's workdir reads as its frozen
model (checked against the fingerprint its checkpoint records) with its adapters, or, for a
reader that wants a model without adapters, with them folded into the weights.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
import numpy as np
from flax import nnx

from jmoe.checkpoint.disk import quiet_failed_writes, quiet_orbax, require_complete
from jmoe.checkpoint.manager import Checkpointer
from jmoe.checkpoint.target import describe_mismatch, with_shardings
from jmoe.checkpoint.fingerprint import fingerprint
from jmoe.checkpoint.streamed import (OPENED, FoldedArray, StoredArray, open_checkpointer,
                                      unreadable)
from jmoe.checkpoint.writer import part_save_args, use_array_writer
from jmoe.config import Config, ConfigError, LoRAConfig, from_config_dict, to_dict
from jmoe.parallel import Layout
from jmoe.model.factory import model_factory
from jmoe.ops.fp8 import Fp8History
from jmoe.ops.params import FROZEN_PARAMS, LoRAParam

log = logging.getLogger("jmoe")


def save_model(directory: str | pathlib.Path, state: nnx.State, config: Config) -> None:
  """Writes `state` (on any devices) and `config`; at most CONCURRENT_GB of the arrays (or the
  largest shard of one) are on their way to the files at any time."""
  directory = pathlib.Path(directory).absolute()
  directory.mkdir(parents=True, exist_ok=True)
  largest = max((shard.data.nbytes for leaf in jax.tree.leaves(state)
                 if isinstance(leaf, jax.Array) for shard in leaf.addressable_shards), default=0)
  use_array_writer()
  handler = ocp.StandardCheckpointHandler(save_concurrent_gb=_window_gb(largest))
  with quiet_failed_writes(), ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(directory / "model", args=ocp.args.StandardSave(
        nnx.to_pure_dict(state), save_args=nnx.to_pure_dict(part_save_args(state))), force=True)
  (directory / "config.json").write_text(json.dumps(to_dict(config), indent=2))


def read_config(directory: str | pathlib.Path) -> Config:
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise ConfigError(f"{directory} does not exist: pass a model checkpoint (from `jmoe.convert "
                      f"import-hf` or `upcycle`) or a training --workdir")
  path = directory / "config.json"
  if not path.is_file():
    raise ConfigError(f"{path} does not exist: pass a directory written by `jmoe.convert "
                      f"import-hf` or `upcycle`, or a training --workdir")
  try:
    saved = json.loads(path.read_text())
  except ValueError as e:
    raise ConfigError(f"{path} is not valid JSON ({e}); it is the config this model was saved "
                      f"with: restore it, or write it again from the config file") from None
  return from_config_dict(saved)


CONCURRENT_GB = 2  # GB of arrays in flight between the devices and a model's files, at most


def _window_gb(largest_shard_bytes: int) -> int:
  """Orbax's window for a model's arrays: CONCURRENT_GB, or the largest shard (Orbax moves a
  shard at once)."""
  return max(CONCURRENT_GB, math.ceil(largest_shard_bytes / 1e9))


def _largest_shard(sharding, shape) -> int:
  """Elements in the largest shard `sharding` makes of an array of `shape`."""
  return max(math.prod(s.stop - s.start if isinstance(s, slice) and s.start is not None
                       else n for s, n in zip(index, shape))
             if index else 1 for index in sharding.devices_indices_map(shape).values())

# How a model runs rather than what it is: kept from the run's own config when the architecture
# comes from `checkpoint.load_params` (`checkpoint.load_params_config`).
RUN_CHOICES = {"model": ("attention_kernel", "scan_unroll"),
               "moe": ("dispatcher", "dispatch_factor", "dispatch_chunks", "capacity_factor",
                       "drop_policy", "gemm", "expert_blocks", "balance"),
               "moe.router": ("jitter", "force_balanced")}


def with_saved_architecture(config: Config) -> Config:
  """`config` with the model architecture of `checkpoint.load_params` when
  `checkpoint.load_params_config` asks for it (else `config` itself)."""
  if not (config.checkpoint.load_params and config.checkpoint.load_params_config):
    return config
  saved = read_config(config.checkpoint.load_params)
  keep = lambda group, own, names: dataclasses.replace(
      group, **{name: getattr(own, name) for name in names})
  router = keep(saved.moe.router, config.moe.router, RUN_CHOICES["moe.router"])
  moe = dataclasses.replace(keep(saved.moe, config.moe, RUN_CHOICES["moe"]), router=router)
  model = keep(saved.model, config.model, RUN_CHOICES["model"])
  return from_config_dict(to_dict(dataclasses.replace(config, model=model, moe=moe)))


def read_variables(directory: str | pathlib.Path, abstract: nnx.State, shardings: nnx.State
                   ) -> nnx.State:
  """The model variables saved in `directory` (a model checkpoint or a training workdir), shaped
  like `abstract` and placed by `shardings`."""
  state = jax.tree.map(lambda x: x, abstract)  # a copy to fill in
  nnx.replace_by_pure_dict(state, _read(pathlib.Path(directory).absolute(), abstract, shardings))
  return state


def open_variables(directory: str | pathlib.Path, abstract: nnx.State) -> dict[str, Any]:
  """The model variables saved in `directory`, as `read_variables` finds them, opened on the host
  and not read: a pure dict (nnx.to_pure_dict's nesting) of `StoredArray`s, each read a region
  (a layer, a block of experts) at a time."""
  return _read(pathlib.Path(directory).absolute(), abstract, None)


def _read(directory: pathlib.Path, abstract: nnx.State, shardings: nnx.State | None,
          within: tuple[pathlib.Path, ...] = ()) -> dict[str, Any]:
  """The pure dict of the model variables in `directory`: arrays placed by `shardings`, or
  opened `StoredArray`s (`FoldedArray`s) where `shardings` is None. `within`: the LoRA workdirs
  whose frozen model this is, outermost first."""
  if not directory.is_dir():
    raise ConfigError(f"{directory} does not exist: pass a model checkpoint (from `jmoe.convert "
                      f"import-hf` or `upcycle`) or a training --workdir")
  if (not (directory / "model").is_dir() and (directory / "config.json").is_file()
      and read_config(directory).lora.rank):
    if any(isinstance(v, LoRAParam) for _, v in nnx.to_flat_state(abstract)):
      return _read_adapted(directory, abstract, shardings, within)
    return _read_folded(directory, abstract, shardings, within)
  target = nnx.to_pure_dict(abstract)
  if shardings is not None:
    target = with_shardings(target, nnx.to_pure_dict(shardings))
  run_state = lambda: _run_state_paths(read_config(directory))
  if not (directory / "model").is_dir():
    return _read_newest_readable(directory, target, run_state, opened=shardings is None)[1]
  with ocp.StandardCheckpointer() as checkpointer:
    _check(directory / "model", checkpointer.metadata(directory / "model").item_metadata,
           target, run_state())
  if shardings is None:
    try:
      with open_checkpointer() as checkpointer:
        return checkpointer.restore(directory / "model", args=ocp.args.PyTreeRestore(
            item=target, restore_args=jax.tree.map(lambda _: OPENED, target)))
    except Exception as e:  # noqa: BLE001 - opening reads only metadata: damaged files
      raise ConfigError(f"{directory / 'model'} cannot be opened ({type(e).__name__}: "
                        f"{str(e)[:300]}); the checkpoint is damaged: convert or save it again"
                        ) from None
  largest = max((_largest_shard(s, x.shape) * np.dtype(x.dtype).itemsize
                 for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings))),
                default=0)
  handler = ocp.StandardCheckpointHandler(restore_concurrent_gb=_window_gb(largest))
  with ocp.Checkpointer(handler) as checkpointer:
    return checkpointer.restore(directory / "model", args=ocp.args.StandardRestore(target))


def _read_adapted(workdir: pathlib.Path, abstract: nnx.State, shardings: nnx.State | None,
                  within: tuple[pathlib.Path, ...] = ()) -> dict[str, Any]:
  """The model of a LoRA run's workdir: its frozen parameters from the model it was trained on
  (its checkpoint.load_params, checked against the fingerprint its checkpoint records), the
  adapters and the other variables from its newest checkpoint, which holds nothing else."""
  config = read_config(workdir)
  base = pathlib.Path(config.checkpoint.load_params).absolute()
  if workdir in within:  # (directories replaced after the runs)
    chain = " -> ".join(map(str, within[within.index(workdir):] + (workdir,)))
    raise ConfigError(f"the models under the LoRA adapters in {workdir} lead back to it "
                      f"(checkpoint.load_params: {chain}): put the model they were trained "
                      f"on back at {base}")
  if not base.is_dir():
    raise ConfigError(f"{workdir} holds LoRA adapters trained on the model in {base}, which is "
                      f"gone; the adapters need it: put it back there")
  split = lambda tree, which: None if tree is None else nnx.split_state(tree, which, ...)
  part = lambda tree, which, i: None if tree is None else split(tree, which)[i]
  model = _read(base, part(abstract, nnx.Not(LoRAParam), 0),
                part(shardings, nnx.Not(LoRAParam), 0), within + (workdir,))
  frozen = _subset(nnx.to_pure_dict(part(abstract, FROZEN_PARAMS, 0)), model)
  target = nnx.to_pure_dict(part(abstract, FROZEN_PARAMS, 1))
  if shardings is not None:
    target = with_shardings(target, nnx.to_pure_dict(part(shardings, FROZEN_PARAMS, 1)))
  step, own = _read_newest_readable(workdir, target, lambda: _run_state_paths(config),
                                    opened=shardings is None)
  _check_base(workdir, step, base, frozen)
  return merge_dicts(frozen, own)


def _read_folded(workdir: pathlib.Path, abstract: nnx.State, shardings: nnx.State | None,
                 within: tuple[pathlib.Path, ...]) -> dict[str, Any]:
  """The model of a LoRA run's workdir as a model without adapters (what `abstract` asks for:
  the load_params of another run, a full one or a LoRA one on top): each adapter folded into its
  weight, W + (alpha / r) A B in float32 then in W's dtype, as export-hf writes it. Each matrix
  is folded whole on the host (jmoe.ops.lora.product), so the values are the same bit for bit
  whatever the layout: a LoRA run on this model finds its fingerprint again when it resumes."""
  config = read_config(workdir)
  opened = _read_adapted(workdir, nnx.state(nnx.eval_shape(model_factory(config))), None,
                         within)
  values = _folded(opened, config.lora.scale)
  target = nnx.to_pure_dict(abstract)
  problem = describe_mismatch(
      _without_run_state(values, target, _run_state_paths(config)), target)
  if problem:
    raise ConfigError(f"the model in {workdir} (its LoRA adapters folded into their weights) "
                      f"does not fit this config: {problem}. Use the model settings it was "
                      f"saved with (its config.json)")
  values = _subset(target, values)
  if shardings is None:
    return values
  return jax.tree_util.tree_map_with_path(_placed, values, nnx.to_pure_dict(shardings))


def _folded(opened: dict, scale: float, path: tuple[str, ...] = ()) -> dict:
  """Opened model variables with each adapter folded into its weight (a `FoldedArray`), and the
  adapters gone."""
  out = {key: _folded(value, scale, path + (str(key),)) if isinstance(value, dict) else value
         for key, value in opened.items() if key != "lora"}
  for name, factors in opened.get("lora", {}).items():
    out[name] = FoldedArray(out[name], factors["a"], factors["b"], scale,
                            ".".join(path + (str(name),)))
  return out


def _placed(path, stored: StoredArray | FoldedArray, sharding: jax.sharding.Sharding
            ) -> jax.Array:
  """The values of `stored` as an array placed by `sharding`: each device's shard read from the
  files (once for the devices that hold the same one)."""
  shards = {}

  def shard(index: tuple[slice, ...]) -> np.ndarray:
    key = tuple((s.start, s.stop) for s in index)
    if key not in shards:
      try:
        shards[key] = stored.read(index)
      except ConfigError:
        raise
      except Exception as e:  # noqa: BLE001 - tensorstore's errors for a damaged chunk
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        raise unreadable(stored, name, index, e) from None
    return shards[key]

  return jax.make_array_from_callback(tuple(stored.shape), sharding, shard)


def _check_base(workdir: pathlib.Path, step: int, base: pathlib.Path, frozen: dict) -> None:
  """Refuses adapters on other weights than the frozen model they were trained on, as their
  checkpoint records it (a LoRA run's `run` item). Opened (not yet read) weights are read for
  this, a part at a time."""
  checkpointer = Checkpointer(workdir / "checkpoints", keep=1)
  saved = (checkpointer.run_record(step) or {}).get("lora_base")
  checkpointer.close()
  if saved and saved["fingerprint"] != fingerprint(frozen):
    raise ConfigError(f"{workdir} holds LoRA adapters trained on the model in {saved['path']} "
                      f"(fingerprint {saved['fingerprint']}), but {base} holds other weights "
                      f"now: put the model they were trained on back there")


def _subset(target: dict, values: dict) -> dict:
  """The entries of `values` at the paths of `target`."""
  return {key: _subset(value, values[key]) if isinstance(value, dict) else values[key]
          for key, value in target.items()}


def _read_newest_readable(workdir: pathlib.Path, target: dict[str, Any],
                          run_state: Callable[[], set[tuple[str, ...]]], opened: bool
                          ) -> tuple[int, dict[str, Any]]:
  """(step, model variables) of a training workdir's newest checkpoint that can be read
  (`opened`: as StoredArrays); the damaged ones after it are reported and passed over (not
  moved: reading changes nothing)."""
  steps = []
  if (workdir / "checkpoints").is_dir():
    checkpointer = Checkpointer(workdir / "checkpoints", keep=1)
    steps = checkpointer.all_steps()
    checkpointer.close()
  if not steps:
    raise ConfigError(f"{workdir} holds neither model/ (a model checkpoint) nor a checkpoint "
                      f"under checkpoints/ (a training workdir)")
  paths = run_state()
  for step in reversed(steps):
    path = workdir / "checkpoints" / str(step) / "state"
    try:
      return step, _read_from_train_state(path, target, paths, opened)
    except ConfigError:
      raise
    except Exception as e:  # noqa: BLE001 - any read failure means this step is damaged
      log.warning("checkpoint %s cannot be read (%s: %s); trying the one before it", path.parent,
                  type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
  raise ConfigError(f"no checkpoint under {workdir / 'checkpoints'} can be read (steps {steps})")


def _read_from_train_state(path: pathlib.Path, target: dict[str, Any],
                           run_state: set[tuple[str, ...]], opened: bool) -> dict[str, Any]:
  """Only the model variables of a saved train state (its `params` and `rest`). There each
  variable is a {"value": array} node, as nnx flattens a Variable, and list indices are strings."""
  require_complete(path)
  with quiet_orbax(), ocp.PyTreeCheckpointer() as checkpointer:
    saved = checkpointer.metadata(path).item_metadata
  saved_model = {}
  for part in ("params", "rest"):
    saved_model = merge_dicts(saved_model, _unwrap(dict(saved.get(part) or {})))
  _check(path, saved_model, _string_keys(target), run_state)
  split = {part: _in_saved_form(target, saved.get(part) or {}) for part in ("params", "rest")}
  split = {part: tree for part, tree in split.items() if tree}  # an empty one reads as a leaf
  restore_args = (jax.tree.map(lambda _: OPENED, split) if opened
                  else ocp.checkpoint_utils.construct_restore_args(split))
  with quiet_orbax(), (open_checkpointer() if opened else ocp.PyTreeCheckpointer()) as reader:
    restored = reader.restore(path, args=ocp.args.PyTreeRestore(
        item=split, restore_args=restore_args, partial_restore=True))
  return _like(target, merge_dicts(_unwrap(restored.get("params", {})),
                                   _unwrap(restored.get("rest", {}))))


def _run_state_paths(config: Config) -> set[tuple[str, ...]]:
  """Where the model `config` describes keeps variables of a run rather than of the model (FP8
  amax histories, jmoe/ops/fp8.py): a model read from a checkpoint may hold them or not, and
  those the reading config has start fresh."""
  histories = nnx.state(nnx.eval_shape(model_factory(config)), Fp8History)
  return {tuple(str(key) for key in path) for path, _ in nnx.to_flat_state(histories)}


def _without_run_state(saved: Any, target: Any, run_state: set[tuple[str, ...]],
                       path: tuple[str, ...] = ()) -> Any:
  """`saved` without the run-state variables that `target` does not ask for."""
  if not isinstance(saved, dict):
    return saved
  wanted = target if isinstance(target, dict) else {}
  return {key: _without_run_state(value, wanted.get(key, {}), run_state, path + (str(key),))
          for key, value in saved.items()
          if not (path + (str(key),) in run_state and key not in wanted)}


def _string_keys(tree: Any) -> Any:
  if isinstance(tree, dict):
    return {str(key): _string_keys(value) for key, value in tree.items()}
  return tree


def _unwrap(tree: Any) -> Any:
  if isinstance(tree, dict):
    if set(tree) == {"value"}:
      return tree["value"]
    return {key: _unwrap(value) for key, value in tree.items()}
  return tree


def _in_saved_form(target: dict, saved: Any) -> dict:
  """The part of `target` whose variables are in the saved tree, keyed and nested as there."""
  out = {}
  for key, value in target.items():
    key = str(key)
    if key in saved:
      if isinstance(value, dict):
        part = _in_saved_form(value, saved[key])
        if part:  # an empty subtree would read as a leaf
          out[key] = part
      else:
        wrapped = isinstance(saved[key], dict) and set(saved[key]) == {"value"}
        out[key] = {"value": value} if wrapped else value
  return out


def _like(target: dict, values: dict) -> dict:
  """`values` (string keys) with the keys of `target` (which may be list indices)."""
  return {key: _like(value, values[str(key)]) if isinstance(value, dict) else values[str(key)]
          for key, value in target.items()}


def merge_dicts(a: dict, b: dict) -> dict:
  out = dict(a)
  for key, value in b.items():
    out[key] = merge_dicts(out[key], value) if isinstance(out.get(key), dict) else value
  return out


def _check(path: pathlib.Path, saved: Any, target: Any, run_state: set[tuple[str, ...]]) -> None:
  problem = describe_mismatch(_without_run_state(saved, target, run_state), target)
  if problem:
    raise ConfigError(f"the model in {path} does not fit this config: {problem}. Use the "
                      f"model settings it was saved with (its config.json)")


def load_model(directory: str | pathlib.Path, layout: Layout, merge_adapters: bool = False
               ) -> tuple[Config, nnx.Module]:
  """The model of a model checkpoint, or of a training workdir's latest checkpoint, with its
  variables placed on `layout`; a LoRA run's with its adapters, or (`merge_adapters`) with
  them folded into its weights, as a model without LoRA."""
  config = read_config(directory)
  if merge_adapters and config.lora.rank:
    config = dataclasses.replace(config, lora=LoRAConfig())
  graphdef, abstract = nnx.split(nnx.eval_shape(model_factory(config)))
  state = read_variables(directory, abstract, layout.shardings(abstract))
  return config, nnx.merge(graphdef, state)
