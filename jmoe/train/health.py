"""Steps that go wrong: a loss or gradient norm that is not finite.

The train step never applies such a step's update (jmoe/train/step.py) and reports it in its
`skipped` metric. `StepHealth` reads those flags from the device a batch at a time (at log steps
and before saves), so training never waits on the host for them, and stops the run when
`train.max_bad_steps` come in a row. Parameters are checked before every save: a checkpoint of
non-finite parameters is never written.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jmoe.checkpoint.snapshot import compiled_for
from jmoe.errors import Diverged

log = logging.getLogger("jmoe")


def _all_finite(arrays: list) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in arrays]))


def finite_flag(tree) -> jax.Array:
  """Whether every array of `tree` is finite, as a device scalar (queued, not waited for); its
  program compiled once per kind of tree (`compile_finite_check` compiles it beforehand)."""
  arrays = jax.tree.leaves(tree)
  return compiled_for(_all_finite, arrays)(arrays)


def compile_finite_check(tree) -> None:
  """Compiles `finite_flag` for trees like `tree` (arrays or ShapeDtypeStructs with their
  shardings), so that the first save's check compiles nothing on the time of the step it
  saves."""
  compiled_for(_all_finite, jax.tree.leaves(tree))


class StepHealth:

  def __init__(self, max_bad_steps: int, lr: float):
    self.max_bad_steps, self.lr = max_bad_steps, lr
    self._pending: list[tuple[int, jax.Array]] = []
    self.in_a_row, self.total, self._first = 0, 0, None

  def add(self, step: int, skipped: jax.Array) -> None:
    self._pending.append((step, skipped))

  def check(self) -> None:
    """Reads the flags of the steps since the last check; raises `Diverged` at the limit."""
    flags = jax.device_get([flag for _, flag in self._pending])
    steps = [step for step, _ in self._pending]
    self._pending = []
    for step, skipped in zip(steps, flags):
      if not skipped:
        self.in_a_row, self._first = 0, None
        continue
      self.in_a_row, self.total = self.in_a_row + 1, self.total + 1
      self._first = self._first or step
      log.warning("step %d: the loss or gradient norm is not finite; its update was not applied "
                  "(%d such step(s) in a row, %d in all)", step, self.in_a_row, self.total)
      if self.in_a_row >= self.max_bad_steps:
        raise Diverged(
            f"the loss or gradient norm was not finite at {self.in_a_row} steps in a row "
            f"(steps {self._first}-{step}); none of their updates was applied, and nothing "
            f"non-finite was saved. Try a lower train.lr (now "
            f"{self.lr:g}) or train.grad_clip, precision.compute=float32, or look at the data "
            f"those steps read; train.max_bad_steps ({self.max_bad_steps}) is how many such "
            f"steps in a row a run goes on through")
