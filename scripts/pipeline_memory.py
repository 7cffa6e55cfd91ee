"""Each pipeline schedule's memory and hand-off at several micro-batch counts, from XLA's compiled
train step.

  python scripts/pipeline_memory.py --config configs/NAME.py [--devices N]
      [--micro-batches 4,8,16] [--schedules gpipe,1f1b] [--traffic] [--config.group.key=value ...]

For every schedule (`parallel.pipeline_schedule`) and number of micro-batches M (the global batch
cut into that many; with `--micro-batch-size N`, M micro-batches of N sequences), compiles the config's train step on
its layout (on N simulated CPU devices when this machine has fewer; nothing runs) and prints XLA's
per-device bytes (`memory_analysis`: the arguments, i.e. the state and batch, and the temporaries,
which hold the activations, gradients and the optimizer's update), the bubble and the
micro-batches a stage keeps in flight; `--traffic` also reads the collective-permute bytes per
device and step out of the compiled program (scripts/comm_volume.py's count). One JSON line per
row.
"""

from __future__ import annotations

import json
import os
import sys

# Run from anywhere: the repository root (this file's parent's parent) is importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
  from jmoe.cli import devices_for, layout_parser, run, split_overrides
  parser = layout_parser(__doc__.split("\n")[0])
  parser.add_argument("--micro-batches", default="4,8,16",
                      help="comma-separated numbers of micro-batches")
  parser.add_argument("--schedules", default="gpipe,1f1b",
                      help="comma-separated parallel.pipeline_schedule values")
  parser.add_argument("--micro-batch-size", type=int, default=0,
                      help="sequences per micro-batch, the global batch growing with the "
                           "micro-batches (default: the config's global batch cut into them)")
  parser.add_argument("--traffic", action="store_true",
                      help="also count the collective-permute bytes (compiles once more)")
  rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(rest)

  def command() -> int:
    from jmoe.config import ConfigError, load_config
    from jmoe.memory.estimate import compiled_step
    from jmoe.memory.traffic import communication
    from jmoe.model.stages import Schedule
    from jmoe.parallel import make_layout
    devices, _ = devices_for(args.devices, argv is not None)
    batch = load_config(args.config, overrides + [  # (micro-batches of one: valid for all)
        "--config.train.micro_batch_size=1", "--config.parallel.pipeline_schedule=gpipe"]
        ).train.batch_size
    print(f"{'schedule':<12}{'M':>4}{'bubble':>8}{'in flight':>10}{'arguments':>11}"
          f"{'temporaries':>13}{'total MiB':>11}" + ("  permute MiB" if args.traffic else ""))
    for schedule in args.schedules.split(","):
      for micro in map(int, args.micro_batches.split(",")):
        size = args.micro_batch_size or batch // micro
        if not args.micro_batch_size and batch % micro:
          raise ConfigError(f"--micro-batches {micro} does not divide train.batch_size {batch}")
        config = load_config(args.config, overrides + [
            f"--config.train.batch_size={size * micro}", f"--config.train.micro_batch_size={size}",
            f"--config.parallel.pipeline_schedule={schedule}"])
        layout = make_layout(config.parallel, devices)
        m = compiled_step(config, layout).memory_analysis()
        sched = Schedule(layout.stages, layout.repeats, micro, schedule)
        record = dict(schedule=schedule, micro_batches=micro, micro_batch_size=size, bubble=round(sched.bubble, 4),
                      in_flight=sched.in_flight, argument_bytes=m.argument_size_in_bytes,
                      temp_bytes=m.temp_size_in_bytes,
                      total_bytes=(m.argument_size_in_bytes + m.output_size_in_bytes
                                   - m.alias_size_in_bytes + m.temp_size_in_bytes))
        mib = lambda b: f"{b / 2**20:.1f}"
        line = (f"{schedule:<12}{micro:>4}{100 * sched.bubble:>7.1f}%{sched.in_flight:>10}"
                f"{mib(record['argument_bytes']):>11}{mib(record['temp_bytes']):>13}"
                f"{mib(record['total_bytes']):>11}")
        if args.traffic:
          sent = communication(config, layout)["bytes_per_device"].get("collective-permute", 0)
          record["collective_permute_bytes"] = sent
          line += f"{mib(sent):>13}"
        print(line)
        print(json.dumps({"config": args.config, "overrides": overrides, **record}))
    return 0

  return run(command)


if __name__ == "__main__":
  sys.exit(main())
