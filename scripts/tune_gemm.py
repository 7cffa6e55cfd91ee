"""Tile configs for the Mosaic-GPU grouped GEMMs (jmoe/ops/mosaic_gemm.py), measured on this GPU.

  python scripts/tune_gemm.py --config configs/bench/NAME.py [--config.k=v ...]
      [--out jmoe/ops/mosaic_tiles.json] [--reps 10]

For the six expert GEMMs of the config's MoE layer on one device (forward, input gradient and
weight gradient of the gate/up and the down projections; rows = the device's tokens x top-k, as
the dispatcher hands them over), times each tile config the kernels take on balanced routing and
keeps the fastest. Prints one JSON line per GEMM (best, runner-up, the dense GEMM of the same
M x K x N for comparison, the best config on skewed routing) and merges the winners into `--out`,
the table the backend reads; shapes already there and not tuned now stay as they are.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import pathlib
import sys
import time

import numpy as np


def median_seconds(fn, *args, reps: int) -> float:
  """Seconds per call: the median over 3 rounds of `reps` calls queued back to back, with one
  device sync a round (a sync per call would add the host's round trip to each)."""
  import jax
  jax.block_until_ready(fn(*args))
  rounds = []
  for _ in range(3):
    t0 = time.perf_counter()
    out = [fn(*args) for _ in range(reps)]
    jax.block_until_ready(out)
    rounds.append((time.perf_counter() - t0) / reps)
  return float(np.median(rounds))


def candidates(kind: str, k: int, n: int):
  from jmoe.ops.mosaic_gemm import Tiles
  # The space around the best configs of earlier sweeps on H200s (MEASURED.md): 16 each.
  if kind == "drhs":
    space = itertools.product((128, 64), (128, 64), (64, 128), (3, 4))
    tiles = [Tiles(block_m=m, block_n=b, block_k=bk, steps=s) for m, b, bk, s in space]
  else:
    space = itertools.product((128, 64), (128, 192, 256), (4, 5), (1, 4))
    tiles = [Tiles(block_m=m, block_n=b, block_k=64, steps=s, grid_block_n=g)
             for m, b, s, g in space if not (m == 64 and b < 256)]
  return [t for t in tiles if t.fits(kind, k, n)]


def gemm_shapes(config) -> dict[str, tuple[str, int, int, int]]:
  """name -> (kernel kind, rows, contraction K, output width N; for drhs: rows, D, F)."""
  from jmoe.parallel import make_layout
  layout = make_layout(config.parallel)
  moe, axes = config.moe, layout.expert_axes
  tokens = config.train.micro_batch * config.data.seq_len // layout.mesh.devices.size
  rows = tokens * moe.top_k * axes.num_tensor_shards * (
      axes.num_expert_shards if moe.dispatcher == "alltoall" else 1)
  d, f = config.model.d_model, 2 * moe.d_ff_expert // axes.num_tensor_shards
  f_down = moe.d_ff_expert // axes.num_tensor_shards
  return {"up_fwd": ("fwd", rows, d, f), "up_dlhs": ("dlhs", rows, f, d),
          "up_drhs": ("drhs", rows, d, f),
          "down_fwd": ("fwd", rows, f_down, d), "down_dlhs": ("dlhs", rows, d, f_down),
          "down_drhs": ("drhs", rows, f_down, d)}


def groups(kind: str, experts: int, rows: int) -> np.ndarray:
  if kind == "balanced":
    return np.full(experts, rows // experts, np.int32)
  rng = np.random.default_rng(0)
  p = np.exp(1.2 * rng.standard_normal(experts))
  return rng.multinomial(rows, p / p.sum()).astype(np.int32)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--out", default=str(pathlib.Path(__file__).parents[1] / "jmoe" / "ops"
                                           / "mosaic_tiles.json"))
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--only", help="comma-separated GEMM names (e.g. up_fwd,down_drhs)")
  from jmoe.cli import split_overrides
  rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(rest)

  import jax
  import jax.numpy as jnp
  from jmoe.config import load_config
  from jmoe.ops.mosaic_gemm import ragged, ragged_contract, shape_key
  config = load_config(args.config, overrides)
  experts = config.moe.num_experts // make_experts_split(config)
  keys = jax.random.split(jax.random.key(0), 3)
  config_summary = {"date": datetime.date.today().isoformat(),
                    "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                    "config": args.config, "overrides": overrides}
  tuned = {}
  for name, (kind, rows, k, n) in gemm_shapes(config).items():
    if args.only and name not in args.only.split(","):
      continue
    if kind == "drhs":
      a = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
      b = jax.random.normal(keys[1], (rows, n), jnp.bfloat16)
      run = lambda t: jax.jit(lambda a, b, g: ragged_contract(a, b, g, t))
    else:
      a = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
      shape = (experts, n, k) if kind == "dlhs" else (experts, k, n)
      b = (jax.random.normal(keys[1], shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
      run = lambda t: jax.jit(lambda a, b, g: ragged(a, b, g, kind == "dlhs", t))
    flops = 2 * rows * k * n
    balanced = jnp.asarray(groups("balanced", experts, rows))
    timed = []
    for tiles in candidates(kind, k, n):
      try:
        timed.append((median_seconds(run(tiles), a, b, balanced, reps=args.reps), tiles))
      except Exception as e:  # e.g. more shared memory than the SM has
        print(json.dumps({"gemm": name, "tiles": tiles.__dict__, "error": str(e)[:160]}),
              file=sys.stderr)
    if not timed:
      print(json.dumps({"gemm": name, "error": "no config ran"}), flush=True)
      continue
    timed.sort(key=lambda r: r[0])
    (best_s, best), runner_up = timed[0], timed[1:2]
    skewed_s = median_seconds(run(best), a, b, jnp.asarray(groups("skewed", experts, rows)),
                              reps=args.reps)
    dense_s = median_seconds(jax.jit(lambda x, y: x @ y), a,  # the same M x K x N, dense
                             jax.random.normal(keys[2], (k, n), jnp.bfloat16), reps=args.reps)
    tuned[shape_key(kind, k, n)] = best.__dict__
    write_table(args, config_summary, tuned)  # after each GEMM: a cut-short sweep keeps its part
    print(json.dumps({"gemm": name, "kind": kind, "rows": rows, "k": k, "n": n,
                      "experts": experts, "configs": len(timed),
                      "tflops": round(flops / best_s / 1e12, 1),
                      "tflops_skewed": round(flops / skewed_s / 1e12, 1),
                      "dense_tflops": round(flops / dense_s / 1e12, 1), "tiles": best.__dict__,
                      "runner_up": [[round(flops / s / 1e12, 1), t.__dict__]
                                    for s, t in runner_up]}), flush=True)
  print(json.dumps({"wrote": args.out, "shapes": sorted(tuned)}))
  return 0


def write_table(args, measured: dict, tuned: dict) -> None:
  """Merges `tuned` into the table at `args.out`; shapes it holds and `tuned` lacks stay."""
  out = pathlib.Path(args.out)
  table = json.loads(out.read_text()) if out.is_file() else {"tiles": {}}
  table["tiles"].update(tuned)
  table["measured"] = measured
  out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def make_experts_split(config) -> int:
  """How many devices the experts are split over (the experts one device holds: E / this)."""
  from jmoe.parallel import make_layout
  return make_layout(config.parallel).expert_axes.num_expert_shards


if __name__ == "__main__":
  sys.exit(main())
