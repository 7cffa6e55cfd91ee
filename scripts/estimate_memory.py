"""Per-device memory of a training step, by category, before compiling anything.

  python scripts/estimate_memory.py --config configs/NAME.py [--config.group.key=value ...]
      [--devices N] [--platform gpu|cpu] [--device-memory-gib 80] [--largest 10]
      [--compare [--mock-gpus N]]

Traces the config's train step on its parallel layout and walks it in program order as XLA's
buffer assignment would (jmoe/memory/walk.py says what it assumes): parameters, optimizer state,
gradients, weights cast for compute, activations kept for the backward pass under the config's
`train.remat`, the MoE layer's dispatch buffers, and the optimizer's update, at the step's peak.

`--devices N` estimates for N devices: the first N at hand or, when there are fewer, N simulated
CPU devices (the script runs itself again with them; nothing runs on them, the step is only
traced), for the GPU platform unless `--platform` says otherwise. `--compare` also compiles the
step on the devices at hand and prints XLA's own figure and the difference; with `--mock-gpus N`
on one GPU, JAX pretends to have N (a mocked topology: the step compiles for N GPUs, nothing
runs), so a many-GPU layout's XLA figure is known before renting the GPUs. With pipeline
stages it also prints the share of the step each stage idles (the schedule's bubble and the
layer slots uneven groups leave empty).
Prints a table, then one JSON line.
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
  parser.add_argument("--platform", choices=("gpu", "cpu"),
                      help="the platform estimated for (default: this one; gpu on simulated devices)")
  parser.add_argument("--device-memory-gib", type=float, default=0.0,
                      help="each device's memory, to say whether the step fits")
  parser.add_argument("--largest", type=int, default=10, help="list this many largest buffers")
  parser.add_argument("--compare", action="store_true",
                      help="also compile the step here and print XLA's per-device bytes")
  parser.add_argument("--mock-gpus", type=int, default=0,
                      help="on one GPU: JAX pretends to have this many (one per mocked host), so "
                           "that --compare compiles a many-GPU layout; nothing can run")
  rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(rest)

  def command() -> int:
    import jax
    if args.mock_gpus:
      mock_gpus(args.mock_gpus)
    from jmoe.config import ConfigError, load_config
    from jmoe.parallel import make_layout
    from jmoe.memory import compiled_bytes, estimate
    config = load_config(args.config, overrides)
    if args.device_memory_gib < 0:
      raise ConfigError(f"--device-memory-gib {args.device_memory_gib} must be >= 0")
    devices, simulated = devices_for(args.devices, argv is not None)
    if args.compare and simulated:
      raise ConfigError("--compare compiles on the devices at hand; these are simulated")
    platform = args.platform or ("gpu" if simulated else jax.default_backend())
    layout = make_layout(config.parallel, devices)
    result = estimate(config, layout, platform=platform)
    device_bytes = int(args.device_memory_gib * 2**30)
    print(f"{len(devices)} {platform} device(s), per device:\n"
          f"{layout.describe(config.moe_layers)}")
    print(result.table(device_bytes or None))
    if args.largest:
      print("largest buffers at the peak:")
      unit, scale = ("GiB", 2**30) if result.total >= 2**30 else ("MiB", 2**20)
      for b, kind, what in result.largest[:args.largest]:
        print(f"  {b / scale:8.3f} {unit}  {kind:<18}{what}")
    record = {"config": args.config, "overrides": overrides, "devices": len(devices),
              "platform": platform, "total_gib": round(result.total / 2**30, 3),
              "host_gib": round(result.host / 2**30, 3),
              **{k.replace(" ", "_") + "_gib": round(v / 2**30, 3)
                 for k, v in result.by_category.items()}}
    if device_bytes:
      record["fits"] = result.total <= device_bytes
    if layout.stages > 1:
      record.update(pipeline(config, layout))
    if args.compare:
      xla = compiled_bytes(config, layout)
      record.update(xla_gib=round(xla / 2**30, 3), error=round(result.total / xla - 1, 4))
      print(f"XLA, compiled here: {xla / 2**30:.3f} GiB per device; "
            f"the estimate is {result.total / xla - 1:+.1%} off")
    print(json.dumps(record))
    return 0

  return run(command)


def pipeline(config, layout) -> dict:
  """Prints and returns the pipeline's idle shares: the schedule's bubble, (S - 1) / (R M + S - 1)
  of the iterations, and the masked slots, the share of each stage's layer slots that hold no
  layer where the groups are uneven (a synchronous pipeline waits for its largest group)."""
  from jmoe.model.pipeline import bubble_fraction, slots_of
  micro = config.train.num_micro_batches
  slots = slots_of(layout, config.moe_layers)
  bubble = bubble_fraction(layout.stages, layout.repeats, micro)
  masked = 1 - sum(slots.counts) / (len(slots.counts) * slots.width)
  print(f"pipeline: {micro} micro-batches through {layout.stages} stages x {layout.repeats} "
        f"repeat(s): bubble {bubble:.1%}, masked slots {masked:.1%}, idle "
        f"{1 - (1 - bubble) * (1 - masked):.1%}; {slots.describe()}")
  return {"bubble": round(bubble, 4), "masked_slots": round(masked, 4)}


def mock_gpus(count: int) -> None:
  """JAX's mocked GPU topology: `count` hosts of one GPU each, this process the first; the
  compiler sees the whole program, the collectives are never run. Autotuning stays on this
  process (sharing its results would wait for the mocked hosts)."""
  import jax
  from jmoe.config import ConfigError
  if count < 2:
    raise ConfigError(f"--mock-gpus {count}: give the number of GPUs to pretend, 2 or more")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_gpu_shard_autotuning=false").strip()
  jax.config.update("jax_mock_gpu_topology", f"1x{count}x1")
  if jax.default_backend() != "gpu" or jax.device_count() != count:
    raise ConfigError(f"--mock-gpus {count} needs a GPU (JAX mocks GPU topologies only); this "
                      f"process has {jax.device_count()} {jax.default_backend()} device(s)")


if __name__ == "__main__":
  sys.exit(main())
