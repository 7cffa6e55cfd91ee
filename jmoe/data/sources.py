"""Document sources: random access to tokenized documents, each closed by the end-of-document id.

A source is what `grain.MapDataset.source` takes: `len(source)` documents, `source[i]` the i-th as
int32 token ids. Raw text (read by jmoe/data/texts.py) is tokenized when a document is read; token
shards written by `python -m jmoe.data.prepare` are read straight from memory-mapped files. Each
source also says whether a document holds anything to learn (`has_text`) and what identifies its
files (`identity`, saved with a checkpoint's input position).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import pathlib
import sysconfig

import numpy as np

from jmoe.config import ConfigError, DataConfig
from jmoe.data.texts import FileTexts, JsonlChats, JsonlTexts, ParquetTexts

KINDS = ("text", "jsonl", "parquet", "tokens", "chat")
SUFFIXES = {".txt": "text", ".md": "text", ".jsonl": "jsonl", ".parquet": "parquet"}
TOKENS_INDEX = "index.json"  # what marks a directory of token shards
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def files_digest(paths) -> str:
  """A short hash of files' names and sizes, in order: the same files moved elsewhere keep it; a
  file added, removed, renamed or rewritten to another size changes it."""
  digest = hashlib.sha256()
  for path in paths:
    digest.update(f"{pathlib.Path(path).name}\0{pathlib.Path(path).stat().st_size}\n".encode())
  return digest.hexdigest()[:16]


class Tokenized:
  """Documents from `texts` (random access to str/bytes, read from `texts.paths`), tokenized when
  read."""

  def __init__(self, texts, tokenizer, name: str, kind: str):
    self._texts, self._tokenizer, self.name, self.kind = texts, tokenizer, name, kind

  def __len__(self) -> int:
    return len(self._texts)

  def __getitem__(self, index: int) -> np.ndarray:
    ids = self._tokenizer.encode(self._texts[index])
    return np.concatenate([ids, np.array([self._tokenizer.EOD], np.int32)])

  def has_text(self, index: int) -> bool:
    """Whether document `index` holds more than whitespace, and tokens for it."""
    text = self._texts[index]
    return bool(text.strip()) and self._tokenizer.encode(text).size > 0

  def identity(self) -> dict:
    return {"kind": self.kind, "documents": len(self), "files": files_digest(self._texts.paths)}

  def in_order(self, chunk: int = 512):
    """Every document in order, tokenized `chunk` at a time (the tokenizers library spreads a
    chunk over all cores)."""
    eod = np.array([self._tokenizer.EOD], np.int32)
    for start in range(0, len(self), chunk):
      texts = [self._texts[i] for i in range(start, min(start + chunk, len(self)))]
      for ids in self._tokenizer.encode_batch(texts):
        yield np.concatenate([ids, eod])


class Chats:
  """Conversations as documents: {"tokens", "loss_mask"}, the assistant's tokens counted, each
  closed by the end-of-document id (not counted)."""

  kind = "chat"

  def __init__(self, conversations: JsonlChats, tokenizer, template, name: str):
    self._conversations, self._tokenizer, self._template = conversations, tokenizer, template
    self.name = name

  def __len__(self) -> int:
    return len(self._conversations)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    from jmoe.data.chat import check_messages, tokenize_chat
    messages = check_messages(self._conversations[index], self._conversations.where(index))
    ids, mask = tokenize_chat(messages, self._template, self._tokenizer)
    return {"tokens": np.concatenate([ids, np.array([self._tokenizer.EOD], np.int32)]),
            "loss_mask": np.concatenate([mask, np.zeros(1, np.int32)])}

  def has_text(self, index: int) -> bool:
    """Whether conversation `index` holds a token the loss counts (the assistant's)."""
    return bool(self[index]["loss_mask"].any())

  def identity(self) -> dict:
    return {"kind": self.kind, "documents": len(self),
            "files": files_digest(self._conversations.paths),
            "template": self._template.fingerprint}


class TokenShards:
  """A directory written by `python -m jmoe.data.prepare`: shards of concatenated token ids
  (`*.bin`) with the document boundaries (`*.idx.npy`), described by `index.json`."""
  kind = "tokens"

  def __init__(self, directory: pathlib.Path, vocab_size: int, tokenizer):
    self.name, self.vocab_size, self.eod = str(directory), vocab_size, tokenizer.EOD
    again = "; write the shards again with `python -m jmoe.data.prepare`"
    try:
      index = json.loads((directory / TOKENS_INDEX).read_text())
      files = [(shard["file"], shard["bounds"]) for shard in index["shards"]]
      dtype, max_id, fingerprint = index["dtype"], index["max_id"], index["tokenizer"]
    except (ValueError, KeyError, TypeError) as e:
      raise ConfigError(f"{directory / TOKENS_INDEX} is damaged ({type(e).__name__}: {e})"
                        f"{again}") from None
    missing = [name for pair in files for name in pair if not (directory / name).is_file()]
    if missing:
      raise ConfigError(f"{directory} lacks {missing[0]}, which its {TOKENS_INDEX} names{again}")
    index = dict(index, dtype=dtype, max_id=max_id, tokenizer=fingerprint)
    if index["max_id"] >= vocab_size:
      raise ConfigError(f"{directory} holds token id {index['max_id']}, beyond the model's "
                        f"vocabulary (model.vocab_size {vocab_size}); it was prepared with "
                        f"another tokenizer")
    if index["tokenizer"] != tokenizer.fingerprint:
      raise ConfigError(f"{directory} was prepared with tokenizer {index['tokenizer']!r}, but "
                        f"data.tokenizer is {tokenizer.fingerprint!r}; use the same tokenizer")
    if index.get("eod", tokenizer.EOD) != tokenizer.EOD:
      raise ConfigError(f"{directory} closes its documents with token id {index['eod']}, but "
                        f"the end-of-document id of data.tokenizer is {tokenizer.EOD} (see "
                        f"data.eod_token); use the end-of-document token the shards were "
                        f"prepared with")
    self.files = [directory / name for pair in files for name in pair]
    self._tokens, self._bounds = [], []
    for shard in index["shards"]:
      self._tokens.append(np.memmap(directory / shard["file"], dtype=index["dtype"], mode="r"))
      self._bounds.append(np.load(directory / shard["bounds"], mmap_mode="r"))
    self._first = np.cumsum([0] + [len(b) - 1 for b in self._bounds])

  def __len__(self) -> int:
    return int(self._first[-1])

  def __getitem__(self, index: int) -> np.ndarray:
    shard = int(np.searchsorted(self._first, index, side="right")) - 1
    bounds, i = self._bounds[shard], index - self._first[shard]
    ids = np.asarray(self._tokens[shard][bounds[i]:bounds[i + 1]], np.int32)
    # Cheap, on the host: an id past the vocabulary would make the loss NaN, not an error.
    if ids.size and (ids.max() >= self.vocab_size or ids.min() < 0):
      raise ConfigError(f"{self.name}: document {index} holds token id {int(ids.max())}, "
                        f"outside the model's vocabulary [0, {self.vocab_size}) although "
                        f"{TOKENS_INDEX} says otherwise; the shards are damaged or were "
                        f"prepared for another vocabulary")
    return ids

  def has_text(self, index: int) -> bool:
    """Whether document `index` holds a token other than the end-of-document id."""
    return bool((self[index] != self.eod).any())

  def any_text(self, chunk: int = 1 << 22) -> bool:
    """Whether any shard holds a token other than the end-of-document id (read `chunk` tokens at
    a time, so that it stops early on real data)."""
    return any((tokens[start:start + chunk] != self.eod).any()
               for tokens in self._tokens for start in range(0, tokens.size, chunk))

  def identity(self) -> dict:
    return {"kind": self.kind, "documents": len(self), "files": files_digest(self.files)}


class Subset:
  """The documents of `source` at `indices` (the train or the held-out part of a source)."""

  def __init__(self, source, indices: np.ndarray):
    self._source, self._indices = source, indices
    self.name, self.kind = source.name, source.kind

  def __len__(self) -> int:
    return len(self._indices)

  def __getitem__(self, index: int):
    return self._source[int(self._indices[index])]

  def has_text(self, index: int) -> bool:
    return self._source.has_text(int(self._indices[index]))

  def identity(self) -> dict:
    """The whole source's (the split is data.eval_fraction's)."""
    return self._source.identity()

  def whole(self):
    return self._source


@dataclasses.dataclass(frozen=True)
class Entry:
  kind: str  # stdlib or one of KINDS
  paths: tuple[pathlib.Path, ...]
  weight: float
  text: str  # as written in data.source


def parse_sources(spec: str) -> list[Entry]:
  """`data.source` -> its entries, each with the files it names; errors name what is missing."""
  entries = []
  for text in (part.strip() for part in spec.split(",")):
    if not text:
      continue
    body, weight = text, 1.0
    if "@" in text:
      body, raw = text.rsplit("@", 1)
      try:
        weight = float(raw)
      except ValueError:
        raise ConfigError(f"data.source entry {text!r}: the weight after @ must be a number")
      if weight <= 0:
        raise ConfigError(f"data.source entry {text!r}: the weight must be positive")
    if body == "stdlib":
      entries.append(Entry("stdlib", (), weight, text))
      continue
    kind = None
    if ":" in body and body.split(":", 1)[0] in KINDS:
      kind, body = body.split(":", 1)
    entries.append(_resolve(body, kind, weight, text))
  if not entries:
    raise ConfigError("data.source names no source")
  return entries


def _resolve(pattern: str, kind: str | None, weight: float, text: str) -> Entry:
  path = pathlib.Path(pattern).expanduser()
  if path.is_dir() and (path / TOKENS_INDEX).is_file():
    if kind not in (None, "tokens"):
      raise ConfigError(f"data.source entry {text!r}: {path} holds token shards, not {kind}")
    return Entry("tokens", (path,), weight, text)
  if kind == "tokens":
    raise ConfigError(f"data.source entry {text!r}: {path} has no {TOKENS_INDEX}; write token "
                      f"shards with `python -m jmoe.data.prepare`")
  suffix_kind = "jsonl" if kind == "chat" else kind  # conversations are JSONL files
  if path.is_dir():
    files = sorted(p for p in path.rglob("*") if p.is_file() and
                   (p.suffix in SUFFIXES if kind is None else SUFFIXES.get(p.suffix) == suffix_kind))
  elif any(c in pattern for c in "*?["):
    files = sorted(pathlib.Path(p) for p in glob.glob(pattern, recursive=True)
                   if pathlib.Path(p).is_file())
  elif path.is_file():
    files = [path]
  else:
    raise ConfigError(f"data.source entry {text!r}: {path} does not exist")
  if not files:
    raise ConfigError(f"data.source entry {text!r}: {path} contains no "
                      f"{'/'.join(SUFFIXES) if kind is None else kind} files")
  kinds = {kind or SUFFIXES.get(p.suffix, "text") for p in files}
  if len(kinds) > 1:
    raise ConfigError(f"data.source entry {text!r} mixes {sorted(kinds)} files; give each "
                      f"kind its own entry (e.g. jsonl:DIR/*.jsonl)")
  for file in files:
    if file.stat().st_size == 0:
      raise ConfigError(f"data.source: {file} is empty")
  return Entry(kinds.pop(), tuple(files), weight, text)


def stdlib_files(max_bytes: int) -> list[pathlib.Path]:
  """The standard library's .py files in a fixed order, up to about `max_bytes` in total."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files, total = [], 0
  for path in sorted(root.rglob("*.py")):
    if _STDLIB_SKIP.intersection(path.relative_to(root).parts):
      continue
    size = path.stat().st_size
    if size == 0 or not path.read_bytes().strip():
      continue
    files.append(path)
    total += size
    if total >= max_bytes:
      break
  return files


def open_entry(entry: Entry, cfg: DataConfig, tokenizer, vocab_size: int):
  """The document source of one `data.source` entry."""
  if entry.kind == "tokens":
    return TokenShards(entry.paths[0], vocab_size, tokenizer)
  if entry.kind == "chat":
    if tokenizer.path is None:
      raise ConfigError(f"data.source entry {entry.text!r}: chat data is rendered with a "
                        f"checkpoint's chat template and tokenizer; set data.tokenizer to its "
                        f"tokenizer.json (or the directory holding it)")
    from jmoe.data.chat import ChatTemplate
    template = ChatTemplate.from_files(tokenizer.path, cfg.chat_template)
    conversations = JsonlChats(list(entry.paths), cfg.chat_key)
    if not len(conversations):
      raise ConfigError(f"data.source entry {entry.text!r} holds no conversations")
    return Chats(conversations, tokenizer, template, entry.text)
  if entry.kind == "stdlib":
    texts = FileTexts(stdlib_files(cfg.max_corpus_bytes))
  elif entry.kind == "text":
    texts = FileTexts(list(entry.paths))
  elif entry.kind == "jsonl":
    texts = JsonlTexts(list(entry.paths), cfg.text_key)
  else:
    texts = ParquetTexts(list(entry.paths), cfg.text_key)
  if not len(texts):
    raise ConfigError(f"data.source entry {entry.text!r} holds no documents")
  return Tokenized(texts, tokenizer, entry.text, entry.kind)


def check_holds_text(source, option: str = "data.source") -> None:
  """Refuses a source (an entry of `option`) none of whose documents holds anything to learn (all
  empty, whitespace or tokenized to nothing; token shards of end-of-document ids only): training
  on it would learn nothing, at a loss of 0. Reads documents in order up to the first with text."""
  whole = source.whole() if isinstance(source, Subset) else source
  only_ends = isinstance(whole, TokenShards) and not whole.any_text()  # found without a loop
  if not only_ends and any(source.has_text(index) for index in range(len(source))):
    return
  what = {"chat": "no assistant tokens for the loss to count",
          "tokens": "only end-of-document tokens"}.get(source.kind,
                                                        "only empty or whitespace documents")
  raise ConfigError(f"{option} entry {source.name!r} holds nothing to train on: {what} "
                    f"({len(source)} documents); give a source with text, or leave it out")


def split(source, eval_fraction: float):
  """(train part, held-out part or None): every round(1 / eval_fraction)-th document is held out,
  so both parts sample the whole source."""
  if not eval_fraction:
    return source, None
  every = max(2, round(1 / eval_fraction))
  indices = np.arange(len(source))
  held = indices % every == every - 1
  if not held.any():
    raise ConfigError(f"data.source entry {source.name!r} has {len(source)} documents, too few "
                      f"to hold out a {eval_fraction} share")
  return Subset(source, indices[~held]), Subset(source, indices[held])
