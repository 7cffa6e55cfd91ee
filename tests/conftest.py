"""Tests run on CPU with 8 simulated devices; the flag must be set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the flag)

jax.config.update("jax_default_matmul_precision", "highest")
