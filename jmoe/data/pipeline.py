"""The input pipeline: documents -> packed rows -> global batches on the devices, resumable.

Row r of every global batch (r < train.batch_size) comes from its own stream: the documents at
positions r, r + B, r + 2B, ... of the (mixed, shuffled, repeated) document order, packed into
rows of seq_len + 1 tokens by Grain. A process builds only the streams of the rows its devices
hold, so it reads only its share of the data, and the global batch is the same whatever the
number of processes. Each stream's Grain iterator state is a few integers; all of them together
are the input position saved with each checkpoint, and resuming restores them, so a resumed run
reads exactly the batches the uninterrupted run would have read.

A batch is a dict of int32 [rows, seq_len + 1] arrays: `tokens`, `segment_ids` (1, 2, ... for
the documents of a row; 0 for padding) and `positions` (each token's place in its document);
with chat sources also `loss_mask` (1 where the token is a target the loss counts: the
assistant's; every token of plain-text documents).
"""

from __future__ import annotations

import json
import logging
import pathlib
import queue
import threading
import time
from typing import Any

import grain
import jax
import numpy as np
from grain.experimental import ConcatThenSplitIterDataset
from jax.experimental import multihost_utils

from jmoe.config import Config, ConfigError, DataConfig
from jmoe.data.resume import data_settings, resume_refusal
from jmoe.data.sources import check_holds_text, open_entry, parse_sources, split
from jmoe.data.tokenizer import load_tokenizer
from jmoe.parallel import Layout

log = logging.getLogger("jmoe")
KEYS = ("tokens", "segment_ids", "positions")
MASKED_KEYS = KEYS + ("loss_mask",)


def batch_keys(cfg: DataConfig) -> tuple[str, ...]:
  """The arrays of a batch: with a chat source, the loss mask too."""
  return MASKED_KEYS if any(e.kind == "chat" for e in parse_sources(cfg.source)) else KEYS


def open_documents(cfg: DataConfig, vocab_size: int):
  """(tokenizer, [(train source, held-out source or None, weight)]) for `data.source`."""
  tokenizer = load_tokenizer(cfg, vocab_size)
  parts = []
  for entry in parse_sources(cfg.source):
    train, held = split(open_entry(entry, cfg, tokenizer, vocab_size), cfg.eval_fraction)
    check_holds_text(train)
    parts.append((train, held, entry.weight))
  if cfg.packing == "concat":
    _note_a_short_corpus([p[0] for p in parts], cfg.seq_len + 1)
  return tokenizer, parts


def _note_a_short_corpus(sources: list, width: int) -> None:
  """A notice when all documents together fill less than one row: every row repeats them."""
  tokens = 0
  for source in sources:
    for index in range(len(source)):
      document = source[index]
      tokens += len(document["tokens"] if isinstance(document, dict) else document)
      if tokens >= width:
        return
  log.warning("data.source holds %d tokens in all, fewer than one row (data.seq_len + 1 = %d): "
              "every row repeats the same documents; is it the corpus you meant?", tokens, width)


def document_order(sources: list, weights: list[float], seed: int, shuffle: bool,
                   epochs: int | None) -> grain.MapDataset:
  """All documents in training order: each source shuffled anew every epoch, sources mixed by
  weight (`epochs=None`: endless)."""
  datasets = []
  for i, source in enumerate(sources):
    ds = grain.MapDataset.source(source)
    if shuffle:
      ds = ds.shuffle(seed=(seed * 1_000_003 + i) % 2**32)
    datasets.append(ds.repeat(epochs))
  return datasets[0] if len(datasets) == 1 else grain.MapDataset.mix(datasets, weights)


def training_order(config: Config, parts: list) -> grain.MapDataset:
  """The endless training order of `open_documents`' parts."""
  return document_order([p[0] for p in parts], [p[2] for p in parts], config.train.seed,
                        config.data.shuffle, None)


def _pad_row(width: int, keys: tuple[str, ...]):
  def pad(element):
    tokens = element["tokens"][:width]
    out = {key: np.zeros(width, np.int32) for key in keys}
    out["tokens"][:tokens.size] = tokens
    out["segment_ids"][:tokens.size] = 1
    out["positions"][:tokens.size] = np.arange(tokens.size)
    if "loss_mask" in keys:
      out["loss_mask"][:tokens.size] = element["loss_mask"][:width]
    return out
  return pad


def _element(keys: tuple[str, ...]):
  """A document as a dict: its tokens, and with `loss_mask` in `keys` its mask (all ones for
  plain text)."""
  def element(document):
    out = dict(document) if isinstance(document, dict) else {"tokens": document}
    if "loss_mask" in keys and "loss_mask" not in out:
      out["loss_mask"] = np.ones_like(out["tokens"])
    return out
  return element


def row_stream(documents: grain.MapDataset, row: int, num_rows: int, width: int,
               packing: str, keys: tuple[str, ...] = KEYS) -> grain.IterDataset:
  """The rows (dicts of `keys`, `width` tokens each) that batch row `row` takes, in order."""
  docs = documents[row::num_rows].map(_element(keys))
  # One reading thread per stream: a process has many streams, and one thread fills batches.
  stream = docs.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  if packing == "none":
    return stream.map(_pad_row(width, keys))
  masked = "loss_mask" in keys
  lengths = {"tokens": width, **({"loss_mask": width} if masked else {})}
  packed = ConcatThenSplitIterDataset(stream, length_struct=lengths)
  return packed.map(lambda e: {"tokens": e["tokens"], "segment_ids": e["tokens_segment_ids"],
                               "positions": e["tokens_positions"],
                               **({"loss_mask": e["loss_mask"]} if masked else {})})


def most_documents(segment_ids: np.ndarray) -> int:
  """The most documents any row of `segment_ids` [rows, width] holds (ids 1, 2, ... in runs, 0
  for padding), counted as the attention kernels count them: a document starts wherever the id
  changes to one above 0."""
  ids = np.asarray(segment_ids)
  if ids.size == 0:
    return 0
  starts = (ids[:, 1:] != ids[:, :-1]) & (ids[:, 1:] > 0)
  return int((starts.sum(axis=1) + (ids[:, 0] > 0)).max())


class Batches:
  """This process's rows of each global batch: one Grain stream per row. With finite documents
  (evaluation), a finished stream gives padding rows (segment 0) from then on, so that every
  process makes the same number of batches; `finished` says when all of this process's have."""

  def __init__(self, documents: grain.MapDataset, rows: list[int], num_rows: int, width: int,
               packing: str, keys: tuple[str, ...] = KEYS):
    self.rows, self.width, self.keys = list(rows), width, keys
    self._streams = {row: iter(row_stream(documents, row, num_rows, width, packing, keys))
                     for row in self.rows}
    self._done: set[int] = set()

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    out = []
    for row in self.rows:
      try:
        out.append(next(self._streams[row]) if row not in self._done else None)
      except StopIteration:
        self._done.add(row)
        out.append(None)
    empty = {key: np.zeros(self.width, np.int32) for key in self.keys}
    return {key: np.stack([np.asarray((e or empty)[key], np.int32) for e in out])
            for key in self.keys}

  @property
  def finished(self) -> bool:
    return len(self._done) == len(self.rows)

  def get_state(self) -> dict[str, Any]:
    return {str(row): self._streams[row].get_state() for row in self.rows}

  def set_state(self, state: dict[str, Any]) -> None:
    missing = [row for row in self.rows if str(row) not in state]
    if missing:
      raise ConfigError(f"the saved input position has no stream for batch rows {missing[:4]}: "
                        f"it was saved with another train.batch_size")
    for row in self.rows:
      self._streams[row].set_state(_tuples(state[str(row)]))


def _tuples(state: Any) -> Any:
  """A stream state as Grain made it from one read back from JSON, which has no tuples: Grain's
  packer marks "no partial document held" with the tuple (-1, -1) and compares with it, so a
  list [-1, -1] would make a restored stream drop the rest of the document it starts with."""
  if isinstance(state, dict):
    return {key: _tuples(value) for key, value in state.items()}
  if isinstance(state, list):
    return tuple(_tuples(value) for value in state)
  return state


class Prefetcher:
  """Prepares the next `depth` batches in a background thread. `state` is the input position
  after the last batch handed out; `tokens_per_s` is the loader's own speed."""

  def __init__(self, batches: Batches, depth: int):
    self._batches, self._depth = batches, depth
    self.state = batches.get_state()
    self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
    self._thread: threading.Thread | None = None
    self._stop = threading.Event()
    self._busy_s, self._tokens = 0.0, 0
    self.wait_s = 0.0  # time the consumer waited for batches
    self._peeked: tuple | None = None

  def set_state(self, state: dict[str, Any]) -> None:
    assert self._thread is None, "set the state before the first batch"
    self._batches.set_state(state)
    self.state = self._batches.get_state()

  def _produce(self) -> None:
    try:
      while not self._stop.is_set():
        t0 = time.perf_counter()
        batch = next(self._batches)
        item = (batch, self._batches.get_state(), time.perf_counter() - t0)
        while not self._stop.is_set():
          try:
            self._queue.put(item, timeout=0.1)
            break
          except queue.Full:
            pass
    except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
      self._queue.put((e, None, 0.0))

  def peek(self) -> None:
    """Makes the next batch now (raising what reading it raises), to hand it out next."""
    if self._peeked is None:
      self._peeked = self._fetch()

  def __next__(self) -> dict[str, np.ndarray]:
    batch, state, elapsed = self._peeked or self._fetch()
    self._peeked = None
    self.state = state
    self._busy_s += elapsed
    self._tokens += batch["tokens"].size
    return batch

  def _fetch(self) -> tuple:
    if self._depth == 0:
      t0 = time.perf_counter()
      batch = next(self._batches)
      elapsed = time.perf_counter() - t0
      state = self._batches.get_state()
      self.wait_s += elapsed
    else:
      if self._thread is None:
        self._thread = threading.Thread(target=self._produce, daemon=True, name="jmoe-data")
        self._thread.start()
      t0 = time.perf_counter()
      batch, state, elapsed = self._queue.get()
      self.wait_s += time.perf_counter() - t0
      if isinstance(batch, BaseException):
        raise batch
    return batch, state, elapsed

  @property
  def tokens_per_s(self) -> float:
    return self._tokens / self._busy_s if self._busy_s else 0.0

  def close(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)


def local_rows(layout: Layout, batch_size: int, width: int) -> list[int]:
  """The batch rows held by this process's devices."""
  rows = set()
  for index in layout.batch.addressable_devices_indices_map((batch_size, width)).values():
    rows.update(range(*index[0].indices(batch_size)))
  return sorted(rows)


def gather_state(local: dict[str, Any]) -> dict[str, Any]:
  """Every process's stream states, merged (a collective: all processes call it together)."""
  if jax.process_count() == 1:
    return dict(local)
  data = np.frombuffer(json.dumps(local).encode(), np.uint8)
  sizes = multihost_utils.process_allgather(np.array([data.size], np.int64))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  merged = {}
  for size, row in zip(sizes.reshape(-1), multihost_utils.process_allgather(padded)):
    merged.update(json.loads(row[:int(size)].tobytes()))
  return merged


class DataPipeline:
  """Training batches (and held-out evaluation batches) for one process, as global arrays."""

  def __init__(self, config: Config, layout: Layout, rows: list[int] | None = None):
    cfg = config.data
    self.config, self.layout = config, layout
    self.batch_size, self.width = config.train.batch_size, cfg.seq_len + 1
    self.tokenizer, parts = open_documents(cfg, config.model.vocab_size)
    self.settings = data_settings(config, self.tokenizer, parts)
    self.keys = batch_keys(cfg)
    self.rows = local_rows(layout, self.batch_size, self.width) if rows is None else rows
    self._position = {row: i for i, row in enumerate(self.rows)}
    self._loader = Prefetcher(Batches(training_order(config, parts), self.rows, self.batch_size,
                                      self.width, cfg.packing, self.keys), cfg.prefetch)
    held = [p[1] for p in parts if p[1] is not None]
    self._held = (grain.MapDataset.concatenate([grain.MapDataset.source(s) for s in held])
                  if held else None)
    self._eval: list[dict[str, jax.Array]] | None = None
    self.documents: int | None = None  # the most documents a row of the last batch holds

  def batch_spec(self) -> dict[str, jax.ShapeDtypeStruct]:
    return {key: jax.ShapeDtypeStruct((self.batch_size, self.width), np.int32,
                                      sharding=self.layout.batch) for key in self.keys}

  def _global(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    def one(array):
      return jax.make_array_from_callback(
          (self.batch_size, self.width), self.layout.batch,
          lambda index: array[[self._position[r]
                               for r in range(*index[0].indices(self.batch_size))]][:, index[1]])
    return {key: one(local[key]) for key in self.keys}

  def check_first_batch(self) -> None:
    """Reads the next batch ahead: documents that cannot be read stop the run now, not after
    the step is compiled."""
    self._loader.peek()

  def next_batch(self) -> dict[str, jax.Array]:
    """The next batch; `documents` says how many documents its rows (this process's) hold at
    most."""
    local = next(self._loader)
    self.documents = most_documents(local["segment_ids"])
    return self._global(local)

  def state(self) -> dict[str, Any]:
    """The input position after the last batch (all processes': call on every process), and the
    data settings it depends on."""
    return {"streams": gather_state(self._loader.state), "settings": self.settings}

  def restore(self, state: dict[str, Any], step: int, workdir: pathlib.Path) -> None:
    """Goes on from the input position `state` saved with the checkpoint of `step` in `workdir`;
    a ConfigError if this config would read other data from there (nothing read or written)."""
    refusal = resume_refusal(state.get("settings"), self.settings, step, workdir)
    rows = len(state["streams"])
    if refusal is None and rows != self.batch_size:
      refusal = (f"the checkpoint of step {step} in {workdir} was saved with train.batch_size "
                 f"{rows}, but this config has {self.batch_size}: each batch row reads its own "
                 f"share of the documents; set it back to resume")
    if refusal is not None:
      raise ConfigError(refusal)
    try:
      self._loader.set_state(state["streams"])
    except (KeyError, TypeError, ValueError) as e:  # a position no settings were saved with
      raise ConfigError(f"the input position saved with the checkpoint of step {step} in "
                        f"{workdir} does not fit this config's data settings ({type(e).__name__}:"
                        f" {e}); resume with the data settings it was saved with") from None

  def eval_batches(self) -> list[dict[str, jax.Array]]:
    """The held-out batches (the first data.eval_batches of them), the same at every call."""
    if self._held is None:
      raise ConfigError("evaluation needs held-out documents: set data.eval_fraction")
    if self._eval is None:
      batches = Batches(self._held, self.rows, self.batch_size, self.width,
                        self.config.data.packing, self.keys)
      self._eval = [self._global(b) for _, b in zip(range(self.config.data.eval_batches), batches)]
    return self._eval

  def loader_stats(self) -> dict[str, float]:
    """The loader's own tokens/s (this process) and the seconds training waited for it since
    the last call."""
    stats = {"loader_tokens_per_s": self._loader.tokens_per_s, "loader_wait_s": self._loader.wait_s}
    self._loader.wait_s = 0.0
    return stats

  def close(self) -> None:
    self._loader.close()


def global_batches(config: Config) -> Batches:
  """The global training batches as numpy arrays: all rows, read in this one process."""
  _, parts = open_documents(config.data, config.model.vocab_size)
  return Batches(training_order(config, parts), list(range(config.train.batch_size)),
                 config.train.batch_size, config.data.seq_len + 1, config.data.packing,
                 batch_keys(config.data))


def first_batches(config: Config, count: int = 1) -> list[dict[str, np.ndarray]]:
  """The first `count` global training batches."""
  batches = global_batches(config)
  return [next(batches) for _ in range(count)]
