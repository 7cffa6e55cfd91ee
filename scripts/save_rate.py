"""How fast jmoe's Checkpointer writes a state of a given size, by the size of TensorStore's data
files (jmoe/checkpoint/writer.py DATA_FILE_BYTES), into the directories given, beside the rate
of plain file writes of the same bytes.

  python scripts/save_rate.py [--gib 18] [--file-mib 2048,64,16] [--repeats 2] DIR [DIR ...]

The state is a Qwen3-30B-A3B-like stack of expert weights (bf16) and AdamW moments (float32),
random, on the default device, each array a Variable whose leading axes are layers and experts,
so that it is stored one (layer, expert) chunk at a time as a train state's expert weights are
(until 2026-12-06 they were plain arrays, each stored as one chunk). A save copies it to the host
and writes it as training does (in the foreground, so the time is the save's: uncompressed, as
a save training waits for). Each save is timed, then removed; then the same bytes, fetched to
the host, are written as plain files of the data file size by a thread per core (`raw_*`: what
the file system and the host's memory allow) and removed. Prints one JSON line per save: the
directory, the data file size, the seconds, GB/s, the size on disk and the raw write's figures.
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


def raw_write(arrays, directory: pathlib.Path, file_bytes: int) -> float:
  """Seconds to fetch `arrays` to the host and write their bytes as plain files of
  `file_bytes` in `directory` (made, then removed), a thread per core."""
  import concurrent.futures
  import numpy as np
  from jmoe.checkpoint.writer import host_cores

  def write(job):
    name, part, view = job
    with open(directory / f"{name}.{part}", "wb") as f:
      f.write(view)

  directory.mkdir(parents=True)
  started = time.perf_counter()
  jobs = []
  for name, x in arrays.items():
    data = memoryview(np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8))
    jobs += [(name, i // file_bytes, data[i:i + file_bytes])
             for i in range(0, len(data), file_bytes)]
  with concurrent.futures.ThreadPoolExecutor(host_cores()) as pool:
    list(pool.map(write, jobs))
  seconds = time.perf_counter() - started
  shutil.rmtree(directory)
  return seconds


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dirs", nargs="+", type=pathlib.Path,
                      help="where to write (a directory of its own: it is removed after each save)")
  parser.add_argument("--gib", type=float, default=18.0)
  parser.add_argument("--file-mib", default="2048,64,16")
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args(argv)
  for d in args.dirs:
    if d.exists():
      parser.error(f"{d} exists: give a directory that does not (it is removed after each save)")
  from jmoe.checkpoint import Checkpointer, writer
  state = state_of(args.gib)
  arrays = {name: x.get_value() for name, x in state.items()}
  nbytes = sum(x.nbytes for x in arrays.values())
  for d in args.dirs:
    for mib in (int(m) for m in args.file_mib.split(",")):
      for repeat in range(args.repeats):
        writer.DATA_FILE_BYTES = mib * 2**20
        checkpointer = Checkpointer(d, keep=1, async_save=False)
        started = time.perf_counter()
        checkpointer.save(1, state)
        checkpointer.wait()
        seconds = time.perf_counter() - started
        checkpointer.close()
        on_disk = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        shutil.rmtree(d)
        raw = raw_write(arrays, d, mib * 2**20)
        print(json.dumps({"dir": str(d), "file_mib": mib, "repeat": repeat,
                          "state_gib": round(nbytes / 2**30, 2), "seconds": round(seconds, 2),
                          "gb_per_s": round(nbytes / seconds / 1e9, 2),
                          "on_disk_gib": round(on_disk / 2**30, 2),
                          "raw_seconds": round(raw, 4),
                          "raw_gb_per_s": round(nbytes / raw / 1e9, 2)}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
