"""A save's start in a thread of its own, held back until the training loop has launched a given
number of steps after it (`stepped`), so that the devices have those steps queued while the
transfer to the host holds up the launch of the next ones; or until a time limit, or `join`."""

from __future__ import annotations

import threading
from typing import Callable


class SaveThread:
  """Runs `start` in a thread named `name`: at once (`lead` 0), else once `lead` calls of
  `stepped` have come, `limit_s` has passed or `join` is called, whichever is first. What
  `start` raises is kept for `join` to return."""

  def __init__(self, start: Callable[[], None], *, lead: int, limit_s: float, name: str):
    self._go = threading.Event() if lead else None
    self._lead = lead
    self._launched = 0  # steps launched since the save
    self._error: Exception | None = None
    self._thread = threading.Thread(target=self._run, args=(start, limit_s), name=name,
                                    daemon=True)
    self._thread.start()

  def stepped(self) -> None:
    """Counts a launched step towards `lead`."""
    if self._go is not None:
      self._launched += 1
      if self._launched >= self._lead:
        self._go.set()

  def join(self) -> Exception | None:
    """Lets `start` go if it is still held, waits for it, and returns what it raised, if
    anything."""
    if self._go is not None:
      self._go.set()
    self._thread.join()
    return self._error

  def _run(self, start: Callable[[], None], limit_s: float) -> None:
    try:
      if self._go is not None:
        self._go.wait(limit_s)
      start()
    except Exception as e:  # noqa: BLE001 - returned by `join`
      self._error = e
