"""What a checkpoint's input position depends on, and whether a resumed run reads the same data.

The position saved with a checkpoint (each batch row's Grain stream state) counts documents of
one document order and tokens of one packing: it means the same thing only for the same
documents, order, tokenizer and rows. `data_settings` records what it depends on, saved beside
it; `resume_refusal` compares that record with the resuming run's, as the model settings are
compared (jmoe/config/resume.py). A difference that changes which tokens come next is refused
by name; the same files found under another path are resumed, with a notice.
"""

from __future__ import annotations

import logging
import pathlib

from jmoe.config import Config
from jmoe.config.resume import changed, saved_with

log = logging.getLogger("jmoe")


def data_settings(config: Config, tokenizer, parts: list) -> dict:
  """The data settings the input position depends on (JSON): data.source's text, each entry's
  files (kind, documents, a digest of names and sizes) and weight, and the named fields."""
  cfg = config.data
  fields = {"train.batch_size": config.train.batch_size, "data.seq_len": cfg.seq_len,
            "data.packing": cfg.packing, "data.shuffle": cfg.shuffle}
  if cfg.shuffle:
    fields["train.seed"] = config.train.seed
  fields.update({"data.eval_fraction": cfg.eval_fraction, "data.tokenizer": tokenizer.fingerprint,
                 "data.eod_token": tokenizer.EOD})
  kinds = {train.kind for train, _, _ in parts}
  if kinds & {"jsonl", "parquet"}:
    fields["data.text_key"] = cfg.text_key
  if "chat" in kinds:
    fields["data.chat_key"] = cfg.chat_key
  if "stdlib" in kinds:
    fields["data.max_corpus_bytes"] = cfg.max_corpus_bytes
  entries = []
  for train, _, weight in parts:
    identity = train.identity()
    if "template" in identity:  # what data.chat_template (or the tokenizer's folder) gives
      fields["data.chat_template"] = identity.pop("template")
    entries.append(dict(identity, weight=weight))
  return {"source": cfg.source, "names": [train.name for train, _, _ in parts],
          "entries": entries, "fields": fields}


def resume_refusal(saved: dict | None, now: dict, step: int, workdir: pathlib.Path) -> str | None:
  """Why the input position saved with the checkpoint of `step` (with the settings `saved`) cannot
  be resumed under the settings `now`, or None (after a notice, where one is due)."""
  checkpoint = f"the checkpoint of step {step} in {workdir}"
  if saved is None:
    log.warning("%s does not record the data settings of its input position (an earlier jmoe "
                "wrote it): resuming as if they were this config's", checkpoint)
    return None
  what_to_do = (f"resuming would read other data than the run it continues. Set it back to "
                f"resume, or train on from its model in a new workdir "
                f"(--config.checkpoint.load_params={workdir})")
  same_files = saved["entries"] == now["entries"]
  if saved["source"] != now["source"] and not same_files:
    return (f"{checkpoint} was saved reading data.source {saved['source']!r}, but this config "
            f"reads {now['source']!r}: {what_to_do}")
  names = changed(saved["fields"], now["fields"])
  if names:  # the first: the ones after it may follow from it (train.seed only with data.shuffle)
    return (f"{saved_with(checkpoint, names[:1], saved['fields'], now['fields'], _shown)}: "
            f"{what_to_do}")
  if not same_files:
    for name, old, new in zip(now["names"], saved["entries"], now["entries"]):
      if old != new:
        counts = (f"{old['documents']} documents then, {new['documents']} now"
                  if old["documents"] != new["documents"] else "other file names or sizes")
        return (f"the files of data.source entry {name!r} changed since {checkpoint} "
                f"was saved ({counts}): {what_to_do.replace('Set it back', 'Put them back')}")
  if saved["source"] != now["source"]:
    log.warning("data.source is %r, and %s was saved reading %r: the same files (names, sizes, "
                "documents and weights), so the run resumes on them", now["source"], checkpoint,
                saved["source"])
  return None


def _shown(name: str, value) -> str:
  """A recorded setting as the message shows it (files by the digest of their contents)."""
  if name in ("data.tokenizer", "data.chat_template") and value not in (None, "bytes"):
    return f"(a file of sha256 {value}...)"
  if name == "data.eod_token":
    return f"(token id {value})"
  return "(not set)" if value is None else repr(value)
