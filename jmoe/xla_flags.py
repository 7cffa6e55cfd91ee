"""XLA flags jmoe sets for NVIDIA GPUs, before JAX starts its GPU backend.

  --xla_gpu_enable_latency_hiding_scheduler=true   schedule collectives (FSDP gathers, expert
      all-to-alls, gradient reductions) to overlap with compute instead of in program order

A flag already present in XLA_FLAGS keeps the user's value; set JMOE_XLA_FLAGS=0 to add none.
docs/PERFORMANCE.md records what each changed when measured.
"""

from __future__ import annotations

import importlib.util
import logging
import os

GPU_FLAGS = {"--xla_gpu_enable_latency_hiding_scheduler": "true"}
log = logging.getLogger("jmoe")


def set_gpu_flags() -> None:
  """Adds GPU_FLAGS to XLA_FLAGS when a CUDA build of JAX is installed (call before any JAX
  device use)."""
  if os.environ.get("JMOE_XLA_FLAGS") == "0":
    return
  if not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
    return
  current = os.environ.get("XLA_FLAGS", "")
  added = [f"{name}={value}" for name, value in GPU_FLAGS.items() if name not in current]
  if added:
    os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
