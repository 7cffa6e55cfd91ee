"""Chat data: templates rendered as transformers renders them, the assistant-only loss mask, and
the mask through packing and into the loss."""

import json
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import build, tiny_config
from jmoe.config import ConfigError, DataConfig
from jmoe.data.chat import ChatTemplate, tokenize_chat
from jmoe.data.pipeline import Batches, MASKED_KEYS, open_documents, training_order
from jmoe.data.tokenizer import HFTokenizer
from jmoe.train.step import make_loss_fn, target_counts

SPECIAL = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]

# ChatML with a quirk many templates share: the final assistant turn is rendered differently
# (here with an empty thinking block) from the same turn inside a longer conversation.
CHATML_THINKING = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{{- message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Instruction brackets, the end token from tokenizer_config.json, a check that raises.
INSTRUCTIONS = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('user and assistant must take turns') }}{%- endif %}"
    "{%- if message.role == 'user' %}{{- '[INST] ' + message.content + ' [/INST]' }}"
    "{%- else %}{{- ' ' + message.content + eos_token }}{%- endif %}{%- endfor %}")
# transformers' {% generation %} blocks mark the assistant's tokens themselves.
MARKED = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' %}{% generation %}{{- message.content + '<|im_end|>' }}"
    "{% endgeneration %}{{- '\\n' }}{%- else %}{{- message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "And of Germany? Answer in one word."},
     {"role": "assistant", "content": "Berlin, a city of 3.7 million people."}],
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "Name a colour of the sky."},
     {"role": "assistant", "content": "Blue – or grey, on rainy days."}],
]


def make_chat_tokenizer(directory, template):
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
  tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  texts = [m["content"] for c in CONVERSATIONS for m in c] * 4
  tokenizer.train_from_iterator(texts, trainer)
  tokenizer.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
      "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}, "chat_template": template}))
  return directory


def counted_text(ids, mask, directory):
  """The counted tokens as text, one string per run of counted tokens."""
  from tokenizers import Tokenizer
  raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
  runs, run = [], []
  for token, counted in zip(ids.tolist() + [-1], mask.tolist() + [0]):
    if counted:
      run.append(token)
    elif run:
      runs.append(raw.decode(run, skip_special_tokens=False))
      run = []
  return runs


@pytest.mark.parametrize("template,expected", [
    (CHATML_THINKING, [["Paris.<|im_end|>", "<think>\n\n</think>\n\nBerlin, a city of 3.7 "
                        "million people.<|im_end|>"],
                       ["<think>\n\n</think>\n\nBlue – or grey, on rainy days.<|im_end|>"]]),
    (MARKED, [["Paris.<|im_end|>", "Berlin, a city of 3.7 million people.<|im_end|>"],
              ["Blue – or grey, on rainy days.<|im_end|>"]]),
])
def test_only_the_assistants_turns_and_their_end_tokens_count(tmp_path, template, expected):
  directory = make_chat_tokenizer(tmp_path, template)
  tokenizer, chat = HFTokenizer(directory, "<|endoftext|>"), ChatTemplate.from_files(directory)
  for messages, turns in zip(CONVERSATIONS, expected):
    ids, mask = tokenize_chat(messages, chat, tokenizer)
    assert counted_text(ids, mask, directory) == turns
    assert tokenizer.decode(ids) == tokenizer.decode(tokenizer.encode(chat.render(messages)))


def test_the_end_token_comes_from_tokenizer_config_and_template_errors_are_named(tmp_path):
  directory = make_chat_tokenizer(tmp_path, INSTRUCTIONS)
  tokenizer, chat = HFTokenizer(directory, "<|endoftext|>"), ChatTemplate.from_files(directory)
  messages = [m for m in CONVERSATIONS[0]]
  ids, mask = tokenize_chat(messages, chat, tokenizer)
  assert chat.render(messages).startswith("<s>[INST] What is")
  assert counted_text(ids, mask, directory) == [" Paris.</s>",
                                                " Berlin, a city of 3.7 million people.</s>"]
  with pytest.raises(ConfigError, match="refuses a conversation: user and assistant must take "
                                        "turns"):
    tokenize_chat(CONVERSATIONS[1], chat, tokenizer)
  with pytest.raises(ConfigError, match="not valid Jinja2"):
    ChatTemplate("{% for m in messages %}", {}, "x")


def test_rendering_and_marked_mask_match_transformers(tmp_path):
  from test_hf import HF_PYTHON, ROOT
  if not HF_PYTHON.exists():
    pytest.skip("no reference Python: run scripts/hf_reference_env.sh")
  (tmp_path / "conversations.json").write_text(json.dumps(CONVERSATIONS[:1] + [
      [m for m in CONVERSATIONS[1] if m["role"] != "system"]]))
  for name, template in (("thinking", CHATML_THINKING), ("inst", INSTRUCTIONS),
                         ("marked", MARKED)):
    directory = make_chat_tokenizer(tmp_path / name, template)
    subprocess.run([str(HF_PYTHON), str(ROOT / "tests" / "hf_reference.py"), "chat",
                    str(directory), str(tmp_path / "conversations.json"),
                    str(tmp_path / f"{name}.json")], check=True)
    chat, tokenizer = ChatTemplate.from_files(directory), HFTokenizer(directory, "<|endoftext|>")
    for messages, want in zip(json.loads((tmp_path / "conversations.json").read_text()),
                              json.loads((tmp_path / f"{name}.json").read_text())):
      assert chat.render(messages) == want["text"]
      assert chat.render(messages[:-1], add_generation_prompt=True) == want["prompt"]
      if name == "marked":
        ids, mask = tokenize_chat(messages, chat, tokenizer)
        assert ids.tolist() == want["ids"] and mask.tolist() == want["mask"]


def write_chats(path, count=12):
  with open(path, "w") as f:
    for i in range(count):
      f.write(json.dumps({"messages": CONVERSATIONS[i % 2], "id": i}) + "\n")


def test_packed_rows_keep_each_documents_mask(tmp_path):
  directory = make_chat_tokenizer(tmp_path / "tok", CHATML_THINKING)
  write_chats(tmp_path / "chats.jsonl")
  config = tiny_config(data=dict(source=f"chat:{tmp_path / 'chats.jsonl'}",
                                 tokenizer=str(directory), eod_token="<|endoftext|>",
                                 seq_len=40, shuffle=False), model=dict(vocab_size=512))
  _, parts = open_documents(config.data, 512)
  documents = [parts[0][0][i] for i in range(2)]
  batches = Batches(training_order(config, parts), [0], 1, 41, "concat", MASKED_KEYS)
  rows = [next(batches) for _ in range(6)]
  tokens = np.concatenate([r["tokens"][0] for r in rows])
  mask = np.concatenate([r["loss_mask"][0] for r in rows])
  whole = np.concatenate([d["tokens"] for d in documents] * 3)
  n = min(tokens.size, whole.size)
  np.testing.assert_array_equal(tokens[:n], whole[:n])
  np.testing.assert_array_equal(mask[:n], np.concatenate([d["loss_mask"] for d in documents]
                                                         * 3)[:n])
  assert 0 < mask.sum() < mask.size and documents[0]["loss_mask"][-1] == 0  # the EOD: not counted


def test_chat_loss_is_the_mean_over_the_assistants_tokens():
  config = tiny_config()
  model = build(config)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.model.vocab_size, (2, 17)).astype(np.int32)
  segments = np.array([[1] * 9 + [2] * 8, [1] * 14 + [0] * 3], np.int32)
  loss_mask = rng.integers(0, 2, (2, 17)).astype(np.int32)
  batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(segments),
           "positions": jnp.asarray(np.concatenate([np.arange(9), np.arange(8)])[None]
                                    .repeat(2, 0)), "loss_mask": jnp.asarray(loss_mask)}
  loss_fn = make_loss_fn(graphdef, config)
  _, metrics = loss_fn(params, rest, batch, target_counts(batch, 0), 1)
  logits = np.asarray(model(batch["tokens"][:, :-1], batch["positions"][:, :-1],
                            batch["segment_ids"][:, :-1])[0], np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  total, count = 0.0, 0
  for b in range(2):
    for i in range(16):
      if segments[b, i] and segments[b, i + 1] == segments[b, i] and loss_mask[b, i + 1]:
        total -= logp[b, i, tokens[b, i + 1]]
        count += 1
  assert 0 < count < 30 and float(target_counts(batch, 0)["lm"]) == count
  np.testing.assert_allclose(float(metrics["lm_loss"]), total / count, rtol=2e-4)


def test_bad_chat_input_is_named(tmp_path):
  directory = make_chat_tokenizer(tmp_path / "tok", CHATML_THINKING)
  (tmp_path / "a.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]})
                                    + "\n")
  (tmp_path / "b.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
  for name, message in (("a", "has no assistant message"), ("b", "has no list of messages "
                                                                  "'messages'")):
    cfg = DataConfig(source=f"chat:{tmp_path / name}.jsonl", tokenizer=str(directory),
                     eod_token="<|endoftext|>")
    with pytest.raises(ConfigError, match=message):  # opening reads up to the first text
      open_documents(cfg, 512)
  with pytest.raises(ConfigError, match="set data.tokenizer"):
    open_documents(DataConfig(source=f"chat:{tmp_path / 'a.jsonl'}"), 512)
  (directory / "tokenizer_config.json").write_text("{}")
  with pytest.raises(ConfigError, match="needs a chat template"):
    open_documents(DataConfig(source=f"chat:{tmp_path / 'a.jsonl'}", tokenizer=str(directory),
                              eod_token="<|endoftext|>"), 512)
