"""The XLA flags tests run with (this module imports no JAX: conftest sets them before JAX is
imported), and the environment of the commands tests start."""

import os

# The tests' programs are tiny, and LLVM's optimization of the CPU code they compile to is most
# of their compile time (8.2 -> 2.7 s for a train state's init; 289 -> 161 s for four of the
# slowest tests): the tests check what jmoe computes, not how fast XLA's CPU code runs.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a test's command: the tests' flags, and `devices` simulated CPU devices."""
  count = "" if devices is None else f" --xla_force_host_platform_device_count={devices}"
  return TEST_XLA_FLAGS + count


def command_env(devices: int | None = None, **more: str) -> dict[str, str]:
  """The environment for a command a test starts: this one's, on the CPU with the tests' XLA
  flags and `devices` simulated devices, and `more`."""
  return dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu", **more)
