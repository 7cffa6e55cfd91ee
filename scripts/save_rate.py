"""How fast jmoe's Checkpointer writes a state of a given size, as a run's last save writes it,
beside the rate of plain file writes of the same bytes.

  python scripts/save_rate.py [--gib 18] [--file-mib 64] [--threads default] [--raw-threads 0]
      [--staging-gb 0] [--parts-gb 1] [--repeats 2] DIR [DIR ...]

The state is a Qwen3-30B-A3B-like stack of expert weights (bf16) and AdamW moments (float32),
random, on the default device, each array a Variable whose leading axes are layers and experts,
so that it is stored one (layer, expert) chunk at a time as a train state's expert weights are.
Each save is the run's last as `jmoe.train` makes it: an asynchronous Checkpointer whose host
memory was reserved beforehand (page-locked on a GPU), `save(waited=True)`, uncompressed, then
`wait`; timed in two parts, the copy to the host (`to_host_s`, until `save` returns) and the
write (`write_s`, `write_gb_per_s`; no rate where `save` returns written). The Checkpointer keeps
every repeat (a run's last save with `checkpoint.keep` reached also removes the oldest step, in
the save's time); each saved step is then removed and timed (`removed`: its files unlinked by
half the cores, then by one thread, alternately, as jmoe's StepRemover unlinks them: on tmpfs,
freeing the pages is most of it). `--file-mib`:
TensorStore's data file sizes (jmoe/checkpoint/writer.py DATA_FILE_BYTES); `--threads`: the
threads of each of TensorStore's two pools for the save (`default`: jmoe's for the saves a run
waits for, three per core; TensorStore's own pools take one copying thread per core);
`--staging-gb`: `checkpoint.staging_gb` (0: the whole state to the host at once; above 0, parts
of that many GB, each taken while the one before is written, and `save` returns written:
`to_host_s` then holds the whole save); `--parts-gb`: the Checkpointer's `waited_parts_gb`, for
saves not staged (0: every array on the host before the first is written, `save` returning
then; above 0, the default 1, parts of that many GB each written as soon as it is there, beside
the parts before, and `save` returns written). Each line also gives the save's own phases
(`on_host_s`, `written_s`, `finished_s`: `Checkpointer.last_save`). First, for each directory
and file size, the
same bytes, fetched to the host beforehand, are written as plain files of that size by each of
`--raw-threads` threads (0: one per core) and removed (`raw_gb_per_s`: what the file system and
the host's memory allow); that host copy is let go before the saves. Until 2026-12-06 the save
was synchronous and the plain writes' time held the fetch to pageable memory, which on a GPU is
most of it.
Prints one JSON line per save and one per removal; each directory is removed at the end, and on
an error.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def state_of(gib: float):
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jmoe.ops.params import LAYER_AXES
  layers, experts, width = 8, 128, 2048
  # per layer and expert: two bf16 weights and two float32 moments of width x hidden each
  hidden = max(1, round(gib * 2**30 / (layers * experts * width * 12)))
  keys = jax.random.split(jax.random.key(0), 4)
  axes = (LAYER_AXES[0], "expert", "embed", "mlp")
  draw = lambda key, dtype: nnx.Param((0.02 * jax.random.normal(
      key, (layers, experts, width, hidden), jnp.float32)).astype(dtype), axes=axes)
  state = {"w_up": draw(keys[0], jnp.bfloat16), "w_down": draw(keys[1], jnp.bfloat16),
           "mu": draw(keys[2], jnp.float32), "nu": draw(keys[3], jnp.float32)}
  state["nu"] = state["nu"].replace(jnp.square(state["nu"].get_value()))
  return jax.block_until_ready(state)


def raw_write(arrays: dict, directory: pathlib.Path, file_bytes: int, threads: int) -> float:
  """Seconds to write the bytes of `arrays` (host arrays) as plain files of `file_bytes` in
  `directory` (made, then removed) by `threads` threads."""
  import concurrent.futures

  def write(job):
    name, part, view = job
    with open(directory / f"{name}.{part}", "wb") as f:
      f.write(view)

  jobs = []
  for name, x in arrays.items():
    data = memoryview(x.reshape(-1).view("uint8"))
    jobs += [(name, i // file_bytes, data[i:i + file_bytes])
             for i in range(0, len(data), file_bytes)]
  directory.mkdir(parents=True)
  started = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    list(pool.map(write, jobs))
  seconds = time.perf_counter() - started
  shutil.rmtree(directory)
  return seconds


def gigabytes(text: str, name: str, parser) -> list[float]:
  """`text`'s comma-separated numbers of GB, 0 or more."""
  try:
    out = [float(x) for x in text.split(",")]
  except ValueError:
    out = [-1.0]
  if not all(0 <= x < float("inf") for x in out):
    parser.error(f"{name}: each is a number of GB, 0 or more, not {text!r}")
  return out


def numbers(text: str, name: str, parser, *, default: str | None = None,
            zero: bool = False) -> list:
  """`text`'s comma-separated whole numbers, above 0 (or 0 too, with `zero`), and `default` as
  None where named."""
  out = []
  for item in text.split(","):
    if default is not None and item == default:
      out.append(None)
    elif item.isascii() and item.isdigit() and (zero or int(item) > 0):
      out.append(int(item))
    else:
      least = "0 or more" if zero else "above 0"
      parser.error(f"{name}: each is a whole number {least}{f' or {default}' if default else ''}"
                   f", not {item!r}")
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dirs", nargs="+", type=pathlib.Path,
                      help="where to write (a directory of its own, removed at the end)")
  parser.add_argument("--gib", type=float, default=18.0)
  parser.add_argument("--file-mib", default="64")
  parser.add_argument("--threads", default="default")
  parser.add_argument("--raw-threads", default="0")
  parser.add_argument("--staging-gb", default="0")
  parser.add_argument("--parts-gb", default="1")
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args(argv)
  file_mibs = numbers(args.file_mib, "--file-mib", parser)
  thread_counts = numbers(args.threads, "--threads", parser, default="default")
  raw_counts = numbers(args.raw_threads, "--raw-threads", parser, zero=True)
  stagings = gigabytes(args.staging_gb, "--staging-gb", parser)
  parts = gigabytes(args.parts_gb, "--parts-gb", parser)
  if args.repeats < 1:
    parser.error(f"--repeats: 1 or more, not {args.repeats}")
  for d in args.dirs:
    if d.exists():
      parser.error(f"{d} exists: give a directory that does not (it is removed at the end)")
  from jmoe.checkpoint import writer
  raw_counts = sorted({n or writer.host_cores() for n in raw_counts})
  state = state_of(args.gib)
  nbytes = sum(x.get_value().nbytes for x in state.values())
  raw = plain_writes(state, args.dirs, file_mibs, raw_counts)  # (before the saves, and its
  for d in args.dirs:  # host copy of the state gone by then)
    try:
      for mib in file_mibs:
        writer.DATA_FILE_BYTES = mib * 2**20
        # (the parts of a save not staged; a staged one takes its own)
        runs = [(t, g, p) for t in thread_counts for g in stagings
                for p in (parts if not g else [None])]
        for threads, staging, part in runs:
          common = {"dir": str(d), "file_mib": mib, "threads": threads or "default",
                    "staging_gb": staging, "parts_gb": part}
          for line in saves(state, nbytes, d, threads, args.repeats, staging, part or 0.0):
            print(json.dumps({**common, "state_gib": round(nbytes / 2**30, 2), **line,
                              "gb_per_s": round(nbytes / line["seconds"] / 1e9, 2),
                              "raw_gb_per_s": raw[str(d), mib]}), flush=True)
          for line in removals(d, args.repeats):
            print(json.dumps({**common, **line}), flush=True)
    finally:
      shutil.rmtree(d, ignore_errors=True)
  return 0


def plain_writes(state, dirs, file_mibs, thread_counts) -> dict:
  """GB/s of plain file writes of `state`'s bytes (fetched to the host first) into each of `dirs`
  by file size and thread count: {(dir, file MiB): {threads: GB/s}}."""
  import numpy as np
  host = {name: np.asarray(x.get_value()) for name, x in state.items()}
  nbytes = sum(x.nbytes for x in host.values())
  out = {}
  for d in dirs:
    for mib in file_mibs:
      try:
        out[str(d), mib] = {n: round(nbytes / raw_write(host, d, mib * 2**20, n) / 1e9, 2)
                            for n in thread_counts}
      finally:
        shutil.rmtree(d, ignore_errors=True)
  return out


def saves(state, nbytes: int, d: pathlib.Path, threads: int | None, repeats: int,
          staging_gb: float = 0.0, parts_gb: float = 0.0) -> list[dict]:
  """`repeats` saves of `state` (`nbytes`) into `d` as a run's last (see above), each kept: their
  times."""
  from jmoe.checkpoint import Checkpointer
  checkpointer = Checkpointer(d, keep=repeats, waited_write_threads=threads or 0,
                              staging_gb=staging_gb, waited_parts_gb=parts_gb)
  out = []
  try:
    checkpointer.reserve_host_memory(state)
    checkpointer.wait_reserved()
    for repeat in range(repeats):
      started = time.perf_counter()
      checkpointer.save(repeat + 1, state, waited=True)
      to_host = time.perf_counter() - started
      checkpointer.wait()
      seconds = time.perf_counter() - started
      out.append({"repeat": repeat, "seconds": round(seconds, 2), "to_host_s": round(to_host, 2),
                  "write_s": round(seconds - to_host, 2),
                  # (none where `save` returns written: staged, in parts)
                  "write_gb_per_s": (None if staging_gb or parts_gb else
                                     round(nbytes / (seconds - to_host) / 1e9, 2)),
                  **checkpointer.last_save.seconds(),
                  "on_disk_gib": round(on_disk(d / str(repeat + 1)) / 2**30, 2)})
  finally:
    checkpointer.close()
  return out


def removals(d: pathlib.Path, repeats: int) -> list[dict]:
  """Each saved step in `d` removed and timed: by half this host's cores (at most 16), then by
  one, alternately."""
  from jmoe.checkpoint.writer import host_cores
  out = []
  for repeat in range(repeats):
    step = d / str(repeat + 1)
    threads = min(16, max(1, host_cores() // 2)) if repeat % 2 == 0 else 1
    gib = on_disk(step) / 2**30
    out.append({"removed": repeat + 1, "removed_gib": round(gib, 2), "remove_threads": threads,
                "remove_s": round(remove(step, threads), 2)})
  return out


def on_disk(directory: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def remove(directory: pathlib.Path, threads: int) -> float:
  """Seconds to remove `directory` as jmoe removes an old step: its files unlinked by `threads`
  threads, then the rest (jmoe/checkpoint/remover.py)."""
  from jmoe.checkpoint.remover import remove_in_parallel
  started = time.perf_counter()
  remove_in_parallel(directory, threads)
  return time.perf_counter() - started


if __name__ == "__main__":
  sys.exit(main())
