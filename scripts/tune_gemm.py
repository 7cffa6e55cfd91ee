"""Tile configs for the Mosaic-GPU grouped GEMMs (jmoe/ops/mosaic_gemm.py), measured on this GPU.

  python scripts/tune_gemm.py (--presets | --config configs/NAME.py [--config ...])
      [--config.k=v ...] [--tokens 8192] [--candidates 12] [--budget-s S] [--skip-tuned]
      [--dry-run] [--out jmoe/ops/mosaic_tiles.json] [--reps 10]

For the six expert GEMMs of each config's MoE layer on one device (forward, input gradient and
weight gradient of the gate/up and the down projections), times the tile configs the kernels take
on balanced routing and keeps the fastest. `--presets`: every configs/*.py preset and
configs/bench/*_1gpu.py, less tiny_*, sft_* and configs without expert layers. Rows are the
device's tokens x top-k x the expert-tensor split, as the dispatcher hands them over: `--tokens`
per device (whole sequences of the config's data.seq_len; presets are multi-GPU layouts, so not
their training batch), over the config's local experts (num_experts / its expert parallelism).

The table is keyed by (kind, K, N), e.g. `fwd:2048x1536`: rows and experts do not enter the key,
so configs sharing a model width and expert width share entries, and each key is tuned once.
Candidates per shape (at most `--candidates`): the default config first (`default_tiles`, which
may pad the shape), then the configs that fit the shape exactly and fit the SM (shared memory,
accumulator registers), nearest the measured best first. A padded default that wins leaves the
key out of the table (the default gives it). Prints one JSON line per shape (best, runner-up,
the default's rate, the dense GEMM of the same M x K x N, the best config on skewed routing) and
a summary line, and merges the winners into `--out` after each shape, their figures in its
`stats`; shapes already there and not tuned now stay as they are. `--budget-s`: no shape or
config starts after that many seconds (0: nothing runs, nothing is written). `--dry-run` prints
the shapes and their candidates without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOKENS = 8192  # per device: what one H200 holds in the bench configs (2 x 4096)
# Around the measured best (MEASURED.md, docs/perf/records.jsonl): (block_m, block_n, block_k,
# pipeline steps it ran best with), best first; each block also tried with the other depths.
RAGGED_BLOCKS = ((128, 192, 64, 4), (128, 128, 64, 4), (64, 256, 64, 5), (64, 192, 64, 4),
                 (128, 64, 64, 4), (64, 128, 64, 4), (64, 64, 64, 4))
CONTRACT_BLOCKS = ((128, 128, 64, 4), (128, 128, 128, 3), (128, 192, 64, 4), (64, 256, 64, 4),
                   (128, 64, 64, 4), (64, 128, 64, 4), (64, 192, 64, 4), (64, 64, 64, 4))
TOP_BLOCKS = 3  # the blocks that won or came second somewhere; smaller ones only after them
STEPS = (3, 4, 5)
BANDS = (4, 2, 1)  # grid_block_n, widest first (ragged_dot only; the weight gradient takes 1)


@dataclasses.dataclass(frozen=True)
class Gemm:
  """One expert GEMM on one device: kernel kind, rows, contraction k and output width n (for
  drhs: D and F), local experts."""
  name: str  # up_fwd, up_dlhs, up_drhs, down_fwd, down_dlhs, down_drhs
  kind: str
  rows: int
  k: int
  n: int
  experts: int

  @property
  def key(self) -> str:
    from jmoe.ops.mosaic_gemm import shape_key
    return shape_key(self.kind, self.k, self.n)


def has_experts(config) -> bool:
  return config.moe.first_k_dense < config.model.num_layers


def gemm_shapes(config, tokens: int = TOKENS) -> list[Gemm]:
  """The six GEMMs of `config`'s MoE layer on one device with `tokens` tokens (rounded down to
  whole sequences, at least one). A size of -1 in the expert layout ("the rest") counts as 1."""
  moe, layout = config.moe, config.parallel.expert
  expert_shards, tensor_shards = max(layout.expert, 1), max(layout.tensor, 1)
  seq_len = config.data.seq_len
  rows = max(tokens // seq_len, 1) * seq_len * moe.top_k * tensor_shards
  experts = moe.num_experts // expert_shards
  d, f = config.model.d_model, moe.d_ff_expert // tensor_shards
  shapes = {"up_fwd": ("fwd", d, 2 * f), "up_dlhs": ("dlhs", 2 * f, d),
            "up_drhs": ("drhs", d, 2 * f), "down_fwd": ("fwd", f, d),
            "down_dlhs": ("dlhs", d, f), "down_drhs": ("drhs", f, d)}
  return [Gemm(name, kind, rows, k, n, experts) for name, (kind, k, n) in shapes.items()]


def preset_paths(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
  """configs/*.py and configs/bench/*_1gpu.py, less tiny_* and sft_* (toys, and fine-tuning runs
  of toys)."""
  paths = sorted((root / "configs").glob("*.py")) + sorted((root / "configs" / "bench").glob(
      "*_1gpu.py"))
  return [p for p in paths if not p.name.startswith(("tiny_", "sft_"))]


def collect(configs: list[tuple[str, object]], tokens: int = TOKENS
            ) -> dict[str, tuple[Gemm, list[str]]]:
  """key -> (its first GEMM, every "config:gemm" with that key), in the order met."""
  shapes: dict[str, tuple[Gemm, list[str]]] = {}
  for name, config in configs:
    for gemm in gemm_shapes(config, tokens):
      shapes.setdefault(gemm.key, (gemm, []))[1].append(f"{name}:{gemm.name}")
  return shapes


def candidates(kind: str, k: int, n: int) -> list:
  """The configs that fit (kind, k, n) without padding and fit the SM, best guess first: the first
  TOP_BLOCKS blocks at their measured depth and widest band; then those with one change (another
  depth before a narrower band) and the smaller blocks as they are; and so on."""
  from jmoe.ops.mosaic_gemm import Tiles
  blocks, bands = (CONTRACT_BLOCKS, (1,)) if kind == "drhs" else (RAGGED_BLOCKS, BANDS)
  ranked = []
  for rank, (block_m, block_n, block_k, best_steps) in enumerate(blocks):
    fitting = [g for g in bands if Tiles(block_m, block_n, block_k, best_steps, g).fits(kind, k, n)]
    for steps in STEPS:
      for g in fitting:
        t = Tiles(block_m=block_m, block_n=block_n, block_k=block_k, steps=steps, grid_block_n=g)
        if t.runs(kind):
          changes = (steps != best_steps) + (g != fitting[0]) + (rank >= TOP_BLOCKS)
          ranked.append(((changes, rank, g != fitting[0], abs(steps - best_steps), -g), t))
  return [t for _, t in sorted(ranked, key=lambda r: r[0])]


def plans(kind: str, k: int, n: int, limit: int) -> list:
  """What to time for a shape: the default (padded or not), then `candidates`, `limit` in all."""
  from jmoe.ops.mosaic_gemm import default_tiles
  default = default_tiles(kind, k, n)
  return ([default] + [t for t in candidates(kind, k, n) if t != default])[:max(limit, 1)]


def median_seconds(fn, *args, reps: int) -> float:
  """Seconds per call: the median over 3 rounds of `reps` calls queued back to back, with one
  device sync a round (a sync per call would add the host's round trip to each). Only the last
  output is held: calls run in order on the device, and ten 15 GB weight gradients would not fit."""
  import jax
  jax.block_until_ready(fn(*args))
  rounds = []
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    rounds.append((time.perf_counter() - t0) / reps)
  return float(np.median(rounds))


def groups(kind: str, experts: int, rows: int) -> np.ndarray:
  if kind == "balanced":
    return np.full(experts, rows // experts, np.int32)
  rng = np.random.default_rng(0)
  p = np.exp(1.2 * rng.standard_normal(experts))
  return rng.multinomial(rows, p / p.sum()).astype(np.int32)


def tune(gemm: Gemm, to_time: list, reps: int, deadline: float) -> dict | None:
  """Times each config (none started after `deadline`, the first always); the figures of the
  best, or None when none ran."""
  import jax
  import jax.numpy as jnp
  from jmoe.ops.mosaic_gemm import ragged, ragged_contract
  keys = jax.random.split(jax.random.key(0), 3)
  a = jax.random.normal(keys[0], (gemm.rows, gemm.k), jnp.bfloat16)
  if gemm.kind == "drhs":
    b = jax.random.normal(keys[1], (gemm.rows, gemm.n), jnp.bfloat16)
    make = lambda t: jax.jit(lambda a, b, g: ragged_contract(a, b, g, t))
  else:
    shape = (gemm.n, gemm.k) if gemm.kind == "dlhs" else (gemm.k, gemm.n)
    b = jax.random.normal(keys[1], (gemm.experts, *shape), jnp.bfloat16) * 0.02
    make = lambda t: jax.jit(lambda a, b, g: ragged(a, b, g, gemm.kind == "dlhs", t))
  balanced = jnp.asarray(groups("balanced", gemm.experts, gemm.rows))
  timed, compiled = [], {}
  for tiles in to_time:
    if timed and time.monotonic() >= deadline:
      break
    try:
      compiled[tiles] = make(tiles)
      timed.append((median_seconds(compiled[tiles], a, b, balanced, reps=reps), tiles))
    except Exception as e:  # a config the compiler refuses after all: the next one
      print(json.dumps({"gemm": gemm.name, "key": gemm.key, "tiles": tiles.__dict__,
                        "error": str(e)[:160]}), file=sys.stderr, flush=True)
  if not timed:
    return None
  flops = 2 * gemm.rows * gemm.k * gemm.n
  tflops = lambda s: float(f"{flops / s / 1e12:.4g}")
  default_s = dict((t, s) for s, t in timed).get(to_time[0])
  timed.sort(key=lambda r: r[0])
  (best_s, best), runner_up = timed[0], timed[1:2]
  skewed_s = median_seconds(compiled[best], a, b,
                            jnp.asarray(groups("skewed", gemm.experts, gemm.rows)), reps=reps)
  dense_s = median_seconds(jax.jit(lambda x, y: x @ y), a,  # the same M x K x N, dense
                           jax.random.normal(keys[2], (gemm.k, gemm.n), jnp.bfloat16), reps=reps)
  return {"gemm": gemm.name, "key": gemm.key, "kind": gemm.kind, "rows": gemm.rows,
          "k": gemm.k, "n": gemm.n, "experts": gemm.experts, "configs": len(timed),
          "tflops": tflops(best_s), "tflops_skewed": tflops(skewed_s),
          "dense_tflops": tflops(dense_s),
          "default_tflops": tflops(default_s) if default_s else None,
          "tiles": best.__dict__, "padded": list(best.padded(gemm.kind, gemm.k, gemm.n))
          if not best.fits(gemm.kind, gemm.k, gemm.n) else None,
          "runner_up": [[tflops(s), t.__dict__] for s, t in runner_up]}


def write_table(out: pathlib.Path, measured: dict, tuned: dict, stats: dict) -> None:
  """Merges `tuned` (key -> tile config, or None: the default wins, drop the key) and `stats`
  (key -> figures) into the table at `out`; keys it holds and these lack stay. The new table
  replaces the one read only if no one else changed it meanwhile (jmoe.outputs)."""
  from jmoe.outputs import check, written
  output = check(out, directory=False, overwrite=True)
  table = read_table(output.path)
  tiles, figures = table.setdefault("tiles", {}), table.setdefault("stats", {})
  for key, value in tuned.items():
    if value is None:
      tiles.pop(key, None)
    else:
      tiles[key] = value
  figures.update(stats)
  table["measured"] = measured
  with written(output) as tmp:
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def read_table(path: pathlib.Path) -> dict:
  """The tile table at `path` ({} when there is none yet)."""
  from jmoe.config import ConfigError
  if not path.is_file():
    return {}
  try:
    table = json.loads(path.read_text())
  except ValueError as e:
    raise ConfigError(f"--out {path} is not a tile table ({e}); restore it or choose another "
                      f"--out") from None
  if not isinstance(table, dict):
    raise ConfigError(f"--out {path} is not a tile table (a JSON object); restore it or choose "
                      f"another --out")
  return table


def load_configs(paths: list[str], overrides: list[str]) -> tuple[list, list[str]]:
  """(name, config) of each path with expert layers; the names of those without."""
  from jmoe.config import load_config
  configs, skipped = [], []
  for path in paths:
    resolved = pathlib.Path(path).resolve()
    name = str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)
    config = load_config(path, overrides)
    if has_experts(config):
      configs.append((name, config))
    else:
      skipped.append(name)
  return configs, skipped


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", action="append", default=[], help="a config file; repeatable")
  parser.add_argument("--presets", action="store_true",
                      help="every configs/*.py and configs/bench/*_1gpu.py but tiny_*, sft_*")
  parser.add_argument("--out", default=str(ROOT / "jmoe" / "ops" / "mosaic_tiles.json"))
  parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens per device")
  parser.add_argument("--candidates", type=int, default=12, help="configs timed per shape, at most")
  parser.add_argument("--budget-s", type=float, default=None,
                      help="wall-clock seconds after which no shape or config starts")
  parser.add_argument("--skip-tuned", action="store_true", help="leave out keys the table holds")
  parser.add_argument("--dry-run", action="store_true", help="list shapes and candidates only")
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--only", help="comma-separated GEMM names (e.g. up_fwd,down_drhs)")
  from jmoe.cli import run, split_overrides
  rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(rest)
  paths = args.config + ([str(p) for p in preset_paths()] if args.presets else [])
  first = {}  # a config named twice (by --config and by --presets) counts once, where first named
  for path in paths:
    first.setdefault(pathlib.Path(path).resolve(), path)
  paths = list(first.values())
  if not paths:
    parser.error("name a --config or --presets")
  return run(lambda: sweep(args, paths, overrides))


def sweep(args: argparse.Namespace, paths: list[str], overrides: list[str]) -> int:
  """Times the GEMM shapes of the configs at `paths`, writing the table after each."""
  from jmoe.outputs import check
  start = time.monotonic()
  out = check(args.out, directory=False, overwrite=True).path  # before any timing
  configs, skipped = load_configs(paths, overrides)
  held = set(read_table(out).get("tiles", {}))
  shapes = [(gemm, sources) for key, (gemm, sources) in collect(configs, args.tokens).items()
            if not (args.only and gemm.name not in args.only.split(","))
            and not (args.skip_tuned and key in held)]
  shapes.sort(key=lambda s: s[0].key in held)  # untuned keys first, should the budget run out
  deadline = start + (args.budget_s if args.budget_s is not None else float("inf"))
  summary = {"shapes": len(shapes), "skipped_configs": skipped, "tuned": [], "default_kept": [],
             "not_run": [], "configs_timed": 0}
  if args.dry_run:
    for gemm, sources in shapes:
      to_time = plans(gemm.kind, gemm.k, gemm.n, args.candidates)
      summary["configs_timed"] += len(to_time)
      print(json.dumps({"key": gemm.key, "from": sources, "rows": gemm.rows,
                        "experts": gemm.experts, "plans": [t.__dict__ for t in to_time]}))
    print(json.dumps(summary))
    return 0

  import jax
  measured = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
              "device": jax.devices()[0].device_kind, "configs": [n for n, _ in configs],
              "overrides": overrides, "tokens_per_device": args.tokens}
  for gemm, sources in shapes:
    if time.monotonic() >= deadline:
      summary["not_run"].append(gemm.key)
      continue
    result = tune(gemm, plans(gemm.kind, gemm.k, gemm.n, args.candidates), args.reps, deadline)
    if result is None:
      print(json.dumps({"gemm": gemm.name, "key": gemm.key, "error": "no config ran"}), flush=True)
      continue
    result["from"] = sources
    summary["configs_timed"] += result["configs"]
    kept_default = result["padded"] is not None
    summary["default_kept" if kept_default else "tuned"].append(gemm.key)
    stats = dict(result, date=measured["date"], device=measured["device"])
    write_table(out, measured, {gemm.key: None if kept_default else result["tiles"]},
                {gemm.key: stats})  # after each shape: a cut-short sweep keeps its part
    print(json.dumps(result), flush=True)
  summary.update(wrote=str(out) if summary["tuned"] or summary["default_kept"] else None,
                 seconds=round(time.monotonic() - start, 1))
  print(json.dumps(summary), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
