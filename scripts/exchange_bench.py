"""The token exchange of expert parallelism at a config's sizes: the all-to-all dispatcher's
fixed-size blocks (`lax.all_to_all`, as many rounds as the routing needs) against
`lax.ragged_all_to_all`, which moves exactly the routed rows.

  python scripts/exchange_bench.py --config configs/bench/qwen3_30b_a3b_2gpu_ep2.py \\
      [--devices N] [--hot F] [--iters 20] [--config.group.key=value ...]

Every device at hand (or the first N) is one expert-parallel peer. Each holds its share of a
micro-batch's routed copies (tokens per device x top-k rows of d_model, in the compute dtype),
sorted by destination; `--hot F` sends a fraction F of every device's copies to device 0 and the
rest evenly to the others (default 1/N: balanced). The blocks are sized as the dispatcher sizes
them (`moe.dispatch_factor` x the mean copies per peer; jmoe/moe/alltoall.py), and copies past a
block go in further rounds of the same exchange. Before timing, the rows each exchange delivers
are checked against the rows sent, exactly (rows only move); a mismatch exits 1. Prints one JSON
line: the sizes, and for each exchange the median milliseconds of `--iters` runs after warm-up and
the GB/s each device sends to the others. XLA:CPU has no ragged all-to-all: there its entry says so.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import sys
import time

import numpy as np

# Run from anywhere: the repository root (this file's parent's parent) is importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def send_counts(rows: int, peers: int, hot: float) -> np.ndarray:
  """[sender, receiver] copies: a fraction `hot` of each sender's `rows` to peer 0, the rest
  spread evenly over the others (remainders to the first of them)."""
  if peers == 1:
    return np.array([[rows]])
  first = round(hot * rows)
  rest, extra = divmod(rows - first, peers - 1)
  row = [first] + [rest + (i < extra) for i in range(peers - 1)]
  return np.tile(np.array(row, np.int64), (peers, 1))


def exchanges(mesh, counts: np.ndarray, block: int, rounds: int):
  """(fixed, ragged): jitted functions of the sorted copies [peers * rows, D] (split over the
  mesh's one axis) returning what each device receives: [peers * rounds * peers * block, D],
  peer q's round r in block (r, q); and [peers * out_rows, D], peer q's rows after those of the
  peers before it."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  (axis,) = mesh.axis_names
  peers = counts.shape[0]
  out_rows = int(counts.sum(axis=0).max())
  starts = np.concatenate([np.zeros((peers, 1), np.int64), np.cumsum(counts, axis=1)[:, :-1]],
                          axis=1)  # [sender, receiver]: where the receiver's rows start
  # [sender, receiver]: where the sender's rows land in the receiver's buffer.
  lands = np.concatenate([np.zeros((1, peers), np.int64), np.cumsum(counts, axis=0)[:-1]])
  tables = {name: jnp.asarray(t, jnp.int32) for name, t in
            (("counts", counts), ("starts", starts), ("lands", lands))}
  on_peers = functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(axis), P(axis)),
                               out_specs=P(axis))

  @jax.jit
  @on_peers
  def fixed(x_RD, me):
    count_P, start_P = tables["counts"][me[0]], tables["starts"][me[0]]

    def one_round(r):
      index_PB = start_P[:, None] + r * block + jnp.arange(block)[None, :]
      valid_PB = r * block + jnp.arange(block)[None, :] < count_P[:, None]
      send = jnp.where(valid_PB[..., None], x_RD[jnp.where(valid_PB, index_PB, 0)], 0)
      return jax.lax.all_to_all(send.reshape(peers * block, -1), axis, 0, 0, tiled=True)

    return jnp.concatenate([one_round(r) for r in range(rounds)])

  @jax.jit
  @on_peers
  def ragged(x_RD, me):
    out = jnp.zeros((out_rows, x_RD.shape[1]), x_RD.dtype)
    return jax.lax.ragged_all_to_all(
        x_RD, out, tables["starts"][me[0]], tables["counts"][me[0]], tables["lands"][me[0]],
        tables["counts"][:, me[0]], axis_name=axis)

  return fixed, ragged


def check_received(kind: str, got: np.ndarray, x: np.ndarray, counts: np.ndarray, block: int
                   ) -> None:
  """Raises AssertionError unless `got` (one exchange's output, all devices) holds, for every
  receiver p and sender q, exactly q's copies for p."""
  peers = counts.shape[0]
  rows = x.shape[0] // peers
  got = got.reshape(peers, -1, x.shape[1])
  for p in range(peers):
    for q in range(peers):
      sent = x[q * rows:][:rows][counts[q, :p].sum():][:counts[q, p]]
      if kind == "fixed":
        rounds = got.shape[1] // (peers * block)
        blocks = got[p].reshape(rounds, peers, block, -1)[:, q].reshape(rounds * block, -1)
        received = blocks[:counts[q, p]]
      else:
        received = got[p][counts[:q, p].sum():][:counts[q, p]]
      if not np.array_equal(received, sent):
        raise AssertionError(f"{kind}: device {p} did not receive device {q}'s rows")


def timed(fn, *args, iters: int) -> float:
  """Median seconds of `iters` calls after two warm-up calls."""
  import jax
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
  from jmoe.cli import devices_for, layout_parser, run, split_overrides
  parser = layout_parser(__doc__.split("\n")[0])
  parser.add_argument("--hot", type=float, help="fraction of each device's copies sent to "
                      "device 0 (default: balanced)")
  parser.add_argument("--iters", type=int, default=20)
  rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(rest)

  def command() -> int:
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jmoe.config import ConfigError, load_config
    from jmoe.ops.params import DTYPES
    config = load_config(args.config, overrides)
    devices, _ = devices_for(args.devices, argv is not None)
    peers = len(devices)
    tokens = config.train.micro_batch * config.data.seq_len // peers
    rows = tokens * config.moe.top_k
    hot = 1 / peers if args.hot is None else args.hot
    if not 0 <= hot <= 1:
      raise ConfigError(f"--hot {args.hot}: give a fraction between 0 and 1")
    counts = send_counts(rows, peers, hot)
    block = min(rows, math.ceil(config.moe.dispatch_factor * rows / peers))
    rounds = math.ceil(counts.max() / block)
    mesh = Mesh(np.array(devices), ("peers",))
    dtype = DTYPES[config.precision.compute]
    x = jax.random.normal(jax.random.key(0), (peers * rows, config.model.d_model), dtype)
    x = jax.device_put(x, NamedSharding(mesh, P("peers")))
    me = jax.device_put(np.arange(peers, dtype=np.int32), NamedSharding(mesh, P("peers")))
    host_x = np.asarray(x)
    row_bytes = config.model.d_model * x.dtype.itemsize
    sent_away = (counts.sum(axis=1) - np.diag(counts)).max() * row_bytes
    fixed, ragged = exchanges(mesh, counts, block, rounds)
    result = {"config": args.config, "overrides": overrides, "devices": peers,
              "platform": devices[0].platform, "rows_per_device": rows, "row_bytes": row_bytes,
              "hot": hot, "block": block, "rounds": rounds}
    for kind, fn in (("fixed", fixed), ("ragged", ragged)):
      try:
        got = np.asarray(fn(x, me))
      except jax.errors.JaxRuntimeError as e:
        if "UNIMPLEMENTED" not in str(e):
          raise
        result[kind] = f"not supported on {devices[0].platform}: {str(e).splitlines()[0][:200]}"
        continue
      check_received(kind, got, host_x, counts, block)
      seconds = timed(fn, x, me, iters=args.iters)
      result[kind] = {"ms": round(seconds * 1e3, 3),
                      "gb_per_s_sent": round(sent_away / seconds / 1e9, 2)}
    print(json.dumps(result))
    return 0

  return run(command)


if __name__ == "__main__":
  sys.exit(main())
