"""What the command-line entry points share: jmoe's own log messages, and errors as messages."""

from __future__ import annotations

import logging
import sys
from typing import Callable

from jmoe.config import ConfigError


def setup_logging() -> None:
  log = logging.getLogger("jmoe")  # only jmoe's own messages; libraries keep their levels
  if not log.handlers:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s jmoe: %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
  log.setLevel(logging.INFO)
  log.propagate = False


def run(main: Callable[[], int]) -> int:
  """Runs a command; a ConfigError (bad config, data, checkpoint) becomes a message and exit 2."""
  setup_logging()
  try:
    return main()
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
