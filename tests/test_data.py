"""The input pipeline: packing keeps documents apart, every token once per epoch whatever the host
count, exact resume, sources and mixtures, token shards, and messages for bad input."""

import collections
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from jmoe.config import ConfigError, DataConfig
from jmoe.data.pipeline import (Batches, Prefetcher, document_order, first_batches, open_documents,
                                training_order)
from jmoe.data.prepare import prepare
from jmoe.data.sources import TokenShards
from jmoe.data.tokenizer import ByteTokenizer, HFTokenizer
from jmoe.train.loop import train
from helpers import build, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def write_docs(directory, count, seed=0, suffix=".txt"):
  """`count` text files of 5 to 120 characters, each distinct."""
  rng = np.random.default_rng(seed)
  directory.mkdir(parents=True, exist_ok=True)
  texts = []
  for i in range(count):
    body = "".join(rng.choice(list("abcdefghij klmnop"), size=int(rng.integers(5, 120))))
    text = f"doc{i}:{body}"
    (directory / f"{i:03d}{suffix}").write_text(text)
    texts.append(text)
  return texts


@pytest.mark.parametrize("variant", ["gqa", "mla", "sinks_windows"])
def test_packed_documents_do_not_see_each_other(variant):
  model_cfg = {"gqa": {}, "mla": dict(attention="mla", mla=dict(
      q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)),
               "sinks_windows": dict(attention_sinks=True, sliding_window=6,
                                     full_attention_every=2)}[variant]
  config = tiny_config(model=model_cfg)
  model = build(config)
  forward = nnx.jit(lambda model, *args: model(*args)[0])
  rng = np.random.default_rng(0)
  first, second = rng.integers(0, 256, 13), rng.integers(0, 256, 19)
  tokens = np.concatenate([first, second])[None]
  segments = np.array([[1] * 13 + [2] * 19])
  positions = np.concatenate([np.arange(13), np.arange(19)])[None]
  logits = forward(model, tokens, positions, segments)
  alone = forward(model, second[None])  # the second document on its own, from position 0
  np.testing.assert_allclose(logits[0, 13:], alone[0], rtol=1e-5, atol=1e-5)
  # Changing the first document changes nothing in the second.
  changed = tokens.copy()
  changed[0, :13] = rng.integers(0, 256, 13)
  logits2 = forward(model, changed, positions, segments)
  np.testing.assert_array_equal(logits2[0, 13:], logits[0, 13:])
  assert not np.allclose(logits2[0, :13], logits[0, :13])


def test_padding_and_document_ends_carry_no_loss():
  from jmoe.train.loss import target_masks
  tokens = np.arange(8)[None]
  segments = np.array([[1, 1, 1, 2, 2, 0, 0, 0]])
  lm, mtp = target_masks(tokens, segments, 1)
  # A target counts only inside its input's document: 0->1, 1->2, 3->4.
  np.testing.assert_array_equal(lm, [[1, 1, 0, 1, 0, 0, 0]])
  np.testing.assert_array_equal(mtp[:, 0], [[1, 0, 0, 0, 0, 0, 0]])


def epoch_tokens(documents, hosts, rows=8, width=17):
  """Every non-padding token of one epoch, read as `hosts` processes would, and the global
  batches assembled from them."""
  counts, batches = collections.Counter(), []
  per_host = [Batches(documents, list(range(h * rows // hosts, (h + 1) * rows // hosts)), rows,
                      width, "concat") for h in range(hosts)]
  while not all(b.finished for b in per_host):  # hosts in lockstep; a finished row pads
    parts = [next(b) for b in per_host]
    batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    batches.append(batch)
    counts.update(batch["tokens"][batch["segment_ids"] > 0].tolist())
  return counts, batches


def test_an_epoch_reads_every_token_once_whatever_the_host_count(tmp_path):
  texts = write_docs(tmp_path / "docs", 37)
  config = DataConfig(source=str(tmp_path / "docs"))
  tokenizer, parts = open_documents(config, 264)
  documents = document_order([parts[0][0]], [1.0], seed=3, shuffle=True, epochs=1)
  expected = collections.Counter()
  for text in texts:
    expected.update(tokenizer.encode(text).tolist() + [tokenizer.EOD])
  reference = None
  for hosts in (1, 2, 4):
    counts, batches = epoch_tokens(documents, hosts)
    assert counts == expected, hosts
    if reference is None:
      reference = batches
    else:  # the same global batches, however many hosts read them
      for a, b in zip(batches, reference, strict=True):
        for key in a:
          np.testing.assert_array_equal(a[key], b[key])


def test_resuming_the_loader_gives_the_same_batches(tmp_path):
  write_docs(tmp_path / "docs", 23)
  config = tiny_config(data=dict(source=str(tmp_path / "docs"), seq_len=16))
  _, parts = open_documents(config.data, 264)
  order = document_order([parts[0][0]], [1.0], seed=0, shuffle=True, epochs=None)
  make = lambda: Prefetcher(Batches(order, [0, 2, 5], 8, 17, "concat"), depth=2)
  loader = make()
  for _ in range(7):
    next(loader)
  state = json.loads(json.dumps(loader.state))  # as a checkpoint stores it
  expected = [next(loader) for _ in range(9)]  # a long run: epochs end and restart
  loader.close()
  resumed = make()
  resumed.set_state(state)
  for a, b in zip(expected, [next(resumed) for _ in range(9)]):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  resumed.close()


def test_mixture_weights_set_each_sources_share(tmp_path):
  write_docs(tmp_path / "a", 10, seed=1)
  write_docs(tmp_path / "b", 10, seed=2, suffix=".md")
  config = DataConfig(source=f"{tmp_path / 'a'}@3, text:{tmp_path / 'b'}@1")
  tokenizer, parts = open_documents(config, 264)
  order = training_order(tiny_config(data=dict(source=config.source)), parts)
  texts_a = {p.read_text() for p in (tmp_path / "a").iterdir()}
  from_a = sum(tokenizer.decode(order[i]) in texts_a for i in range(400))
  assert from_a == 300


def make_tokenizer(path, texts, vocab=300):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<|endoftext|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(texts, trainer)
  tokenizer.save(str(path))
  return path


def test_jsonl_and_parquet_through_a_tokenizer_json(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  texts = [f"document {i} says {'hello ' * (i % 5)}world" for i in range(30)]
  path = make_tokenizer(tmp_path / "tokenizer.json", texts)
  with open(tmp_path / "a.jsonl", "w") as f:
    for t in texts[:20]:
      f.write(json.dumps({"text": t, "id": 1}) + "\n")
  pq.write_table(pa.table({"text": texts[20:]}), tmp_path / "b.parquet", row_group_size=4)
  tokenizer = HFTokenizer(path)
  config = DataConfig(source=f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.parquet'}",
                      tokenizer=str(path))
  _, parts = open_documents(config, 320)
  docs = [parts[0][0][i] for i in range(20)] + [parts[1][0][i] for i in range(10)]
  for text, ids in zip(texts, docs):
    np.testing.assert_array_equal(ids[:-1], tokenizer.encode(text))
    assert ids[-1] == tokenizer.EOD and tokenizer.decode(ids[:-1]) == text
  with pytest.raises(ConfigError, match=r"model.vocab_size \(264\) is smaller than the tokenizer "
                                        r".*tokenizer.json's 300 ids"):
    open_documents(config, 264)


def test_prepare_then_train_on_the_shards_with_eval(tmp_path):
  """What a new user runs: text files -> `jmoe.data.prepare` -> training, with a held-out split."""
  write_docs(tmp_path / "docs", 60)
  result = subprocess.run(
      [sys.executable, "-m", "jmoe.data.prepare", "--source", str(tmp_path / "docs"),
       "--out", str(tmp_path / "tokens"), "--shard-tokens", "1000"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert "60 documents" in result.stdout and "tokens/s" in result.stdout
  index = json.loads((tmp_path / "tokens" / "index.json").read_text())
  assert len(index["shards"]) > 1 and index["dtype"] == "uint16"
  shards = TokenShards(tmp_path / "tokens", 264, ByteTokenizer())
  tokenizer = ByteTokenizer()
  files = sorted((tmp_path / "docs").iterdir())
  for i in (0, 17, 59):  # documents read back exactly, across shard boundaries
    np.testing.assert_array_equal(shards[i][:-1], tokenizer.encode(files[i].read_bytes()))

  config = tiny_config(data=dict(source=str(tmp_path / "tokens"), eval_fraction=0.1,
                                 eval_batches=2, seq_len=32),
                       train=dict(steps=4, eval_every=2))
  records = train(config, tmp_path / "run", progress=False, devices=jax.devices()[:1])
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  assert len(evals) == 2 and all(np.isfinite(evals))
  assert all(r["loader_tokens_per_s"] > 0 for r in records)


def test_bad_inputs_name_the_file_and_the_problem(tmp_path):
  cases = []
  (tmp_path / "empty.txt").write_text("")
  cases.append((f"{tmp_path / 'empty.txt'}", r"empty.txt is empty"))
  cases.append((f"{tmp_path / 'missing'}", r"missing does not exist"))
  (tmp_path / "bare").mkdir()
  cases.append((f"{tmp_path / 'bare'}", r"bare contains no"))
  (tmp_path / "x.jsonl").write_text('{"content": "hi"}\n')
  cases.append((f"{tmp_path / 'x.jsonl'}", r"x.jsonl: the line at byte 0 has no text field "
                                           r"'text' \(set data.text_key, or prepare's --text-key\)"))
  (tmp_path / "n.jsonl").write_text('{"text": 123}\n')
  cases.append((f"{tmp_path / 'n.jsonl'}", r"n.jsonl: the line at byte 0 holds int '123' in its "
                                           r"text field 'text', not a string"))
  cases.append((f"{tmp_path / 'bare'}@zero", r"the weight after @ must be a number"))
  for source, message in cases:
    with pytest.raises(ConfigError, match=message):
      _, parts = open_documents(DataConfig(source=source), 264)
      parts[0][0][0]  # a bad line is found when the document is read

  write_docs(tmp_path / "docs", 5)
  prepare(str(tmp_path / "docs"), tmp_path / "tokens")
  with pytest.raises(ConfigError, match=r"tokens holds token id 256, beyond the model's "
                                        r"vocabulary \(model.vocab_size 256\)"):
    TokenShards(tmp_path / "tokens", 256, ByteTokenizer())
  other = make_tokenizer(tmp_path / "tok.json", ["some text"], vocab=260)
  with pytest.raises(ConfigError, match=r"tokens was prepared with tokenizer 'bytes', but "
                                        r"data.tokenizer is"):
    open_documents(DataConfig(source=str(tmp_path / "tokens"), tokenizer=str(other)), 264)
  with pytest.raises(ConfigError, match="tokens is not empty; give an empty or new directory"):
    prepare(str(tmp_path / "docs"), tmp_path / "tokens")
  with pytest.raises(ConfigError, match="has no end-of-document token"):
    HFTokenizer(other, eod_token="<|eot|>")


def test_first_batch_is_packed_with_positions_per_document(tmp_path):
  write_docs(tmp_path / "docs", 40)
  batch = first_batches(tiny_config(data=dict(source=str(tmp_path / "docs"), seq_len=64),
                                    train=dict(batch_size=8)))[0]
  assert batch["tokens"].shape == (8, 65)
  segments, positions = batch["segment_ids"], batch["positions"]
  assert segments.min() >= 1  # concatenated documents: no padding
  starts = np.diff(segments, axis=1) != 0
  assert starts.any()  # some row holds two documents
  # Positions restart at 0 where a new document starts and count up within one.
  np.testing.assert_array_equal(positions[:, 1:][starts], 0)
  np.testing.assert_array_equal(positions[:, 1:][~starts], positions[:, :-1][~starts] + 1)


def test_documents_are_counted_on_the_host_as_the_attention_kernels_count_them():
  """`most_documents` (the count the train step is chosen by) equals the attention kernels' own
  count on the device, row by row's maximum, for rows of runs, padding, one document, none."""
  from jmoe.data.pipeline import most_documents
  from jmoe.ops.attention_kernels import _document_starts
  rng = np.random.default_rng(0)
  rows = [np.repeat(np.arange(1, 6), rng.integers(1, 6, 5))[:16] for _ in range(6)]
  ids = np.stack([np.pad(r, (0, 16 - len(r))) for r in rows] + [np.ones(16, int),
                                                                 np.zeros(16, int)])
  for batch in (ids, ids[6:], ids[7:], ids[:3]):
    device = int(np.max(np.sum(np.asarray(_document_starts(batch)), axis=1)))
    assert most_documents(batch) == device
  assert most_documents(ids[6:7]) == 1 and most_documents(ids[7:]) == 0
  assert most_documents(np.asarray([[1, 1, 2, 2, 0, 0, 3, 3]])) == 3
