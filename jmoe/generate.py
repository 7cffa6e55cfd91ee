"""Continuations of prompts from a jmoe model.

  python -m jmoe.generate --checkpoint CKPT (--prompt TEXT [--tokenizer T] [--chat] | --tokens-file F)
      [--max-new-tokens 32] [--temperature 0] [--top-p 1] [--seed 0] [--no-cache]

CKPT is what `jmoe.score` takes: a model checkpoint (from `jmoe.convert import-hf`) or a training
workdir (its latest checkpoint). `--prompt` may be given several times (a batch); T is a
tokenizer.json file (or a directory holding one; default: CKPT's own, which import-hf and training
keep there), or `bytes` for jmoe's byte tokenizer. `--chat` makes each prompt a user's message,
rendered with the chat template beside the tokenizer and followed by the assistant's turn; the
reply is the new tokens through the first special token (its end of turn). F holds one prompt per
line, token ids separated by spaces. Temperature 0 is greedy decoding; otherwise tokens are drawn
from the softmax at that temperature, within the top-p nucleus, from `--seed`. Decoding keeps a key/value
cache (multi-head latent attention: its latents); `--no-cache` recomputes the whole sequence at
every step instead, the reference. Prints one JSON object per prompt and line:
{"tokens": [the new token ids], "text": their text (with a tokenizer)}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from jmoe.cli import callable_module, number, run
from jmoe.config import ConfigError, ParallelConfig


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jmoe.generate",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--prompt", action="append", help="a prompt's text (repeatable)")
  parser.add_argument("--tokenizer", help="tokenizer.json for --prompt and the output's text, "
                                          "or `bytes`")
  parser.add_argument("--chat", action="store_true",
                      help="each --prompt is a user's message in the tokenizer's chat template")
  parser.add_argument("--tokens-file", help="one prompt per line, token ids separated by spaces")
  parser.add_argument("--max-new-tokens", type=number(int, 1), default=32)
  parser.add_argument("--temperature", type=number(float, 0), default=0.0)
  parser.add_argument("--top-p", type=number(float, 0, 1, open_low=True), default=1.0)
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
    name = args.tokenizer
    if args.prompt and not name:
      name = args.checkpoint
      if not (pathlib.Path(name) / "tokenizer.json").is_file():
        raise ConfigError(f"--prompt needs --tokenizer (a tokenizer.json file, or `bytes`): "
                          f"{name} holds no tokenizer.json of its own")
    if args.chat and not args.prompt:
      raise ConfigError("--chat takes the messages as --prompt TEXT")
    layout = make_layout(ParallelConfig())
    config, model = load_model(args.checkpoint, layout)
    tokenizer = _tokenizer(name, config.model.vocab_size) if name else None
    if args.chat:
      from jmoe.data.chat import ChatTemplate
      if tokenizer.path is None:
        raise ConfigError("--chat needs a tokenizer.json with its chat template, not `bytes`")
      template = ChatTemplate.from_files(tokenizer.path)
      texts = [template.render([{"role": "user", "content": text}], add_generation_prompt=True)
               for text in args.prompt]
    else:
      texts = args.prompt
    if args.prompt:
      prompts = [tokenizer.encode(text).tolist() for text in texts]
      if not all(prompts):
        raise ConfigError("a --prompt encodes to no tokens; give some text")
    else:
      prompts = read_tokens(args.tokens_file, config.model.vocab_size)
    outputs = generate(model, layout, prompts, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                       cache=not args.no_cache)
    for new in outputs:
      if args.chat:
        ends = [i for i, t in enumerate(new) if t in tokenizer.special_ids]
        new = new[:ends[0] + 1] if ends else new
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



def _api_generate():
  from jmoe.api import generate
  return generate


callable_module(__name__, _api_generate)  # `jmoe.generate(...)` after `import jmoe.generate`


if __name__ == "__main__":
  sys.exit(main())
