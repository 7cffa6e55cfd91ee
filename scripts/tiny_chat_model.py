"""A tiny Hugging Face Qwen3-MoE directory with a chat tokenizer, and a chat file, made offline.

  python scripts/tiny_chat_model.py --out /tmp/tiny-hf [--chats /tmp/chats.jsonl]

The model is configs/tiny_qwen3_moe.py with random weights, written by `jmoe.convert export-hf`
(so transformers loads it); the tokenizer is a byte-level BPE learned from the Python standard
library's sources, with ChatML turns (`<|im_start|>`, `<|im_end|>`) and a chat template in its
tokenizer_config.json. The chat file holds arithmetic questions and answers, one conversation per
line, for trying `configs/sft_tiny_qwen3_moe.py` end to end (README, "Fine-tuning").
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
VOCAB = 512


def write_tokenizer(out: pathlib.Path) -> None:
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from jmoe.data.sources import stdlib_files
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator((p.read_text(errors="replace") for p in stdlib_files(2_000_000)),
                                trainer)
  tokenizer.save(str(out / "tokenizer.json"))
  (out / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
      "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}, indent=2))


def write_model(out: pathlib.Path) -> None:
  """The model into `out`, an empty directory."""
  from flax import nnx
  from jmoe.hf.convert import export_hf
  from jmoe.checkpoint.params import save_model
  from jmoe.config import load_config
  from jmoe.model.factory import model_factory
  config = load_config(ROOT / "configs" / "tiny_qwen3_moe.py", [f"model.vocab_size={VOCAB}"])
  with tempfile.TemporaryDirectory() as tmp:
    save_model(pathlib.Path(tmp) / "ckpt", nnx.state(model_factory(config)()), config)
    export_hf(pathlib.Path(tmp) / "ckpt", out)


def write_chats(path: pathlib.Path, count: int, seed: int = 0) -> None:
  rng = random.Random(seed)
  with open(path, "w") as f:
    for _ in range(count):
      a, b = rng.randrange(10), rng.randrange(10)
      messages = [{"role": "user", "content": f"What is {a} + {b}?"},
                  {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]
      if rng.random() < 0.5:
        messages = [{"role": "system", "content": "Answer with the sum."}] + messages
      f.write(json.dumps({"messages": messages}) + "\n")


def main(argv: list[str] | None = None) -> int:
  from jmoe.cli import run
  from jmoe.config import ConfigError
  from jmoe.outputs import check, written
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True, help="the Hugging Face directory to write (new)")
  parser.add_argument("--chats", help="also write this many conversations here (JSONL, new)")
  parser.add_argument("--count", type=int, default=2000, help="conversations in --chats")
  args = parser.parse_args(argv)

  def command() -> int:  # both outputs checked before either is made
    out = check(args.out, directory=True)
    chats = None if args.chats is None else check(args.chats, directory=False, flag="--chats")
    if chats is not None and chats.path == out.path:
      raise ConfigError(f"--chats and --out both name {out.path}; give each its own path")
    with written(out) as tmp:
      write_model(tmp)
      write_tokenizer(tmp)
    print(f"wrote {out.path}")
    if chats is not None:
      with written(chats) as tmp:
        write_chats(tmp, args.count)
      print(f"wrote {chats.path} ({args.count} conversations)")
    return 0

  return run(command)


if __name__ == "__main__":
  sys.exit(main())
