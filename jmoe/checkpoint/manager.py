"""Saves and restores the train state under `<workdir>/checkpoints` with Orbax.

Restoring takes the target shardings from the current run, so the saved arrays land directly in
this run's placement.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:

  def __init__(self, directory: pathlib.Path, keep: int):
    self.directory = directory.absolute()
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any) -> None:
    self._manager.save(step, args=ocp.args.StandardSave(state), force=True)

  def restore(self, step: int, abstract_state: Any, shardings: Any) -> Any:
    target = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract_state, shardings)
    return self._manager.restore(step, args=ocp.args.StandardRestore(target))

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()
