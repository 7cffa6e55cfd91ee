"""What an asynchronous save costs the training steps beside it, by how many threads TensorStore
writes with (`checkpoint.write_threads`) and whether it compresses.

  python scripts/save_cost.py [--config configs/bench/qwen3_30b_a3b_1gpu.py] [--dir /dev/shm/x]
      [--variants default,14,7,4,nc-default,nc-7] [--steps 80]

One jmoe.train `Trainer` on the config: 10 steps, `--steps` timed without a save, then for each
variant 10 steps, a save and `--steps` steps, timed while the write runs and after it ends.
Variants: `default` (TensorStore's own pools), a thread count, either with `nc-` (no
compression). Prints a JSON line per variant (the write's seconds, the steps' mean time during
and after it, the training time the save cost, the size on disk), then one with all of them. The
workdir is `--dir` (removed at the end; on tmpfs, the file system's own speed is out of the way).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class WriteTimes(logging.Handler):
  """The end of each save (Orbax logs its whole time), by the checkpoint directory's name."""

  def __init__(self):
    super().__init__()
    self.ends: dict[str, float] = {}

  def emit(self, record):
    found = re.search(r"Finished save \(blocking \+ background\) in ([0-9.]+) seconds @ .*/"
                      r"(v_[^/]+)/", record.getMessage())
    if found:
      self.ends[found.group(2)] = float(found.group(1))


def mean_step_ms(starts: list[float], a: float, b: float) -> tuple[int, float | None]:
  """(steps launched in [a, b), their mean interval in ms)."""
  inside = [t for t in starts if a <= t < b]
  if len(inside) < 3:
    return len(inside), None
  return len(inside), round((inside[-1] - inside[0]) / (len(inside) - 1) * 1e3, 2)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/bench/qwen3_30b_a3b_1gpu.py")
  parser.add_argument("--dir", type=pathlib.Path, default=pathlib.Path("/dev/shm/jmoe-save-cost"))
  parser.add_argument("--variants", default="default,14,7,4,nc-default,nc-7")
  parser.add_argument("--steps", type=int, default=80)
  args, overrides = parser.parse_known_args(argv)
  if args.dir.exists():
    parser.error(f"{args.dir} exists: give a directory that does not (it is removed at the end)")
  variants = args.variants.split(",")
  for v in variants:
    if not re.fullmatch(r"(nc-)?(default|[1-9][0-9]*)", v):
      parser.error(f"--variants: {v!r} is not default, a thread count, or either after nc-")
  from jmoe.xla_flags import set_gpu_flags
  set_gpu_flags()
  import jax
  import orbax.checkpoint as ocp
  from jmoe.checkpoint import manager, writer
  from jmoe.config import load_config
  from jmoe.train.loop import Trainer
  times = WriteTimes()
  absl = logging.getLogger("absl")
  absl.addHandler(times)
  absl.setLevel(logging.INFO)
  absl.propagate = False  # (Orbax's INFO lines only feed `times`)
  config = load_config(ROOT / args.config, [o.removeprefix("--config.") for o in overrides] +
                       ["train.steps=1000000", "checkpoint.every=0", "checkpoint.keep=1"])
  starts: list[float] = []
  results: dict = {"config": args.config, "cores": os.cpu_count(), "orbax": ocp.__version__}
  handler = ocp.PyTreeCheckpointHandler
  try:
    trainer = Trainer(config, args.dir / "work", progress=False)
    step_fn = trainer._step_fn

    def timed(state, batch):
      starts.append(time.perf_counter())
      return step_fn(state, batch)

    trainer._step_fn = timed
    trainer.train(10)
    jax.block_until_ready(trainer.state)
    a = time.perf_counter()
    trainer.train(args.steps)
    jax.block_until_ready(trainer.state)
    results["no_save"] = mean_step_ms(starts, a, time.perf_counter())
    for variant in variants:
      threads = variant.removeprefix("nc-")
      threads = None if threads == "default" else int(threads)
      compress = not variant.startswith("nc-")
      ocp.PyTreeCheckpointHandler = lambda **kw: handler(use_compression=compress, **kw)
      trainer.checkpointer.close()
      # (the Checkpointer registers the writer at each save: this variant's bound for its
      # background writes, None for TensorStore's own)
      trainer.checkpointer = manager.Checkpointer(args.dir / f"v_{variant}", keep=1,
                                                  write_threads=threads)
      trainer._saved = None
      trainer.train(10)
      jax.block_until_ready(trainer.state)
      s0 = time.perf_counter()
      trainer.save()
      s1 = time.perf_counter()
      trainer.train(args.steps)
      jax.block_until_ready(trainer.state)
      trainer.checkpointer.wait()
      seconds = times.ends.get(f"v_{variant}")
      during = mean_step_ms(starts, s1, s0 + seconds) if seconds else (0, None)
      after = mean_step_ms(starts, s0 + seconds, time.perf_counter()) if seconds else (0, None)
      base = after[1] or results["no_save"][1]
      on_disk = sum(p.stat().st_size for p in (args.dir / f"v_{variant}").rglob("*")
                    if p.is_file())
      results[variant] = {
          "write_threads": writer.write_threads(threads), "compressed": compress,
          "write_s": seconds, "save_call_s": round(s1 - s0, 3),
          "steps_during": during[0], "step_ms_during": during[1], "step_ms_after": after[1],
          "lost_s": round((during[1] - base) * during[0] / 1e3, 2) if during[1] and base else None,
          "on_disk_gib": round(on_disk / 2**30, 2)}
      print(json.dumps({"variant": variant, **results[variant]}), flush=True)
      shutil.rmtree(args.dir / f"v_{variant}", ignore_errors=True)
    trainer.close()
  finally:
    ocp.PyTreeCheckpointHandler = handler
    shutil.rmtree(args.dir, ignore_errors=True)
  print(json.dumps(results), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
