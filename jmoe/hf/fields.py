"""A Hugging Face config.json's fields, read by name: each with its type and range checked (a
string `hidden_size`, a float layer count or a negative size is refused naming the field), a
missing one taking transformers' default for the family, and the fields nobody read reported.

The family translations (families.py) read every field that changes what the model computes
through here, so that a field is either mapped onto jmoe's config or refused by name; a field no
family knows is named in a warning.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

from jmoe.config import ConfigError
from jmoe.config.validate import INT32

log = logging.getLogger("jmoe")

REQUIRED = object()

# Fields of every transformers config that do not change what the model computes: names,
# versions, token ids, what a forward call returns, and settings of other kinds of model.
GENERIC = frozenset((
    "_name_or_path", "architectures", "model_type", "dtype", "torch_dtype", "transformers_version",
    "auto_map", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id",
    "decoder_start_token_id", "output_attentions", "output_hidden_states", "output_router_logits",
    "return_dict", "use_return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "is_decoder", "add_cross_attention", "id2label", "label2id", "problem_type", "tokenizer_class",
    "prefix", "task_specific_params", "finetuning_task", "torchscript", "use_bfloat16",
    "tf_legacy_loss", "pruned_heads", "tie_encoder_decoder", "cross_attention_hidden_size"))


class HFFields:
  """Typed access to a config.json (or one of its nested objects, such as rope_parameters);
  `defaults` are transformers' defaults for the family's config class."""

  def __init__(self, hf: Mapping, source: str, defaults: Mapping[str, Any] | None = None):
    self.hf, self.source, self.defaults = hf, source, dict(defaults or {})
    self.read: set[str] = set()
    self.nested: dict[str, HFFields] = {}
    self.named = ""  # the field last read, as messages about its value call it

  def __contains__(self, key: str) -> bool:
    return self.hf.get(key) is not None

  def value(self, key: str, *aliases: str, default: Any = REQUIRED, null: Any = REQUIRED) -> Any:
    """The raw value of `key` (or its first alias present). JSON null means `null` where given
    (for the fields where transformers gives None a meaning), else it reads as missing: then
    `default`, else transformers' default for the family, else a ConfigError."""
    self.read.update((key, *aliases))
    self.named = key
    for k in (key, *aliases):
      if k in self.hf and (self.hf[k] is not None or null is not REQUIRED):
        self.named = k
        return null if self.hf[k] is None else self.hf[k]
    if default is REQUIRED:
      default = self.defaults.get(key, REQUIRED)
    if default is REQUIRED:
      raise ConfigError(f"{self.source} lacks {key!r}, which this architecture needs")
    return default

  def _refuse(self, what: str, value: Any) -> ConfigError:
    """The error for the value just read."""
    return ConfigError(f"{self.source}: {self.named} must be {what}, got {value!r}")

  def size(self, key: str, *aliases: str, low: int = 1, **kw) -> int:
    """An integer in [low, int32's largest] (JSON 4.0 is not an integer here)."""
    value = self.value(key, *aliases, **kw)
    if value is None or ("null" in kw and value == kw["null"]):  # what null stands for
      return value
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= INT32:
      raise self._refuse(f"an integer in [{low}, {INT32}]", value)
    return value

  def number(self, key: str, *aliases: str, low: float = 0.0, open_low: bool = True,
             **kw) -> float:
    """A finite number above `low` (or at least `low`, with open_low=False)."""
    value = self.value(key, *aliases, **kw)
    if value is None or ("null" in kw and value == kw["null"]):
      return value
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if open_low else value >= low))
    if not ok:
      raise self._refuse(f"a number {'>' if open_low else '>='} {low:g}", value)
    return float(value)

  def flag(self, key: str, **kw) -> bool:
    value = self.value(key, **kw)
    if not isinstance(value, bool):
      raise self._refuse("true or false", value)
    return value

  def text(self, key: str, *aliases: str, **kw) -> str:
    value = self.value(key, *aliases, **kw)
    if not isinstance(value, str):
      raise self._refuse("a string", value)
    return value

  def mapping(self, key: str, *aliases: str, **kw) -> "HFFields":
    """A nested object (such as rope_parameters), as fields of its own."""
    value = self.value(key, *aliases, **kw)
    if not isinstance(value, Mapping):
      raise self._refuse("a JSON object", value)
    self.nested[self.named] = HFFields(value, f"{self.source}: {self.named}")
    return self.nested[self.named]

  def int_list(self, key: str, **kw) -> list[int]:
    value = self.value(key, **kw)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                              for v in value):
      raise self._refuse("a list of integers", value)
    return value

  def equals(self, key: str, allowed: Any, why: str, **kw) -> None:
    """A field jmoe reads only to make sure it holds the value jmoe computes with."""
    value = self.value(key, **kw)
    if value != allowed:
      raise ConfigError(f"{self.source}: {self.named}={value!r} is not supported: {why}")

  def unread(self, ignored: frozenset = frozenset()) -> list[str]:
    """The fields nobody read, but for `ignored` and GENERIC ones (nested ones as parent.key)."""
    names = sorted(k for k in self.hf if k not in self.read and k not in GENERIC | ignored)
    return names + [f"{key}.{name}" for key, nested in self.nested.items()
                    for name in nested.unread()]

  def warn_unread(self, ignored: frozenset = frozenset()) -> None:
    names = self.unread(ignored)
    if names:
      log.warning("%s: jmoe does not know the field(s) %s and ignores them; if they change what "
                  "the model computes, the import computes something else", self.source,
                  ", ".join(names))
