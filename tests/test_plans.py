"""configs/plans/: each published layout loads, validates on its device count, and fits the 141 GB
of an H200 by the memory estimate (traced on simulated devices, never compiled), or is a known
gap that says why and what would make it fit (docs/MEMORY.md, "Published layouts")."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from flags import command_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLANS = sorted(p.name for p in (ROOT / "configs" / "plans").glob("*.py"))
H200_BYTES = 141e9
# Strict: a plan listed here fails the day it fits, to move it back.
DOES_NOT_FIT: dict[str, str] = {}
# One process of as many simulated devices as the largest plan: each plan takes the first of them.
ESTIMATE_ALL = """
import json, runpy, sys
import jax
from jmoe.config import load_config
from jmoe.memory import estimate
from jmoe.parallel import make_layout
for path in sys.argv[1:]:
  devices = runpy.run_path(path)["DEVICES"]
  config = load_config(path)
  result = estimate(config, make_layout(config.parallel, jax.devices()[:devices]), platform="gpu")
  print(json.dumps({"plan": path.rsplit("/", 1)[-1], "devices": devices, "total": result.total,
                    "by_category": result.by_category}))
"""


@pytest.fixture(scope="module")
def estimates() -> dict[str, dict]:
  paths = [str(ROOT / "configs" / "plans" / name) for name in PLANS]
  most = max(_devices(name) for name in PLANS)
  done = subprocess.run([sys.executable, "-c", ESTIMATE_ALL, *paths], capture_output=True,
                        text=True, cwd=ROOT, env=command_env(most, PYTHONPATH=str(ROOT)),
                        timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
  return {r["plan"]: r for r in records}


def _devices(name: str) -> int:
  text = (ROOT / "configs" / "plans" / name).read_text()
  return int(text.split("\nDEVICES = ", 1)[1].split("\n", 1)[0])


def test_every_plan_loads_and_is_estimated(estimates):
  # the six published rows, each on its own device count, its state split over all of them
  assert set(estimates) == set(PLANS) and len(PLANS) >= 6
  for record in estimates.values():
    assert record["by_category"]["parameters"] > 0 and record["devices"] >= 8


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=DOES_NOT_FIT[name]))
    if name in DOES_NOT_FIT else name for name in PLANS])
def test_plan_fits_an_h200(name, estimates):
  record = estimates[name]
  print(f"{name}: {record['total'] / 2**30:.1f} GiB per GPU on {record['devices']}")
  assert record["total"] <= H200_BYTES


def test_estimate_script_reports_the_pipeline_idle_shares(capsys):
  # 3 MoE layers in 2 stages (2 + 1: every stage runs 2 slots, one of the 4 masked), 4
  # micro-batches: 5 iterations of the schedule, 1 of them idle on each stage.
  import runpy
  from helpers import tiny_config
  from jmoe.parallel import make_layout
  cfg = tiny_config(model=dict(num_layers=4), parallel=dict(pipeline=2, dense=dict(data=4)),
                    train=dict(batch_size=16, micro_batch_size=4))
  assert cfg.model.num_layers - cfg.moe.first_k_dense == 3
  shares = runpy.run_path(str(ROOT / "scripts" / "estimate_memory.py"))["pipeline"](
      cfg, make_layout(cfg.parallel))
  assert shares == {"bubble": 0.2, "masked_slots": 0.25}
  assert "idle 40.0%; MoE layers per stage: 2, 1" in capsys.readouterr().out
