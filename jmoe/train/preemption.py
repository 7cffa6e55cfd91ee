"""Stopping cleanly on SIGTERM (preemption, `scancel`, a pod's eviction) or SIGINT (Ctrl-C).

The training loop asks `stop_requested(step)` after each step; when it says yes, the loop saves a
checkpoint of that step and raises `Interrupted`. A second SIGINT while that save runs stops the
program at once.

With several processes every one of them must stop at the same step, or the save would hang. Then
JAX's preemption sync point decides: the coordination service notices the SIGTERM on any process and
all processes agree on the step to stop at.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

import jax
from jax.experimental import multihost_utils

log = logging.getLogger("jmoe")


class StopSignals:
  """Records SIGTERM/SIGINT instead of dying, while installed (see `installed`)."""

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, object] = {}

  def _handle(self, signum, frame):
    del frame
    if self.signum is None:
      log.warning("received %s: stopping after this step with a checkpoint",
                  signal.Signals(signum).name)
      self.signum = signum
      signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))
    else:
      raise KeyboardInterrupt

  @contextlib.contextmanager
  def installed(self):
    # Handlers can only be set from the main thread; elsewhere the default behaviour stays. With
    # several processes JAX's coordination service handles SIGTERM, and Ctrl-C stops at once.
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = {name: signal.signal(name, self._handle)
                        for name in (signal.SIGTERM, signal.SIGINT)}
    try:
      yield self
    finally:
      for name, handler in self._previous.items():
        signal.signal(name, handler)
      self._previous = {}

  def stop_requested(self, step: int) -> bool:
    if jax.process_count() > 1:
      try:
        if multihost_utils.reached_preemption_sync_point(step):
          self.signum = self.signum or signal.SIGTERM
          return True
      except RuntimeError:  # the preemption service is off
        pass
      return False
    return self.signum is not None
