"""Per-token log-probabilities of token sequences under a jmoe model.

  python -m jmoe.score --checkpoint CKPT --tokens-file F [--out F.json [--overwrite]]

F holds one sequence per line, token ids separated by spaces. The output is a JSON list with one
{"tokens": [...], "logprobs": [...]} per sequence, logprobs[i] = log p(tokens[i+1] | tokens[:i+1]).
CKPT is a model checkpoint (from `jmoe.convert import-hf`) or a training workdir. The model runs
data-parallel on all devices present. F.json appears once complete; a file already there is
replaced only with --overwrite, and never an input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import sys

from jmoe.cli import callable_module, run
from jmoe.config import ConfigError, ParallelConfig
from jmoe.outputs import check, written


def read_tokens(path: str | pathlib.Path, vocab_size: int) -> list[list[int]]:
  path = pathlib.Path(path)
  if not path.is_file():
    raise ConfigError(f"--tokens-file {path} does not exist (one sequence per line, token ids "
                      f"separated by spaces)")
  try:
    text = path.read_text()
  except UnicodeDecodeError:
    raise ConfigError(f"{path} is not text: one sequence per line, token ids separated by "
                      f"spaces") from None
  sequences = []
  for number, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    try:
      tokens = [int(t) for t in line.split()]
    except ValueError:
      raise ConfigError(f"{path}:{number}: token ids must be integers separated by spaces")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
      raise ConfigError(f"{path}:{number}: token id {bad[0]} is outside the model's vocabulary "
                        f"[0, {vocab_size})")
    sequences.append(tokens)
  if not sequences:
    raise ConfigError(f"{path} holds no sequences")
  return sequences


def _check_finite(logprobs: list[list[float]], args) -> None:
  """A log-probability that is not a number (JSON has none for NaN or inf) stops the command."""
  for n, values in enumerate(logprobs, 1):
    bad = [i for i, x in enumerate(values) if not math.isfinite(x)]
    if bad:
      raise ConfigError(f"{args.checkpoint} gives token {bad[0] + 1} (from 0) of sequence {n} "
                        f"in {args.tokens_file} the log-probability {values[bad[0]]} ({len(bad)} "
                        f"such in that sequence): the model's parameters are not finite, or "
                        f"overflow; nothing is written")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jmoe.score", description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--tokens-file", required=True)
  parser.add_argument("--out", help="where to write the JSON (a new file); default: standard "
                                     "output")
  parser.add_argument("--overwrite", action="store_true", help="replace the file --out names")
  args = parser.parse_args(argv)

  def command() -> int:
    from jmoe.checkpoint.params import load_model
    from jmoe.inference.score import score
    from jmoe.parallel import make_layout
    with contextlib.ExitStack() as stack:
      if args.out is not None:  # checked (and its temporary made) before any work
        tmp = stack.enter_context(written(check(
            args.out, directory=False, overwrite=args.overwrite,
            inputs={"--tokens-file": args.tokens_file, "--checkpoint": args.checkpoint})))
      layout = make_layout(ParallelConfig())
      config, model = load_model(args.checkpoint, layout)
      sequences = read_tokens(args.tokens_file, config.model.vocab_size)
      result = [{"tokens": s, "logprobs": lp} for s, lp in zip(sequences,
                                                               score(model, layout, sequences))]
      _check_finite([r["logprobs"] for r in result], args)
      text = json.dumps(result)
      if args.out is None:
        print(text)
      else:
        tmp.write_text(text)
    return 0

  return run(command)



def _api_score():
  from jmoe.api import score
  return score


callable_module(__name__, _api_score)  # `jmoe.score(...)` after `import jmoe.score`


if __name__ == "__main__":
  sys.exit(main())
