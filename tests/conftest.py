"""Tests run on CPU with 8 simulated devices; the flag must be set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests (and the commands they start) compile the same programs: XLA's persistent cache
# compiles each once per test session. Cached executables are keyed by program and flags.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402  (after the flag)

jax.config.update("jax_default_matmul_precision", "highest")
