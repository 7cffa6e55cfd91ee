"""Reading training checkpoints (`Checkpointer`, jmoe/checkpoint/manager.py, is a
`CheckpointReader` that also saves).

Restoring takes the target shardings from the current run, so the saved arrays land directly in
this run's placement whatever layout or device count wrote them. A latest checkpoint that cannot
be read (a truncated or damaged file) is passed over for the previous one; `set_aside_unreadable`
then moves it to `<workdir>/corrupt_checkpoints/`, once the run has found everything else in
order.
"""

from __future__ import annotations

import logging
import pathlib
import shutil
import time
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jmoe.checkpoint.disk import require_complete
from jmoe.checkpoint.target import describe_mismatch, with_shardings
from jmoe.config import ConfigError

log = logging.getLogger("jmoe")


class CheckpointReader:
  """The reading side of a checkpoint directory: `directory` and `_manager` (an Orbax
  CheckpointManager over it with the items `state`, `data` and `run`) are set by the subclass."""

  directory: pathlib.Path
  _manager: ocp.CheckpointManager
  unreadable: list[int]  # the steps restore_latest passed over

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def run_record(self, step: int) -> dict[str, Any] | None:
    """What the checkpoint of `step` recorded for a resume to check (`save`'s `run`), or None
    when it recorded nothing."""
    if not (self.directory / str(step) / "run").is_dir():
      return None
    return dict(self._manager.restore(step, args=ocp.args.Composite(
        run=ocp.args.JsonRestore())).run or {})

  def restore(self, step: int, abstract_state: Any, shardings: Any
              ) -> tuple[Any, dict[str, Any]]:
    """The train state of `step`, placed by `shardings`, and its data position."""
    require_complete(self.directory / str(step) / "state")
    self._check_matches(step, abstract_state)
    target = with_shardings(abstract_state, shardings)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.
                                     construct_restore_args(target)),
        data=ocp.args.JsonRestore()))
    return restored.state, dict(restored.data or {})

  @property
  def aside(self) -> pathlib.Path:
    """Where unreadable checkpoints are moved."""
    return self.directory.parent / "corrupt_checkpoints"

  def restore_latest(self, abstract_state: Any, shardings: Any,
                     check: Callable[[int], None] | None = None
                     ) -> tuple[int, Any, dict[str, Any]] | None:
    """The newest readable checkpoint as (step, state, data position), or None when the
    workdir never had one. Unreadable ones are reported and passed over (listed in
    `unreadable`; nothing is moved here); a checkpoint of another model (different shapes, or
    one that `check(step)`, run before its arrays are read, refuses with a ConfigError) is an
    error, since no older one would fit either. When none can be read (now, or when an earlier
    run moved them aside) that is an error too: a run never starts over silently where one had
    progress."""
    steps = self.all_steps()
    self.unreadable = []
    for step in reversed(steps):
      try:
        if check is not None:
          check(step)
        state, data = self.restore(step, abstract_state, shardings)
      except ConfigError:
        raise
      except Exception as e:  # noqa: BLE001 - any read failure means this step is damaged
        log.warning("checkpoint %s cannot be read (%s: %s); trying the one before it",
                    self.directory / str(step), type(e).__name__,
                    str(e).splitlines()[0][:300] if str(e) else "")
        self.unreadable.append(step)
        continue
      return step, state, data
    moved = sorted(p.name for p in self.aside.iterdir()) if self.aside.is_dir() else []
    if steps or moved:
      found = f" (steps {steps})" if steps else ""
      if moved:
        found += f"; the unreadable ones of earlier runs are in {self.aside} ({', '.join(moved)})"
      delete = " and ".join(str(p) for p, has in ((self.directory, steps), (self.aside, moved))
                            if has)
      raise ConfigError(
          f"no checkpoint in {self.directory} can be read{found}. To start this workdir over "
          f"from step 0, delete {delete} (and {self.directory.parent / 'metrics.jsonl'} if its "
          f"history should go too), or give another --workdir")
    return None

  def _check_matches(self, step: int, abstract_state: Any) -> None:
    try:
      saved = self._manager.item_metadata(step).state
    except Exception:  # noqa: BLE001 - unreadable metadata: left to restore to report
      return
    if saved is None:
      return
    problem = describe_mismatch(saved, abstract_state)
    if problem:
      raise ConfigError(
          f"the checkpoint {self.directory / str(step)} was saved by a different model or "
          f"optimizer: {problem}. Resume with the config it was saved with (its workdir's "
          f"config.json), or start in a new --workdir; to start from its parameters only, use "
          f"--config.checkpoint.load_params")

  def set_aside_unreadable(self) -> None:
    """Moves the checkpoints `restore_latest` passed over to `aside` (kept for inspection): a
    run that goes on must not have them among its steps."""
    for step in self.unreadable:
      aside = self.aside / f"{step}-{int(time.time())}"
      log.warning("moving the unreadable checkpoint %s to %s", self.directory / str(step), aside)
      if jax.process_index() == 0:
        aside.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(self.directory / str(step)), str(aside))
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"jmoe_set_aside_{step}")
    if self.unreadable:
      self._manager.reload()
    self.unreadable = []
