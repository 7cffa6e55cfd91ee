"""Where metrics go: `<workdir>/metrics.jsonl`, TensorBoard events, and the terminal."""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

import numpy as np
import tqdm.auto as tqdm
from tensorboardX import SummaryWriter

from jmoe.train.workdir import write_atomic

log = logging.getLogger("jmoe")


def summarize(raw: dict[str, Any], step: int) -> dict[str, Any]:
  """Device metrics (already fetched to host) -> one JSON-ready record."""
  record: dict[str, Any] = {"step": step}
  for name, value in raw.items():
    value = np.asarray(value)
    record[name] = value.tolist() if value.ndim else float(value)
  load_LE = np.asarray(raw["expert_load"])
  if load_LE.size:  # a dense model has no expert load
    # Busiest expert's share over the balanced share, per layer; 1.0 is perfect balance.
    imbalance_L = load_LE.max(axis=-1) * load_LE.shape[-1]
    record["expert_load_max_over_mean"] = float(imbalance_L.max())
  if "attention_max_logit" in raw:  # (with train.qk_clip) each layer's; and the largest
    record["attention_max_logit_max"] = float(np.max(raw["attention_max_logit"]))
  return record


class MetricsWriter:

  def __init__(self, workdir: pathlib.Path, total_steps: int, start_step: int = 0,
               progress: bool = True, write: bool = True):
    """With `write=False` (processes other than the first) nothing is written or shown."""
    self._enabled = write
    self._bar = tqdm.tqdm(total=total_steps, initial=start_step, disable=not progress,
                          dynamic_ncols=True, desc="train")
    self._last_step = start_step
    if write:
      workdir.mkdir(parents=True, exist_ok=True)
      self._jsonl = open(workdir / "metrics.jsonl", "a")
      self._tb = SummaryWriter(str(workdir / "tensorboard"))

  def write(self, record: dict[str, Any]) -> None:
    if not self._enabled:
      return
    step = record["step"]
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    for name, value in record.items():
      if name != "step" and isinstance(value, float):
        self._tb.add_scalar(name, value, step)
    for layer, load_E in enumerate(record.get("expert_load", [])):
      self._tb.add_histogram(f"expert_load/moe_layer_{layer}", np.asarray(load_E), step,
                             bins=len(load_E))
    self._bar.update(step - self._last_step)
    self._last_step = step
    self._bar.set_postfix(loss=f"{record['loss']:.3f}", aux=f"{record['aux_loss']:.4f}",
                          tok_s=f"{record.get('tokens_per_s', 0):.0f}")

  def close(self) -> None:
    self._bar.close()
    if self._enabled:
      self._tb.close()
      self._jsonl.close()


def drop_metrics_after(path: pathlib.Path, step: int) -> None:
  """Forgets logged steps after `step` (a run resumed from an earlier checkpoint logs them
  again), and a line a crash cut short."""
  if not path.exists():
    return
  lines = path.read_text().splitlines(keepends=True)
  kept = []
  for number, line in enumerate(lines, 1):
    try:
      record = json.loads(line)
    except ValueError:
      log.warning("%s:%d is not a whole record (a run stopped while writing it); dropping it",
                  path, number)
      continue
    if record["step"] <= step:
      kept.append(line if line.endswith("\n") else line + "\n")
  if kept != lines:
    write_atomic(path, "".join(kept))
