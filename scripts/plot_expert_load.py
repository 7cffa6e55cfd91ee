"""Draws a run's expert load and loss curves from its workdir.

  python scripts/plot_expert_load.py --workdir DIR [--out FILE.png] [--overwrite] [--step N]

One PNG with three panels: a layer x expert heatmap of the load at one logged step (the last by
default), as a multiple of the balanced share (1.0 everywhere is perfect balance); the busiest
expert's load over the steps; and the loss curves. The PNG appears once drawn, and replaces a
file already there only with --overwrite. Needs matplotlib (`pip install -e ".[plot]"`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def read_metrics(workdir: pathlib.Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  if not path.is_file():
    raise SystemExit(f"error: {path} does not exist; pass the --workdir of a jmoe.train run")
  records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  if not records:
    raise SystemExit(f"error: {path} is empty; the run has not logged a step yet")
  return records


def plot(records: list[dict], out: pathlib.Path, step: int | None = None) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  by_step = {r["step"]: r for r in records}
  if step is not None and step not in by_step:
    raise SystemExit(f"error: step {step} was not logged; logged steps: {sorted(by_step)}")
  record = by_step[step if step is not None else records[-1]["step"]]
  load_LE = np.asarray(record["expert_load"]) * np.asarray(record["expert_load"]).shape[-1]
  steps = [r["step"] for r in records]

  fig, (ax_map, ax_imb, ax_loss) = plt.subplots(1, 3, figsize=(16, 4.5))
  image = ax_map.imshow(load_LE, cmap="viridis", aspect="auto", vmin=0)
  ax_map.set(title=f"expert load at step {record['step']} (1.0 = balanced)", xlabel="expert",
             ylabel="MoE layer", xticks=range(load_LE.shape[1]), yticks=range(load_LE.shape[0]))
  fig.colorbar(image, ax=ax_map)
  ax_imb.plot(steps, [r["expert_load_max_over_mean"] for r in records])
  ax_imb.axhline(1.0, color="gray", linestyle=":")
  ax_imb.set(title="busiest expert / balanced share (worst layer)", xlabel="step")
  for key in ("loss", "lm_loss"):
    ax_loss.plot(steps, [r[key] for r in records], label=key)
  ax_loss.set(title="loss", xlabel="step")
  ax_loss.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=100, format="png")
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  from jmoe.cli import run
  from jmoe.outputs import check, written
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, type=pathlib.Path)
  parser.add_argument("--out", help="default: WORKDIR/expert_load.png")
  parser.add_argument("--overwrite", action="store_true", help="replace the file at --out")
  parser.add_argument("--step", type=int, help="the logged step for the heatmap; default: the last")
  args = parser.parse_args(argv)

  def command() -> int:
    records = read_metrics(args.workdir)
    out = check(args.workdir / "expert_load.png" if args.out is None else args.out,
                directory=False, overwrite=args.overwrite,
                inputs={"--workdir": args.workdir / "metrics.jsonl"})
    with written(out) as tmp:
      plot(records, tmp, args.step)
    print(out.path)
    return 0

  return run(command)


if __name__ == "__main__":
  sys.exit(main())
