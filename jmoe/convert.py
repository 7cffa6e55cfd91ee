"""Checkpoint conversion between jmoe and Hugging Face.

  python -m jmoe.convert import-hf --hf-dir DIR --out CKPT [--params-dtype float32]
  python -m jmoe.convert export-hf --checkpoint CKPT --out DIR [--dtype bfloat16] [--shard-gb 4]
  python -m jmoe.convert upcycle --checkpoint DENSE --config MOE_CONFIG --out CKPT
      [--router-std S] [--config.group.key=value ...]

CKPT is a jmoe model checkpoint (what import-hf and upcycle write); export-hf and upcycle also take
a training workdir and use its latest checkpoint (a LoRA run's: its adapters folded into the
model). Only local directories are read: nothing is downloaded. Train from a written CKPT with
`--config.checkpoint.load_params=CKPT`.

Both go one part of one variable at a time (a layer; of the routed experts' weights, a block of
experts within 1 GiB), on the host: import-hf reads a part from the safetensors and writes it into
the checkpoint at once; export-hf reads a part from the checkpoint and adds it to the safetensors
file being filled (at most --shard-gb). The host holds a few parts (and that file), never the
model, and no device is used. Either runs as several processes (one per host, joined as training
joins them: JMOE_COORDINATOR / JMOE_NUM_PROCESSES / JMOE_PROCESS_ID or a SLURM or MPI launcher,
jmoe/distributed.py), each reading and writing its share of the parts; every process must see the
input and --out.
"""

from __future__ import annotations

import argparse
import sys

from jmoe.cli import number, run, split_overrides


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jmoe.convert", description=__doc__.split("\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  imp = commands.add_parser("import-hf", help="Hugging Face directory -> jmoe model checkpoint")
  imp.add_argument("--hf-dir", required=True)
  imp.add_argument("--out", required=True)
  imp.add_argument("--params-dtype", default="float32", choices=["float32", "bfloat16"])
  imp.add_argument("--overwrite", action="store_true", help="replace what --out holds")
  exp = commands.add_parser("export-hf", help="jmoe checkpoint -> Hugging Face directory")
  exp.add_argument("--checkpoint", required=True)
  exp.add_argument("--out", required=True)
  exp.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="tensor dtype to write; default: the checkpoint's parameter dtype")
  exp.add_argument("--shard-gb", type=number(float, 0, open_low=True), default=4.0, help="largest safetensors file, in GB")
  exp.add_argument("--overwrite", action="store_true", help="replace what --out holds")
  exp.add_argument("--rope-interleave", choices=["true", "false"],
                   help="DeepSeek-V3: rotary weights interleaved (its checkpoints' layout, the "
                        "default) or half-split")
  up = commands.add_parser("upcycle", help="dense jmoe checkpoint -> MoE model checkpoint")
  up.add_argument("--checkpoint", required=True, help="a dense model (moe.first_k_dense = "
                  "model.num_layers): a model checkpoint or a training workdir")
  up.add_argument("--config", required=True, help="the MoE model's configs/*.py file")
  up.add_argument("--out", required=True)
  up.add_argument("--overwrite", action="store_true", help="replace what --out holds")
  up.add_argument("--router-std", type=number(float, 0),
                  help="spread of the initial router weights; default model.init_std, 0 gives "
                       "uniform routing")

  def command() -> int:
    rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(rest)
    if overrides and args.command != "upcycle":
      parser.error(f"{args.command} takes no --config.* overrides")
    from jmoe.hf.convert import export_hf, import_hf
    import jax
    from jmoe.distributed import initialize
    if args.command != "upcycle":
      # Conversion runs on the host: a GPU backend would only reserve its memory pool (most of
      # each GPU, and 4 GB of host memory), next to a run that may be training there.
      jax.config.update("jax_platforms", "cpu")
    if args.command == "upcycle":
      from jmoe.checkpoint.upcycle import upcycle
      from jmoe.config import load_config
      config = load_config(args.config, overrides)
      upcycle(args.checkpoint, config, args.out, args.router_std, args.overwrite)
      print(f"wrote {args.out} ({config.moe.num_experts} experts, top-{config.moe.top_k})")
    elif args.command == "import-hf":
      initialize()
      config = import_hf(args.hf_dir, args.out, args.params_dtype, args.overwrite)
      if jax.process_index() == 0:
        print(f"wrote {args.out} ({config.model.family}, {config.model.num_layers} layers, "
              f"{config.moe.num_experts} experts)")
    else:
      initialize()
      interleave = None if args.rope_interleave is None else args.rope_interleave == "true"
      out = export_hf(args.checkpoint, args.out, int(args.shard_gb * 2**30), args.dtype, interleave,
                      args.overwrite)
      if jax.process_index() == 0:
        print(f"wrote {out}")
    return 0

  return run(command)


if __name__ == "__main__":
  sys.exit(main())
