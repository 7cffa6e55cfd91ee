"""python -m jmoe.train --config configs/NAME.py --workdir DIR [--config.group.key=value ...]"""

from __future__ import annotations

import argparse
import sys

from jmoe.cli import number, run, split_overrides
from jmoe.config import load_config
from jmoe.train.loop import train


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jmoe.train", description=__doc__)
  parser.add_argument("--config", required=True, help="a configs/*.py file with get_config()")
  parser.add_argument("--workdir", required=True,
                      help="where metrics, TensorBoard events and checkpoints go; an existing "
                           "workdir resumes from its latest checkpoint")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  group = parser.add_argument_group(
      "several processes (one per host or GPU): these flags, JMOE_COORDINATOR / "
      "JMOE_NUM_PROCESSES / JMOE_PROCESS_ID, or a SLURM or MPI launcher (jmoe/distributed.py)")
  group.add_argument("--coordinator", help="host:port of process 0")
  group.add_argument("--num-processes", type=number(int, 1))
  group.add_argument("--process-id", type=number(int, 0))

  def command() -> int:
    rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(rest)
    from jmoe.xla_flags import set_gpu_flags
    set_gpu_flags()
    from jmoe.distributed import initialize
    initialize(args.coordinator, args.num_processes, args.process_id)
    records = train(load_config(args.config, overrides), args.workdir,
                    progress=not args.no_progress)
    if records:
      first, last = records[0], records[-1]
      print(f"step {first['step']}: loss {first['loss']:.3f}  ->  step {last['step']}: "
            f"loss {last['loss']:.3f}  ({last['tokens_per_s']:.0f} tokens/s)")
    return 0

  return run(command)


if __name__ == "__main__":
  sys.exit(main())
