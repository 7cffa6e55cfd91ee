"""Continuations of prompts from a jmoe model.

  python -m jmoe.generate --checkpoint CKPT (--prompt TEXT --tokenizer T | --tokens-file F)
      [--max-new-tokens 32] [--temperature 0] [--top-p 1] [--seed 0] [--no-cache]

CKPT is what `jmoe.score` takes: a model checkpoint (from `jmoe.convert import-hf`) or a training
workdir (its latest checkpoint). `--prompt` may be given several times (a batch); T is a
tokenizer.json file, or `bytes` for jmoe's byte tokenizer. F holds one prompt per line, token ids
separated by spaces. Temperature 0 is greedy decoding; otherwise tokens are drawn from the
softmax at that temperature, within the top-p nucleus, from `--seed`. Decoding keeps a key/value
cache (multi-head latent attention: its latents); `--no-cache` recomputes the whole sequence at
every step instead, the reference. Prints one JSON object per prompt and line:
{"tokens": [the new token ids], "text": their text (with a tokenizer)}.
"""

from __future__ import annotations

import argparse
import json
import sys

from jmoe.cli import run
from jmoe.config import ConfigError, ParallelConfig


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jmoe.generate",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--prompt", action="append", help="a prompt's text (repeatable)")
  parser.add_argument("--tokenizer", help="tokenizer.json for --prompt and the output's text, "
                                          "or `bytes`")
  parser.add_argument("--tokens-file", help="one prompt per line, token ids separated by spaces")
  parser.add_argument("--max-new-tokens", type=int, default=32)
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--top-p", type=float, default=1.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--no-cache", action="store_true",
                      help="recompute the whole sequence each step (the reference)")
  args = parser.parse_args(argv)

  def command() -> int:
    from jmoe.checkpoint.params import load_model
    from jmoe.inference.generate import generate
    from jmoe.parallel import make_layout
    from jmoe.score import read_tokens
    if bool(args.prompt) == bool(args.tokens_file):
      raise ConfigError("give the prompts as --prompt TEXT (with --tokenizer) or as "
                        "--tokens-file F, one of the two")
    if args.prompt and not args.tokenizer:
      raise ConfigError("--prompt needs --tokenizer (a tokenizer.json file, or `bytes`)")
    layout = make_layout(ParallelConfig())
    config, model = load_model(args.checkpoint, layout)
    tokenizer = _tokenizer(args.tokenizer, config.model.vocab_size) if args.tokenizer else None
    if args.prompt:
      prompts = [tokenizer.encode(text).tolist() for text in args.prompt]
      if not all(prompts):
        raise ConfigError("a --prompt encodes to no tokens; give some text")
    else:
      prompts = read_tokens(args.tokens_file, config.model.vocab_size)
    outputs = generate(model, layout, prompts, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                       cache=not args.no_cache)
    for new in outputs:
      record = {"tokens": new}
      if tokenizer is not None:
        record["text"] = tokenizer.decode(new)
      print(json.dumps(record))
    return 0

  return run(command)


def _tokenizer(name: str, vocab_size: int):
  from jmoe.data.tokenizer import ByteTokenizer, HFTokenizer
  tokenizer = ByteTokenizer() if name == "bytes" else HFTokenizer(name)
  if tokenizer.vocab_size > vocab_size:
    raise ConfigError(f"--tokenizer {name} has {tokenizer.vocab_size} ids, more than the "
                      f"model's vocabulary of {vocab_size}")
  return tokenizer


if __name__ == "__main__":
  sys.exit(main())
