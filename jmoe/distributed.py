"""Joining the processes of a multi-process run: one process per host (or per GPU), each running
the same command or notebook, together one SPMD program over every device.

`initialize()` joins them, once, from the first of these that applies:
  1. explicit arguments (`python -m jmoe.train --coordinator H:P --num-processes N --process-id I`);
  2. JMOE_COORDINATOR, JMOE_NUM_PROCESSES, JMOE_PROCESS_ID in the environment (any launcher:
     scripts/launch_slurm.sh's fallback, the Kubernetes JobSet in docs/MULTIHOST.md);
  3. a launcher JAX recognises by itself with more than one task: SLURM (`srun`), Open MPI
     (`mpirun`), and the others `jax.distributed.initialize()` detects.
Otherwise the run is a single process and nothing happens. Processes other than the first log only
warnings; the first writes metrics, TensorBoard events and the progress bar.
"""

from __future__ import annotations

import logging
import os

import jax

from jmoe.config import ConfigError

log = logging.getLogger("jmoe")

# Environment variables by which launchers JAX detects say how many tasks there are.
_LAUNCHER_SIZES = {"SLURM_NTASKS": "SLURM", "OMPI_COMM_WORLD_SIZE": "Open MPI"}


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
  """Joins the run's other processes if there are any; True when this is a multi-process run."""
  if jax.distributed.is_initialized():
    return True
  env = os.environ
  explicit = (coordinator, num_processes, process_id)
  if any(v is not None for v in explicit):
    how = "the command line"
  elif any(k in env for k in ("JMOE_COORDINATOR", "JMOE_NUM_PROCESSES", "JMOE_PROCESS_ID")):
    how = "JMOE_* environment variables"
    try:
      explicit = (env.get("JMOE_COORDINATOR"), int(env.get("JMOE_NUM_PROCESSES", "")),
                  int(env.get("JMOE_PROCESS_ID", "")))
    except ValueError:
      raise ConfigError("JMOE_NUM_PROCESSES and JMOE_PROCESS_ID must be integers (and "
                        "JMOE_COORDINATOR host:port), all three set")
  else:
    launcher = next((name for key, name in _LAUNCHER_SIZES.items()
                     if int(env.get(key, "1") or "1") > 1), None)
    if launcher is None:
      return False
    log.info("joining the other processes of this %s job", launcher)
    jax.distributed.initialize()
    _quiet_other_processes()
    return True
  if any(v is None for v in explicit):
    raise ConfigError(f"a multi-process run from {how} needs the coordinator address, the "
                      f"number of processes and this process's id; got {explicit}")
  jax.distributed.initialize(*explicit)
  _quiet_other_processes()
  return True


def _quiet_other_processes() -> None:
  log.info("process %d of %d, %d local of %d devices", jax.process_index(), jax.process_count(),
           jax.local_device_count(), jax.device_count())
  if jax.process_index() != 0:
    log.setLevel(logging.WARNING)
