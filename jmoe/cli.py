"""What the command-line entry points share: jmoe's own log messages, and errors as messages."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
import types
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


def number(kind: type = float, low: float | None = None, high: float | None = None,
           open_low: bool = False) -> Callable[[str], float]:
  """An argparse `type` for a number flag: a finite `kind` (int or float) in [low, high] (low
  excluded with `open_low`), else argparse's one-line usage error naming the flag and the range."""
  bounds = (f"{'(' if open_low else '['}{'-inf' if low is None else low}, "
            f"{'inf' if high is None else high}]")

  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    below = low is not None and (value <= low if open_low else value < low)
    if not math.isfinite(value) or below or (high is not None and value > high):
      raise argparse.ArgumentTypeError(f"{text} is outside {bounds}")
    return value

  parse.__name__ = kind.__name__  # argparse names the type in its messages
  return parse


def callable_module(name: str, function: Callable[[], Callable]) -> None:
  """Makes the command module `name` callable as `function()`, the Python API's function of the
  same name: importing a submodule binds its name on the package, so once `jmoe.generate` (the
  command) is imported, `jmoe.generate(...)` (the function, jmoe/api.py) must still work."""

  class CommandModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
      return function()(*args, **kwargs)

  sys.modules[name].__class__ = CommandModule


def layout_parser(description: str) -> argparse.ArgumentParser:
  """The arguments of the commands that look at a config's step on a number of devices before
  renting them: `--config` and `--devices` (with `devices_for`); the command adds its own."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--config", required=True)
  parser.add_argument("--devices", type=int,
                      help="for this many devices: the first N at hand, or N simulated "
                           "(default: all at hand)")
  return parser


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


def devices_for(count: int | None, argv_given: bool) -> tuple[list, bool]:
  """The first `count` devices at hand (all when None) and whether they are simulated: when
  there are fewer, the command runs itself again in a fresh process with `count` simulated CPU
  devices (only possible before JAX starts, so not when called from Python: `argv_given`)."""
  import jax
  if count is not None and count < 1:
    raise ConfigError(f"--devices {count}: give a positive number of devices")
  devices = jax.devices()
  simulated = os.environ.get("JMOE_SIMULATED_DEVICES") == str(count)
  if count and count > len(devices):
    if simulated or argv_given:
      raise ConfigError(f"--devices {count}: this process has {len(devices)} devices and "
                        "cannot simulate more once JAX has started")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JMOE_SIMULATED_DEVICES"] = str(count)
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, *sys.argv])
  return (devices[:count] if count else devices), simulated
