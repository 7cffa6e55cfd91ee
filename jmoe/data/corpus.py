"""The built-in corpus: the Python standard library's own source files (code, docstrings and the
pydoc topic texts), which every machine that runs jmoe already has. No download."""

from __future__ import annotations

import pathlib
import sysconfig
from typing import Iterator

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_documents(max_bytes: int) -> Iterator[bytes]:
  """Yields the standard library's .py files in a fixed order, up to about `max_bytes` in total."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  total = 0
  for path in sorted(root.rglob("*.py")):
    if _SKIP_DIRS.intersection(path.relative_to(root).parts):
      continue
    data = path.read_bytes()
    if not data.strip():
      continue
    yield data
    total += len(data)
    if total >= max_bytes:
      return
