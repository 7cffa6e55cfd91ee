"""python -m jmoe.train --config configs/NAME.py --workdir DIR [--config.group.key=value ...]"""

from __future__ import annotations

import argparse
import sys

from jmoe.cli import run
from jmoe.config import ConfigError, load_config
from jmoe.train.loop import train


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
  """Separates `--config.a.b=value` / `--config.a.b value` overrides from the other arguments."""
  rest, overrides, i = [], [], 0
  while i < len(argv):
    arg = argv[i]
    if arg.startswith("--config."):
      if "=" not in arg:
        if i + 1 == len(argv):
          raise ConfigError(f"override {arg} has no value")
        arg, i = f"{arg}={argv[i + 1]}", i + 1
      overrides.append(arg)
    else:
      rest.append(arg)
    i += 1
  return rest, overrides


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jmoe.train", description=__doc__)
  parser.add_argument("--config", required=True, help="a configs/*.py file with get_config()")
  parser.add_argument("--workdir", required=True,
                      help="where metrics, TensorBoard events and checkpoints go; an existing "
                           "workdir resumes from its latest checkpoint")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")

  def command() -> int:
    rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(rest)
    records = train(load_config(args.config, overrides), args.workdir,
                    progress=not args.no_progress)
    if records:
      first, last = records[0], records[-1]
      print(f"step {first['step']}: loss {first['loss']:.3f}  ->  step {last['step']}: "
            f"loss {last['loss']:.3f}  ({last['tokens_per_s']:.0f} tokens/s)")
    return 0

  return run(command)


if __name__ == "__main__":
  sys.exit(main())
