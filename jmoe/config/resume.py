"""What a resumed run must keep of the settings its checkpoint was saved with, and how a change
is named.

A checkpoint records settings beside what it saves, as JSON values by dotted name; a resume
compares them with its own (`changed`) and refuses a difference by name (`saved_with`). Two
records use this: the model settings its weights were trained with (`model_settings`, in the
checkpoint's `run` item) and the data settings its input position depends on
(jmoe/data/resume.py, in its `data` item).

The model settings are every config field but those RESUMABLE allows to differ (HELD aside): a
field added to the config later is held by default. Under another moe.top_k, router score, rope_theta, norm
eps, capacity, activation or attention window the saved weights would compute something else,
even where no array changes shape.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

from jmoe.config.schema import Config, to_dict

# Fields (or whole groups) a resume may change: they change how the run is laid out, computed,
# trained on or kept, not what its weights compute (beyond numerics).
RESUMABLE = (
    "parallel",  # the layout: a checkpoint restores onto any mesh
    "train",  # steps, schedule, optimizer, remat, logging: how training goes on
    "data",  # held by its own record, with the input position (jmoe/data/resume.py)
    "precision",  # compute and GEMM dtypes (storage dtypes are held by the state's shapes)
    "checkpoint",  # cadence; load_params starts only a new run (LoRA's base: its fingerprint)
    "model.attention_kernel", "model.scan_unroll",  # kernels, and the layer loop's unrolling
    "model.attention_max_documents",  # which kernel takes a packed batch (both exact)
    "model.init_std",  # only draws a new model's weights
    "model.family",  # the Hugging Face names for conversion (export checks that they fit)
    # How tokens reach their experts and which kernel multiplies them; none is dropped by them.
    "moe.dispatcher", "moe.dispatch_factor", "moe.dispatch_chunks", "moe.gemm",
    "moe.expert_blocks",
    "moe.balance",  # the balancing losses and bias updates: how training goes on, as train.*
    "moe.router.jitter",  # training noise on the router's input
)


# Fields inside those groups that a resume keeps all the same: the optimizer state's form
# (another optimizer keeps other moments: Muon one per hidden matrix, AdamW two per parameter).
HELD = ("train.optimizer",)


def resumable(name: str) -> bool:
  """Whether the dotted config field `name` may differ from the checkpoint a run resumes."""
  return name not in HELD and any(name == allowed or name.startswith(allowed + ".") for allowed in RESUMABLE)


def model_settings(config: Config | Mapping) -> dict[str, Any]:
  """The settings of `config` (a Config, or one as config.json holds it) that a resume must
  keep: JSON values by dotted name."""
  tree = to_dict(config) if isinstance(config, Config) else config
  return {name: value for name, value in _flat(json.loads(json.dumps(tree))).items()
          if not resumable(name)}


def recorded(saved: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, Any]:
  """The model settings a checkpoint recorded (`saved`), for the names of this jmoe's (`now`): a
  field the checkpoint predates has its default (a new field's default keeps what jmoe did
  before it), one jmoe no longer has is left out."""
  defaults = model_settings(Config())
  return {name: saved[name] if name in saved else defaults[name] for name in now}


def changed(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
  """The names whose values differ (one that only one side has: None on the other), in
  `saved`'s order, then those only `now` has."""
  names = [*saved, *(name for name in now if name not in saved)]
  return [name for name in names if saved.get(name) != now.get(name)]


def saved_with(checkpoint: str, names: list[str], saved: Mapping[str, Any],
               now: Mapping[str, Any], shown: Callable[[str, Any], str] | None = None) -> str:
  """`checkpoint` "was saved with" the values of `names` in `saved`, but this config has those
  in `now` (each value as `shown(name, value)` writes it; repr by default)."""
  shown = shown or (lambda _, value: repr(value))
  if len(names) == 1:
    name = names[0]
    return (f"{checkpoint} was saved with {name} {shown(name, saved.get(name))}, but this config "
            f"has {shown(name, now.get(name))}")
  each = ", ".join(f"{name} {shown(name, saved.get(name))} (now {shown(name, now.get(name))})"
                   for name in names)
  return f"{checkpoint} was saved with other settings than this config's: {each}"


def _flat(tree: Mapping, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out
