"""What the command-line entry points share: jmoe's own log messages, and errors as messages."""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from jmoe.errors import ConfigError, Diverged, Interrupted


def setup_logging() -> None:
  log = logging.getLogger("jmoe")  # only jmoe's own messages; libraries keep their levels
  if not log.handlers:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s jmoe: %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
  log.setLevel(logging.INFO)
  log.propagate = False


def run(main: Callable[[], int]) -> int:
  """Runs a command; a ConfigError (bad config, data, checkpoint) becomes a message and exit 2
  (with JMOE_DEBUG=1 in the environment, its traceback), a diverged run exit 3, and a run
  stopped by a signal (after its checkpoint) exits with 128 + the signal's number, as a process
  killed by it would, so launchers see that it did not finish."""
  setup_logging()
  debug = os.environ.get("JMOE_DEBUG", "") not in ("", "0")
  try:
    return main()
  except ConfigError as e:
    if debug:
      raise
    print(f"error: {e}", file=sys.stderr)
    return 2
  except Diverged as e:
    print(f"error: {e}", file=sys.stderr)
    return 3
  except Interrupted as e:
    print(f"jmoe: {e}", file=sys.stderr)
    return 128 + e.signum


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
