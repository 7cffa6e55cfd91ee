"""How fast jmoe's Checkpointer writes a state of a given size, by the size of TensorStore's data
files (jmoe/checkpoint/manager.py DATA_FILE_BYTES), into the directories given.

  python scripts/save_rate.py [--gib 18] [--file-mib 2048,64,16] [--repeats 2] DIR [DIR ...]

The state is a Qwen3-30B-A3B-like stack of expert weights (bf16) and AdamW moments (float32),
random, on the default device: a save copies it to the host and writes it as training does (in
the foreground, so the time is the save's). Each save is timed, then removed. Prints one JSON
line per save: the directory, the data file size, the seconds, GB/s and the size on disk.
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
  layers, experts, width = 8, 128, 2048
  # per layer and expert: two bf16 weights and two float32 moments of width x hidden each
  hidden = max(1, round(gib * 2**30 / (layers * experts * width * 12)))
  keys = jax.random.split(jax.random.key(0), 4)
  draw = lambda key, dtype: (0.02 * jax.random.normal(
      key, (layers, experts, width, hidden), jnp.float32)).astype(dtype)
  state = {"w_up": draw(keys[0], jnp.bfloat16), "w_down": draw(keys[1], jnp.bfloat16),
           "mu": draw(keys[2], jnp.float32), "nu": jnp.square(draw(keys[3], jnp.float32))}
  return jax.block_until_ready(state)


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
  from jmoe.checkpoint import Checkpointer, manager
  state = state_of(args.gib)
  nbytes = sum(x.nbytes for x in state.values())
  for d in args.dirs:
    for mib in (int(m) for m in args.file_mib.split(",")):
      for repeat in range(args.repeats):
        manager.DATA_FILE_BYTES = mib * 2**20
        checkpointer = Checkpointer(d, keep=1, async_save=False)
        started = time.perf_counter()
        checkpointer.save(1, state)
        checkpointer.wait()
        seconds = time.perf_counter() - started
        checkpointer.close()
        on_disk = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        print(json.dumps({"dir": str(d), "file_mib": mib, "repeat": repeat,
                          "state_gib": round(nbytes / 2**30, 2), "seconds": round(seconds, 2),
                          "gb_per_s": round(nbytes / seconds / 1e9, 2),
                          "on_disk_gib": round(on_disk / 2**30, 2)}), flush=True)
        shutil.rmtree(d)
  return 0


if __name__ == "__main__":
  sys.exit(main())
