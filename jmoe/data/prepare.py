"""Tokenize text once, into token shards that training reads without tokenizing again.

  python -m jmoe.data.prepare --source DIR_OR_FILES --out TOKENS_DIR [--tokenizer tokenizer.json]
      [--text-key text] [--shard-tokens 268435456]

--source takes what data.source takes (text, JSONL and Parquet files, directories, globs,
comma-separated). The output directory holds shards of concatenated token ids (`*.bin`, uint16
when the vocabulary fits, else uint32) with each document's boundaries (`*.idx.npy`), and
`index.json`. Train on it with `--config.data.source=TOKENS_DIR` and the same
`--config.data.tokenizer`. The directory appears only when complete, and never over one that is
there (an empty one aside).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import time

import numpy as np

from jmoe.cli import number, run
from jmoe.config import ConfigError, DataConfig
from jmoe.data.sources import TOKENS_INDEX, check_holds_text, open_entry, parse_sources
from jmoe.data.tokenizer import load_tokenizer
from jmoe.outputs import check, written

log = logging.getLogger("jmoe")


class ShardWriter:
  """Appends documents to numbered shards of about `shard_tokens` tokens each."""

  def __init__(self, directory: pathlib.Path, dtype: np.dtype, shard_tokens: int):
    self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
    self.shards: list[dict] = []
    self.documents = self.tokens = self.max_id = 0
    self._file = None

  def _open(self) -> None:
    number = len(self.shards)
    names = {"file": f"tokens-{number:05d}.bin", "bounds": f"tokens-{number:05d}.idx.npy"}
    self._file = open(self.directory / names["file"], "wb")
    self._bounds = [0]
    self.shards.append(names)

  def _close(self) -> None:
    self._file.close()
    np.save(self.directory / self.shards[-1]["bounds"], np.asarray(self._bounds, np.int64))
    self.shards[-1].update(documents=len(self._bounds) - 1, num_tokens=self._bounds[-1])
    self._file = None

  def add(self, ids: np.ndarray) -> None:
    if self._file is None:
      self._open()
    self._file.write(ids.astype(self.dtype).tobytes())
    self._bounds.append(self._bounds[-1] + ids.size)
    self.documents += 1
    self.tokens += ids.size
    self.max_id = max(self.max_id, int(ids.max(initial=0)))
    if self._bounds[-1] >= self.shard_tokens:
      self._close()

  def finish(self) -> None:
    if self._file is not None:
      self._close()


def prepare(source: str, out: str | pathlib.Path, tokenizer_path: str = "",
            text_key: str = "text", shard_tokens: int = 1 << 28,
            max_corpus_bytes: int = 16_000_000) -> dict:
  """Writes the token shards of `source` to `out` (new, or an empty directory), under a name of
  this process's own moved into place once complete (jmoe.outputs); returns what index.json
  says."""
  entries = parse_sources(source)
  output = check(out, directory=True, inputs={
      "--source": [p for entry in entries for p in entry.paths], "--tokenizer": tokenizer_path})
  cfg = DataConfig(source=source, tokenizer=tokenizer_path, text_key=text_key,
                   max_corpus_bytes=max_corpus_bytes)
  tokenizer = load_tokenizer(cfg, vocab_size=1 << 31)
  for entry in entries:
    if entry.kind == "tokens":
      raise ConfigError(f"{entry.text} is already token shards")
    if entry.kind == "chat":
      raise ConfigError(f"{entry.text}: chat data is read as it is (data.source="
                        f"chat:FILE.jsonl), not prepared into token shards")
  for entry in entries:  # an entry of empty documents only is refused before anything is written
    check_holds_text(open_entry(entry, cfg, tokenizer, vocab_size=1 << 31), "--source")
  dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
  t0 = time.perf_counter()
  with written(output) as tmp:
    writer = ShardWriter(tmp, dtype, shard_tokens)
    for entry in entries:
      for ids in open_entry(entry, cfg, tokenizer, vocab_size=1 << 31).in_order():
        writer.add(ids)
    writer.finish()
    if not writer.tokens:
      raise ConfigError(f"{source} holds no text")
    index = {"format": 1, "dtype": dtype.name, "vocab_size": tokenizer.vocab_size,
             "tokenizer": tokenizer.fingerprint, "eod": tokenizer.EOD,
             "documents": writer.documents, "tokens": writer.tokens, "max_id": writer.max_id,
             "shards": writer.shards, "source": source,
             "seconds": round(time.perf_counter() - t0, 3)}
    (tmp / TOKENS_INDEX).write_text(json.dumps(index, indent=1))
  return index


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jmoe.data.prepare",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--source", required=True, help="as data.source: files, dirs, globs")
  parser.add_argument("--out", required=True,
                      help="a new (or empty) directory for the token shards")
  parser.add_argument("--tokenizer", default="", help="a tokenizer.json; default: bytes")
  parser.add_argument("--text-key", default="text", help="JSON field / Parquet column")
  parser.add_argument("--shard-tokens", type=number(int, 1), default=1 << 28,
                      help="tokens per shard file (default 2^28)")
  parser.add_argument("--max-corpus-bytes", type=number(int, 1), default=16_000_000,
                      help="for --source stdlib: how much of it")

  def command() -> int:
    args = parser.parse_args(argv)
    index = prepare(args.source, args.out, args.tokenizer, args.text_key, args.shard_tokens,
                    args.max_corpus_bytes)
    print(f"wrote {args.out}: {index['documents']} documents, {index['tokens']} tokens in "
          f"{len(index['shards'])} shard(s), {index['seconds']:.1f} s "
          f"({index['tokens'] / max(index['seconds'], 1e-9):,.0f} tokens/s)")
    return 0

  return run(command)


if __name__ == "__main__":
  sys.exit(main())
