"""From a config file plus command-line overrides to a validated, frozen `Config`.

Config files are Python files whose `get_config()` returns an `ml_collections.ConfigDict`; any key can
be overridden as `--config.group.key=value`. Unknown keys are errors: a typo never trains silently
with a default.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import pathlib
import types
import typing
from typing import Any, Mapping, Sequence

import ml_collections

from jmoe.config.schema import Config
from jmoe.config.validate import validate
from jmoe.errors import ConfigError


def load_config(path: str | pathlib.Path, overrides: Sequence[str] = ()) -> Config:
  """Reads `path`'s get_config(), applies `a.b=value` overrides, converts and validates."""
  config_dict = read_config_file(path)
  apply_overrides(config_dict, overrides)
  return from_config_dict(config_dict)


def defaults() -> ml_collections.ConfigDict:
  """Every key at its default, as a ConfigDict for config files to start from."""
  return ml_collections.ConfigDict(dataclasses.asdict(Config()))


def read_config_file(path: str | pathlib.Path) -> ml_collections.ConfigDict:
  path = pathlib.Path(path)
  if not path.is_file():
    raise ConfigError(f"config file {str(path)!r} does not exist; configs live in configs/*.py")
  spec = importlib.util.spec_from_file_location(f"jmoe_user_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SyntaxError as e:
    raise ConfigError(f"{path}:{e.lineno}: invalid Python syntax ({e.msg}): "
                      f"{(e.text or '').strip()!r}") from e
  except Exception as e:  # noqa: BLE001 - whatever the file does wrong, say where
    raise ConfigError(f"{path} fails when run: {type(e).__name__}: {e}") from e
  if not callable(getattr(module, "get_config", None)):
    raise ConfigError(f"{path} has no get_config() function returning an ml_collections.ConfigDict")
  try:
    config_dict = module.get_config()
  except Exception as e:  # noqa: BLE001
    raise ConfigError(f"{path}: get_config() failed: {type(e).__name__}: {e}") from e
  if not isinstance(config_dict, (ml_collections.ConfigDict, Mapping)):
    raise ConfigError(f"{path}: get_config() returned {config_dict!r}, not an "
                      f"ml_collections.ConfigDict")
  if not isinstance(config_dict, ml_collections.ConfigDict):
    config_dict = ml_collections.ConfigDict(config_dict)
  return config_dict


def apply_overrides(config_dict: ml_collections.ConfigDict, overrides: Sequence[str]) -> None:
  """Applies overrides of the form `group.key=value` (a leading `--config.` is accepted too).

  Any key of the schema may be set, also one the config file leaves at its default; the value is
  parsed by the key's type.
  """
  for override in overrides:
    text = override.removeprefix("--").removeprefix("config.")
    if "=" not in text:
      raise ConfigError(f"override {override!r} must look like --config.group.key=value")
    dotted, raw = text.split("=", 1)
    *parents, leaf = dotted.split(".")
    node, schema = config_dict, Config
    for i, name in enumerate(parents):
      hints = typing.get_type_hints(schema)
      if name not in hints or not dataclasses.is_dataclass(hints[name]):
        raise ConfigError(f"override {override!r}: no config group {'.'.join(parents[:i + 1])!r}")
      schema = hints[name]
      if name not in node:
        node[name] = ml_collections.ConfigDict()
      node = node[name]
    hints = typing.get_type_hints(schema)
    if leaf not in hints or dataclasses.is_dataclass(hints[leaf]):
      raise ConfigError(
          f"override {override!r}: unknown key {dotted!r}; keys of this group: "
          f"{sorted(k for k, h in hints.items() if not dataclasses.is_dataclass(h))}")
    node[leaf] = _parse_value(raw, hints[leaf], dotted)


def _parse_value(raw: str, hint: Any, dotted: str) -> Any:
  allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
  if str in allowed:
    return raw
  if type(None) in allowed and raw in ("None", "none", "null"):
    return None
  if float in allowed and raw.lower().lstrip("+-") in ("nan", "inf", "infinity"):
    return float(raw)  # parsed, so that validation can say what is wrong with it
  if bool in allowed:
    if raw not in ("True", "False", "true", "false"):
      raise ConfigError(f"--config.{dotted} takes True or False, not {raw!r}")
    return raw in ("True", "true")
  try:
    value = ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    value = raw
  return _check_type(value, hint, dotted)


def from_config_dict(config_dict: ml_collections.ConfigDict | Mapping) -> Config:
  """Converts a (possibly partial) nested mapping into the frozen dataclasses, then validates."""
  config = _build(Config, _as_dict(config_dict), prefix="")
  validate(config)
  return config


def _as_dict(value: Any) -> Any:
  if isinstance(value, ml_collections.ConfigDict):
    return value.to_dict()
  return value


def _build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
  if not isinstance(values, Mapping):
    raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a group of keys, got {values!r}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  unknown = sorted(set(values) - set(fields))
  if unknown:
    raise ConfigError(
        f"unknown config key(s) {[prefix + k for k in unknown]}; "
        f"the keys of {prefix.rstrip('.') or 'the config'} are {sorted(fields)}")
  kwargs = {}
  for name, value in values.items():
    hint = hints[name]
    if dataclasses.is_dataclass(hint):
      kwargs[name] = _build(hint, _as_dict(value), prefix=f"{prefix}{name}.")
    else:
      kwargs[name] = _check_type(value, hint, prefix + name)
  return cls(**kwargs)


def _check_type(value: Any, hint: Any, key: str) -> Any:
  allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
  if value is None and type(None) in allowed:
    return value
  for kind in allowed:
    if typing.get_origin(kind) is tuple and isinstance(value, (list, tuple)):
      item = typing.get_args(kind)[0]
      if all(isinstance(v, item) and not isinstance(v, bool) for v in value):
        return tuple(value)
      continue
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
      return float(value)
    if kind is int and isinstance(value, bool):
      continue
    if isinstance(kind, type) and isinstance(value, kind):
      return value
  names = " or ".join(_type_name(k) for k in allowed)
  raise ConfigError(f"config key {key!r} must be a {names}, got {value!r}")


def _type_name(kind) -> str:
  if typing.get_origin(kind) is tuple:
    return f"list of {typing.get_args(kind)[0].__name__}s"
  return getattr(kind, "__name__", str(kind))
