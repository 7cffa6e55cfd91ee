"""The XLA flags tests run with (this module imports nothing: conftest sets them before JAX is
imported)."""

# The tests' programs are tiny, and LLVM's optimization of the CPU code they compile to is most
# of their compile time (8.2 -> 2.7 s for a train state's init; 289 -> 161 s for four of the
# slowest tests): the tests check what jmoe computes, not how fast XLA's CPU code runs.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a test's command: the tests' flags, and `devices` simulated CPU devices."""
  count = "" if devices is None else f" --xla_force_host_platform_device_count={devices}"
  return TEST_XLA_FLAGS + count
