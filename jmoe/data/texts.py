"""Raw text sources: random access to the documents of text, JSONL and Parquet files, as str
(JSONL conversations as lists of messages), each reader with the `paths` it reads."""

from __future__ import annotations

import json
import pathlib

import numpy as np

from jmoe.config import ConfigError


def _utf8(raw: bytes, where: str) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ConfigError(f"{where} is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 4]!r}); "
                      f"text sources must be UTF-8: convert it, or leave it out of "
                      f"data.source") from None


class FileTexts:
  """Each file one document, UTF-8 text."""

  def __init__(self, paths: list[pathlib.Path]):
    self.paths = paths

  def __len__(self) -> int:
    return len(self.paths)

  def __getitem__(self, index: int) -> str:
    path = self.paths[index]
    return _utf8(path.read_bytes(), str(path))


class JsonlTexts:
  """Each line of the files a JSON object whose `key` field is a document."""
  value_type, value_name = str, "text field"

  def __init__(self, paths: list[pathlib.Path], key: str):
    self.key = key
    self.paths, self._offsets = list(paths), []  # (file number, byte offset) of each line
    for number, path in enumerate(paths):
      start = 0
      with open(path, "rb") as f:
        for line in f:
          if line.strip():
            self._offsets.append((number, start))
          start += len(line)

  def __len__(self) -> int:
    return len(self._offsets)

  def __getitem__(self, index: int) -> str:
    number, start = self._offsets[index]
    path = self.paths[number]
    with open(path, "rb") as f:
      f.seek(start)
      line = f.readline()
    text = _utf8(line, f"{path}: the line at byte {start}")
    try:
      record = json.loads(text)
    except ValueError as e:
      raise ConfigError(f"{path}: the line at byte {start} is not JSON ({e}); a JSONL source "
                        f"holds one JSON object per line") from None
    key = f"{'text' if self.value_type is str else 'chat'}_key"
    if not isinstance(record, dict) or self.key not in record:
      raise ConfigError(f"{path}: the line at byte {start} has no {self.value_name} "
                        f"{self.key!r} (set data.{key}, or prepare's --{key.replace('_', '-')})")
    value = record[self.key]
    if not isinstance(value, self.value_type):
      wanted = "a string" if self.value_type is str else "a list of messages"
      raise ConfigError(f"{path}: the line at byte {start} holds {type(value).__name__} "
                        f"{str(value)[:40]!r} in its {self.value_name} {self.key!r}, not "
                        f"{wanted}; fix that line or drop it")
    return value

  def where(self, index: int) -> str:
    number, start = self._offsets[index]
    return f"{self.paths[number]}: the line at byte {start}"


class JsonlChats(JsonlTexts):
  """Each line of the files a JSON object whose `key` field is a conversation (a list of
  messages)."""
  value_type, value_name = list, "list of messages"


class ParquetTexts:
  """The `key` column of Parquet files, a row per document, read a row group at a time."""

  def __init__(self, paths: list[pathlib.Path], key: str):
    try:
      import pyarrow.parquet as pq
    except ImportError as e:
      raise ConfigError("reading Parquet files needs pyarrow: pip install 'jmoe[parquet]'") from e
    self.key, self.paths = key, list(paths)
    self._groups = []  # (path, row group, first row)
    total = 0
    for path in paths:
      try:
        meta = pq.ParquetFile(path)
      except Exception as e:  # noqa: BLE001 - pyarrow's errors for a file it cannot read
        raise ConfigError(f"{path} is not a readable Parquet file ({type(e).__name__}: "
                          f"{str(e)[:200]})") from None
      if key not in meta.schema_arrow.names:
        raise ConfigError(f"{path} has no column {key!r} (its columns: "
                          f"{meta.schema_arrow.names}); set data.text_key")
      for group in range(meta.num_row_groups):
        self._groups.append((path, group, total))
        total += meta.metadata.row_group(group).num_rows
    self._total = total
    self._starts = np.array([g[2] for g in self._groups], np.int64)
    self._cached = (None, None)

  def __len__(self) -> int:
    return self._total

  def __getitem__(self, index: int) -> str:
    import pyarrow.parquet as pq
    number = int(np.searchsorted(self._starts, index, side="right")) - 1
    path, group, first = self._groups[number]
    if self._cached[0] != number:
      table = pq.ParquetFile(path).read_row_group(group, columns=[self.key])
      self._cached = (number, table.column(0).to_pylist())
    return self._cached[1][index - first] or ""
