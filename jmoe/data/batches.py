"""Batches of token windows, the same for a given (seed, step) on every run and every host.

The token stream is all documents, each closed by an end-of-document token. A training batch is
`batch_size` windows of seq_len + 1 tokens
at offsets drawn from a generator seeded by (seed, step): no iterator state, so a resumed run sees
exactly the batches it would have seen.
"""

from __future__ import annotations

import numpy as np

from jmoe.config import ConfigError, DataConfig
from jmoe.data.corpus import stdlib_documents
from jmoe.data.tokenizer import ByteTokenizer

class WindowSampler:

  def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
    if tokens.size < 2 * (seq_len + 1):
      raise ValueError(f"the corpus has {tokens.size} tokens, too few for windows of {seq_len + 1}")
    self.seq_len = seq_len
    self.seed = seed
    self.train_tokens = tokens

  def batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
    """The global batch for `step`: {'tokens': int32 [batch_size, seq_len + 1]}."""
    rng = np.random.default_rng([self.seed, step])
    starts = rng.integers(0, self.train_tokens.size - self.seq_len - 1, size=batch_size)
    windows = self.train_tokens[starts[:, None] + np.arange(self.seq_len + 1)]
    return {"tokens": windows.astype(np.int32)}


def make_sampler(cfg: DataConfig, seed: int, vocab_size: int) -> WindowSampler:
  tokenizer = ByteTokenizer()
  if vocab_size < tokenizer.vocab_size:
    raise ConfigError(
        f"model.vocab_size ({vocab_size}) is smaller than the byte tokenizer's "
        f"{tokenizer.vocab_size} ids; use at least {tokenizer.vocab_size} (a multiple of 8 such "
        f"as 264 shards best)")
  pieces = []
  for doc in stdlib_documents(cfg.max_corpus_bytes):
    pieces.append(tokenizer.encode(doc))
    pieces.append(np.array([tokenizer.EOD], np.int32))
  return WindowSampler(np.concatenate(pieces), cfg.seq_len, seed)
