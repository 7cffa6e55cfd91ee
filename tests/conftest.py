"""Tests run on CPU with 8 simulated devices; the flag must be set before jax is imported."""

import os

from flags import xla_flags

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags(8)}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent compilation cache: on the CPU build (jax 0.11.2) a train step read back from it
# can hang in a collective (one simulated device at another op than the rest, until XLA aborts):
# seen on steps whose metrics include the all-to-all dispatch's overflow rounds. Every test
# compiles its own programs.
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"

import jax  # noqa: E402  (after the flag)

jax.config.update("jax_default_matmul_precision", "highest")
