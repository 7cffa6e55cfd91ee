"""The GPUs' SM clock, power draw and throttle reasons while a block of work runs, from
`nvidia-smi` (scripts/benchmark.py records them beside each timing)."""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import time


class GpuClocks:
  """The GPUs' SM clock, power draw and throttle reasons, sampled by `nvidia-smi` every 200 ms
  while a block runs (nothing where there is none). A step's time follows the clock, and under
  load an H200 runs at its power cap, its clock lower the more power the values multiplied draw
  (a trained state's more than the initial one's: docs/PERFORMANCE.md), so each timing is
  recorded with the clock it ran at."""
  QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"
  POWER_CAP = 0x4  # nvidia-smi's "SW power cap" throttle reason

  def __enter__(self) -> "GpuClocks":
    self._samples = ""
    self._process = None if shutil.which("nvidia-smi") is None else subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
         "-lms", "200"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return self

  def __exit__(self, *exc) -> None:
    if self._process is not None:
      self._process.terminate()
      self._samples = self._process.communicate()[0]

  @property
  def samples(self) -> str:
    """nvidia-smi's lines, for `clock_figures` over several blocks together."""
    return self._samples

  def figures(self) -> dict:
    return clock_figures(self._samples)


def clock_figures(samples: str) -> dict:
  """From `nvidia-smi`'s lines "MHz, W, reasons" (all GPUs, every sample): the mean SM clock and
  power draw, and the share of samples held at the power cap; {} without samples."""
  rows = []
  for line in samples.splitlines():
    parts = [p.strip() for p in line.split(",")]
    try:
      rows.append((float(parts[0]), float(parts[1]), int(parts[2], 16)))
    except (ValueError, IndexError):  # "[N/A]", a line cut by the termination
      continue
  if not rows:
    return {}
  return {"gpu_sm_clock_mhz": round(sum(r[0] for r in rows) / len(rows)),
          "gpu_power_w": round(sum(r[1] for r in rows) / len(rows), 1),
          "gpu_power_capped": round(sum(bool(r[2] & GpuClocks.POWER_CAP) for r in rows)
                                    / len(rows), 2)}


def settle(step, sync, seconds: float) -> dict:
  """Runs `step()` untimed, `sync()` after each, until `seconds` of them have passed: a few
  steps after a pause run at a clock the GPU holds only until its power and heat catch up (an
  H200 on Qwen3-30B-A3B's bench, 2026-12-07: 1,838 MHz over 5 steps after 2, 1,675 MHz over
  the 600 steps of a run), so timed steps after these are the speed a long run keeps.
  Returns `settle_s` (the seconds they took, 0 when `seconds` is 0) and `settle_steps`."""
  steps, t0 = 0, time.perf_counter()
  while seconds > 0 and time.perf_counter() - t0 < seconds:
    step()
    sync()
    steps += 1
  return {"settle_s": round(time.perf_counter() - t0, 1) if steps else 0.0,
          "settle_steps": steps}


def add_settle_flag(parser: argparse.ArgumentParser,
                    help: str = "untimed steps for SECONDS after the warm-up") -> None:
  """`--settle SECONDS` (default 0) on a timing script's `parser`, checked by `settle_seconds`."""
  parser.add_argument("--settle", type=settle_seconds, default=0.0, metavar="SECONDS", help=help)


def settle_seconds(text: str) -> float:
  """`--settle`'s value (argparse's `type`): seconds, 0 or more."""
  try:
    seconds = float(text)
  except ValueError:
    seconds = math.nan
  if not 0 <= seconds < math.inf:
    raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds, 0 or more")
  return seconds
