"""How fast TensorStore writes one array uncompressed as jmoe's checkpoints store it (zarr3 in an
OCDBT database, data files of 64 MiB, each of TensorStore's pools as wide as in a save the run
waits for), by the shape of its chunks, beside plain file writes of the same bytes.

  python scripts/chunk_rate.py DIR [--shape 8,64,2048,768]
      [--chunks 1,1,2048,768:1,64,2048,768:2,64,2048,768] [--threads 0] [--repeats 3]

The array holds 2-byte elements (as bf16 weights and moments), random, in host memory. Each write
hands TensorStore the whole array at once and lets it keep a reference to it rather than copy it
into its chunk cache (`can_reference_source_data_indefinitely`, as Orbax writes a host copy of a
jax.Array), then once more without (`by_reference` false). What it shows: TensorStore stores a
chunk straight from the caller's memory only where the chunk's layout passes its own test of
contiguity, which a chunk with an axis of length 1 fails (that axis is given a stride of 0, and
the test compares every axis's stride): such a chunk is copied, run by run, into the encoder's
buffer before it is written. The default chunks: one layer and one expert (as jmoe stores a
stacked variable), one layer of all experts (contiguous in memory, but with an axis of length 1),
two layers of all experts (contiguous, no such axis). The plain writes (`plain`) are files of 64
MiB by `--threads` threads (0: three per core, as a waited save's pools). One JSON line per
write; DIR is removed at the end, and on an error.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from save_rate import numbers, raw_write


def spec(directory: pathlib.Path, shape: tuple[int, ...], chunk: tuple[int, ...],
         file_bytes: int) -> dict:
  """The TensorStore spec of an uncompressed zarr3 array of 2-byte elements chunked by `chunk`,
  in an OCDBT database in `directory` whose data files aim at `file_bytes`."""
  return {"driver": "zarr3", "create": True, "delete_existing": True,
          "kvstore": {"driver": "ocdbt", "base": {"driver": "file", "path": str(directory)},
                      "target_data_file_size": file_bytes},
          "metadata": {"shape": list(shape), "data_type": "uint16",
                       "chunk_grid": {"name": "regular",
                                      "configuration": {"chunk_shape": list(chunk)}},
                       "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]}}


def tensorstore_write(array, directory: pathlib.Path, chunk: tuple[int, ...], threads: int,
                      by_reference: bool) -> float:
  """Seconds to write `array` to a fresh zarr3 array chunked by `chunk` in `directory`."""
  import tensorstore as ts
  from jmoe.checkpoint.writer import DATA_FILE_BYTES
  shutil.rmtree(directory, ignore_errors=True)
  context = ts.Context({"data_copy_concurrency": {"limit": threads},
                        "file_io_concurrency": {"limit": threads}})
  started = time.perf_counter()
  store = ts.open(spec(directory, array.shape, chunk, DATA_FILE_BYTES), context=context).result()
  store.write(array, can_reference_source_data_indefinitely=by_reference).result()
  return time.perf_counter() - started


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dir", type=pathlib.Path,
                      help="where to write (a directory of its own, removed at the end)")
  parser.add_argument("--shape", default="8,64,2048,768")
  parser.add_argument("--chunks", default="1,1,2048,768:1,64,2048,768:2,64,2048,768",
                      help="chunk shapes to time, separated by ':'")
  parser.add_argument("--threads", type=int, default=0)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  shape = tuple(numbers(args.shape, "--shape", parser))
  chunks = [tuple(numbers(text, "--chunks", parser)) for text in args.chunks.split(":")]
  for chunk in chunks:
    if len(chunk) != len(shape) or any(c > s for c, s in zip(chunk, shape)):
      parser.error(f"--chunks: {','.join(map(str, chunk))} is not a chunk of an array of shape "
                   f"{','.join(map(str, shape))} (as many axes, none longer)")
  if args.threads < 0:
    parser.error(f"--threads: 0 (three per core) or more, not {args.threads}")
  if args.repeats < 1:
    parser.error(f"--repeats: 1 or more, not {args.repeats}")
  if args.dir.exists():
    parser.error(f"{args.dir} exists: give a directory that does not (it is removed at the end)")
  import numpy as np
  from jmoe.checkpoint.writer import DATA_FILE_BYTES, waited_threads
  threads = args.threads or waited_threads(0)
  array = np.random.default_rng(0).integers(0, 2**16, size=shape, dtype=np.uint16)
  gb = array.nbytes / 1e9
  common = {"shape": list(shape), "gib": round(array.nbytes / 2**30, 3), "threads": threads}
  try:
    for repeat in range(args.repeats):
      shutil.rmtree(args.dir, ignore_errors=True)  # (the last TensorStore write's)
      seconds = raw_write({"array": array}, args.dir, DATA_FILE_BYTES, threads)
      print(json.dumps({**common, "plain": True, "repeat": repeat, "seconds": round(seconds, 4),
                        "gb_per_s": round(gb / seconds, 3)}), flush=True)
      for chunk in chunks:
        for by_reference in (True, False):
          seconds = tensorstore_write(array, args.dir, chunk, threads, by_reference)
          print(json.dumps({**common, "chunk": list(chunk), "by_reference": by_reference,
                            "repeat": repeat, "seconds": round(seconds, 4),
                            "gb_per_s": round(gb / seconds, 3)}), flush=True)
  finally:
    shutil.rmtree(args.dir, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
