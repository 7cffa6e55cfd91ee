"""Training loss of one config under several settings, each trained from the same start on the
standard-library corpus: the held-out loss at the last step, the mean logged loss over the last
half, and the tokens/s at the end. Made for FP8 against bf16 (docs/FP8.md), usable for any
setting that should not change the loss.

  python scripts/loss_compare.py --config configs/bench/mixtral_8x7b_1gpu.py --steps 200 \\
      --variant bf16= \\
      --variant fp8_experts=precision.gemm=fp8,precision.fp8_experts=true,precision.fp8_dense=false

A variant is NAME=OVERRIDES (comma-separated dotted settings, none for the config as it is); the
first is the reference the others are compared to. Each runs in a process of its own (so every
run has the device to itself) through `jmoe.Trainer` with no checkpoint written, in a workdir
that is removed after it. `--set` applies to every variant. Prints one JSON line per run, with
`vs_first` the held-out loss's ratio to the first variant's (of the same seed). `--seeds N` runs
every variant with train.seed 0 .. N-1 (seed by seed, so a cut-short call still holds pairs),
then one summary line per variant (mean, lowest and highest held-out loss, the mean's ratio to
the first variant's): how far two runs of one setting differ is what a difference between
settings is read against. A run that fails prints a `failed` line (its error on stderr), the
others go on, and the script exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmark import append_record, commit  # noqa: E402 - beside this file


def variant(text: str) -> tuple[str, list[str]]:
  name, sep, overrides = text.partition("=")
  if not sep or not name:
    raise argparse.ArgumentTypeError(f"--variant {text!r}: write NAME=OVERRIDES (NAME= for none)")
  return name, [o for o in overrides.split(",") if o]


def fixed(steps: int) -> list[str]:
  """The settings every variant shares: the corpus, one evaluation at the end, no saves."""
  return ["data.source=stdlib", f"train.steps={steps}", f"train.eval_every={steps}",
          "data.eval_fraction=0.02", "data.eval_batches=8", "train.log_every=10",
          "checkpoint.every=0"]


def train_one(config_path: str, overrides: list[str]) -> dict:
  """Trains in this process and returns the figures (the child's work)."""
  import jax

  import jmoe
  config = jmoe.load_config(config_path, overrides)
  steps = config.train.steps
  with tempfile.TemporaryDirectory(prefix="loss_compare_") as workdir:
    with jmoe.Trainer(config, workdir, progress=False) as trainer:
      records = trainer.train(steps)
  losses = [r["loss"] for r in records if r["step"] > steps // 2 and "loss" in r]
  last = records[-1]
  return {"device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(),
          "steps": steps,
          "eval_loss": last["eval_loss"],
          "mean_loss_second_half": float(np.mean(losses)) if losses else None,
          "max_loss": max(r["loss"] for r in records if "loss" in r),
          "tokens_per_s_end": records[-2]["tokens_per_s"] if len(records) > 1 else None}


def run_one(args, name: str, overrides: list[str], seed: int) -> dict | None:
  """One variant trained in a process of its own; None (reported, its error on stderr) if it
  failed."""
  settings = fixed(args.steps) + overrides
  command = [sys.executable, __file__, "--config", args.config, "--child",
             "--variant", name + "=" + ",".join(settings)]
  done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
  lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
  if done.returncode or not lines:
    print(json.dumps({"variant": name, "seed": seed, "failed": True,
                      "returncode": done.returncode}), flush=True)
    return None
  return {"variant": name, "seed": seed, "config": args.config, "overrides": overrides,
          **json.loads(lines[-1][len("RESULT "):])}


def emit(args, result: dict) -> None:
  print(json.dumps(result), flush=True)
  if args.record:  # as docs/perf/records.jsonl keeps them
    append_record(args.record, {"date": datetime.date.today().isoformat(),
                                "jmoe_commit": commit(), "kind": f"loss_{args.steps}_steps",
                                "devices": result.get("devices"), **result})


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--variant", type=variant, action="append", required=True)
  parser.add_argument("--set", action="append", default=[], help="a setting for every variant")
  parser.add_argument("--seeds", type=int, default=1,
                      help="run every variant with train.seed 0 .. N-1 (N > 1), then a summary "
                           "line per variant: how far runs of one setting differ")
  parser.add_argument("--record", type=pathlib.Path, help="append each result as a JSON line")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    name, overrides = args.variant[0]
    print("RESULT " + json.dumps(train_one(args.config, overrides)), flush=True)
    return 0
  names = [name for name, _ in args.variant]
  if len(set(names)) != len(names):
    parser.error(f"--variant names repeat ({', '.join(names)}): give each its own")
  if args.seeds < 1:
    parser.error(f"--seeds {args.seeds}: give 1 or more")
  if args.record:  # refused before any run trains for nothing
    from jmoe.errors import ConfigError
    from jmoe.outputs import writable
    try:
      writable(args.record, directory=False, flag="--record")
    except ConfigError as e:
      parser.error(str(e))
  losses: dict[str, dict[int, float]] = {name: {} for name in names}  # per variant, per seed
  failed = 0
  for seed in range(args.seeds):
    for name, overrides in args.variant:
      seeded = [f"train.seed={seed}"] if args.seeds > 1 else []
      result = run_one(args, name, seeded + args.set + overrides, seed)
      if result is None:
        failed += 1
        continue
      reference = losses[names[0]].get(seed)
      result["vs_first"] = result["eval_loss"] / reference if reference else None
      losses[name][seed] = result["eval_loss"]
      emit(args, result)
  if args.seeds > 1:
    for name, by_seed in losses.items():
      if not by_seed:
        continue
      values = list(by_seed.values())
      # the ratio over the seeds both this variant and the first finished
      paired = [s for s in by_seed if s in losses[names[0]]]
      emit(args, {"variant": name, "summary": True, "runs": len(values),
                  "mean_eval_loss": float(np.mean(values)),
                  "min_eval_loss": min(values), "max_eval_loss": max(values),
                  "vs_first_mean": float(np.mean([by_seed[s] for s in paired])
                                         / np.mean([losses[names[0]][s] for s in paired]))
                  if paired else None})
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
