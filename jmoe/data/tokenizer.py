"""Tokenizers: bytes (the default), or a Hugging Face `tokenizer.json` through `tokenizers`.

Every document is closed by the tokenizer's end-of-document id, so the model learns where
documents end; padding (segment id 0) carries no loss, so its token id does not matter.
"""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np

from jmoe.config import ConfigError, DataConfig

# Tried in order when data.eod_token is not set.
END_OF_DOCUMENT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


class ByteTokenizer:
  EOD = 256
  PAD = 257
  vocab_size = 258
  fingerprint = "bytes"
  path = None
  special_ids: set[int] = set()
  special_tokens: list[str] = []

  def encode(self, text: str | bytes) -> np.ndarray:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

  def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
  """A `tokenizer.json` file (the format of Hugging Face tokenizers), read locally."""

  def __init__(self, path: str | pathlib.Path, eod_token: str = ""):
    from tokenizers import Tokenizer
    path = pathlib.Path(path)
    if path.is_dir():  # a checkpoint or Hugging Face directory holding one
      path = path / "tokenizer.json"
    if not path.is_file():
      raise ConfigError(f"data.tokenizer: {path} does not exist (give the path of a "
                        f"tokenizer.json file, or of the directory that holds it)")
    self.path = path
    try:
      self._tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the library's message says what is wrong
      raise ConfigError(f"data.tokenizer: {path} is not a tokenizers JSON file: {e}") from e
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
    names = [eod_token] if eod_token else END_OF_DOCUMENT_NAMES
    ids = [self._tokenizer.token_to_id(name) for name in names]
    found = [i for i in ids if i is not None]
    if not found:
      raise ConfigError(f"data.tokenizer: {path} has no end-of-document token among "
                        f"{list(names)}; name it with data.eod_token")
    self.EOD = self.PAD = int(found[0])
    special = {i: t.content for i, t in self._tokenizer.get_added_tokens_decoder().items()
               if t.special}
    self.special_ids, self.special_tokens = set(special), list(special.values())
    self.fingerprint = hashlib.sha256(path.read_bytes()).hexdigest()[:16]

  def encode(self, text: str | bytes) -> np.ndarray:
    return self.encode_batch([text])[0]

  def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
    texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
    try:
      encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
    except Exception:  # noqa: BLE001 - the library's own message says what it lacks
      for text in texts:  # the text it fails on, named
        try:
          self._tokenizer.encode(text, add_special_tokens=False)
        except Exception as e:  # noqa: BLE001
          raise ConfigError(f"data.tokenizer {self.path} cannot tokenize the text "
                            f"{text[:40]!r}{'...' if len(text) > 40 else ''}: {e}") from None
      raise
    return [np.asarray(e.ids, np.int32) for e in encodings]

  def decode(self, ids) -> str:
    return self._tokenizer.decode([int(i) for i in ids])


def load_tokenizer(cfg: DataConfig, vocab_size: int) -> ByteTokenizer | HFTokenizer:
  """The configured tokenizer, checked against the model's vocabulary."""
  tokenizer = HFTokenizer(cfg.tokenizer, cfg.eod_token) if cfg.tokenizer else ByteTokenizer()
  if vocab_size < tokenizer.vocab_size:
    what = f"the tokenizer {cfg.tokenizer}" if cfg.tokenizer else "the byte tokenizer"
    raise ConfigError(
        f"model.vocab_size ({vocab_size}) is smaller than {what}'s {tokenizer.vocab_size} ids; "
        f"use at least {tokenizer.vocab_size} (a multiple of 8 or 128 shards best)")
  return tokenizer
