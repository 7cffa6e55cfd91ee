"""The input pipeline's own speed, without training: tokens/s of packed global batches.

  python scripts/loader_throughput.py --config configs/tiny_moe.py [--batches 200]
      [--config.data.source=...] [--config.train.batch_size=...]

Reads the first --batches global batches of the config's training data in this one process (all
rows, as on a single host) and prints one JSON line: batches, tokens, seconds, tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from jmoe.cli import run, split_overrides
from jmoe.config import load_config
from jmoe.data.pipeline import global_batches


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--batches", type=int, default=200)

  def command() -> int:
    rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(rest)
    config = load_config(args.config, overrides)
    t0 = time.perf_counter()
    batches = global_batches(config)
    opened = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = sum(next(batches)["tokens"].size for _ in range(args.batches))
    seconds = time.perf_counter() - t0
    print(json.dumps({"source": config.data.source, "batches": args.batches, "tokens": tokens,
                      "open_s": round(opened, 3), "seconds": round(seconds, 3),
                      "tokens_per_s": round(tokens / seconds)}))
    return 0

  return run(command)


if __name__ == "__main__":
  sys.exit(main())
