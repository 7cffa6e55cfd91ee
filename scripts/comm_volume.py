"""Bytes each device sends per training step, by collective kind, before renting the devices.

  python scripts/comm_volume.py --config configs/NAME.py [--devices N] [--config.group.key=value ...]

Compiles the config's train step on its parallel layout (on N simulated CPU devices when this
machine has fewer; nothing runs) and reads the collectives out of the compiled program
(jmoe/memory/traffic.py says how each kind counts). Prints a table, then one JSON line with
`bytes_per_device` per kind, `per_overflow_round` (what one more all-to-all dispatch round in
every MoE layer would add; how many run depends on the routing, see the `overflow_rounds`
metric), and `all_to_all_over_routed`: the all-to-all bytes over the bytes of the token copies
a balanced routing sends to other devices (four crossings per MoE layer). 1 is the least an
exchange of the copies can send; the all-to-all dispatcher sends `moe.dispatch_factor` times it.
The program is XLA's for the CPU: GPU builds may combine collectives differently, the bytes stay.
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
  rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(rest)

  def command() -> int:
    from jmoe.config import load_config
    from jmoe.memory.traffic import communication
    from jmoe.parallel import make_layout
    config = load_config(args.config, overrides)
    devices, _ = devices_for(args.devices, argv is not None)
    layout = make_layout(config.parallel, devices)
    result = communication(config, layout)
    print(f"{len(devices)} device(s), per device per step:\n"
          f"{layout.describe(config.moe_layers)}")
    for kind, sent in result["bytes_per_device"].items():
      line = f"  {kind:<19}{sent / 2**20:12.3f} MiB"
      if kind in result["per_overflow_round"]:
        line += f"   (+{result['per_overflow_round'][kind] / 2**20:.3f} MiB per overflow round)"
      print(line)
    if result["all_to_all_over_routed"] is not None:
      print(f"  routed copies      {result['routed_bytes'] / 2**20:12.3f} MiB   all-to-all / "
            f"routed = {result['all_to_all_over_routed']:.3f}")
    print(json.dumps({"config": args.config, "overrides": overrides, "devices": len(devices),
                      **result}))
    return 0

  return run(command)


if __name__ == "__main__":
  sys.exit(main())
