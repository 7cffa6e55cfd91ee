"""Host memory of Hugging Face conversion, measured: peak resident memory of import-hf and export-hf
on a generated checkpoint, against the size of the model and of its largest tensor.

  python scripts/conversion_memory.py --config configs/qwen3_30b_a3b.py --work /tmp/conv \\
      [--config.model.num_layers=4 ...]

Writes a random model of the config as a Hugging Face directory (bf16), then runs
`python -m jmoe.convert import-hf` and `export-hf` on it, each in a process of its own, and prints
one JSON line: the checkpoint's bytes, its largest tensor's, the largest layer of one jmoe variable
(at most what either command converts at once, in bf16), and each command's peak resident set
(ru_maxrss of the child) and wall time. Both commands hold a few of those parts whatever the
model's size; export-hf also the safetensors file it is filling (`--shard-gb`, 1 here).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child_peak(args: list[str]) -> tuple[int, float]:
  """(peak resident bytes, seconds) of `python ARGS` (`-m module ...` or `-c code`) in a child
  process of its own, which reports its own ru_maxrss."""
  if args[0] == "-m":
    body = f"sys.argv = {[args[1], *args[2:]]!r}; runpy.run_module({args[1]!r}, run_name='__main__')"
  else:
    body = args[1]
  code = (f"import resource, runpy, sys\ntry:\n  {body}\nfinally:\n  print('MAXRSS', "
          f"resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
  t0 = time.perf_counter()
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
  lines = [l for l in done.stderr.splitlines() if l.startswith("MAXRSS ")]
  if done.returncode or not lines:
    raise SystemExit(f"{' '.join(args[:3])} failed:\n{done.stderr[-3000:]}")
  return int(lines[-1].split()[1]) * 1024, time.perf_counter() - t0


def tensor_bytes(directory: pathlib.Path) -> list[int]:
  """The size of every tensor in a safetensors directory, from the files' headers."""
  from safetensors import safe_open
  itemsize = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "U8": 1}
  out = []
  for path in sorted(directory.glob("*.safetensors")):
    with safe_open(path, "np") as f:
      for name in f.keys():
        piece = f.get_slice(name)
        out.append(int(np_prod(piece.get_shape())) * itemsize[piece.get_dtype()])
  return out


def np_prod(shape) -> int:
  total = 1
  for n in shape:
    total *= n
  return total


def main(argv: list[str] | None = None) -> int:
  from jmoe.cli import split_overrides
  rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--work", required=True, help="an empty or new directory for the files")
  args = parser.parse_args(rest)
  from jmoe.cli import run
  from jmoe.outputs import check

  def new_work() -> int:  # the files it writes replace nothing of the user's
    check(args.work, directory=True, flag="--work")
    return 0

  refused = run(new_work)
  if refused:
    return refused
  work = pathlib.Path(args.work)
  work.mkdir(parents=True, exist_ok=True)
  # The generated checkpoint, in a child too, so that this process holds no model.
  generate = (f"sys.path.insert(0, {str(ROOT)!r}); from scripts.conversion_memory import "
              f"write_random; write_random({args.config!r}, {overrides!r}, "
              f"{str(work / 'hf')!r})")
  _, generate_s = child_peak(["-c", generate])
  sizes = tensor_bytes(work / "hf")
  part = largest_part_bytes(args.config, overrides)
  base_rss, _ = child_peak(["-c", "import jax, jmoe.hf.convert; jax.devices()"])
  import_rss, import_s = child_peak(["-m", "jmoe.convert", "import-hf", "--hf-dir",
                                     str(work / "hf"), "--out", str(work / "ckpt"),
                                     "--params-dtype", "bfloat16"])
  export_rss, export_s = child_peak(["-m", "jmoe.convert", "export-hf", "--checkpoint",
                                     str(work / "ckpt"), "--out", str(work / "back"),
                                     "--shard-gb", "1"])
  print(json.dumps({"config": args.config, "overrides": overrides,
                    "checkpoint_gb": round(sum(sizes) / 1e9, 6),
                    "largest_tensor_gb": round(max(sizes) / 1e9, 6),
                    "largest_part_gb": round(part / 1e9, 6),
                    "jax_process_rss_gb": round(base_rss / 1e9, 3),
                    "import_peak_rss_gb": round(import_rss / 1e9, 3), "import_s": round(import_s, 1),
                    "export_peak_rss_gb": round(export_rss / 1e9, 3), "export_s": round(export_s, 1),
                    "generate_s": round(generate_s, 1)}))
  return 0


def largest_part_bytes(config_path: str, overrides: list[str]) -> int:
  """Bytes of the largest layer of one jmoe variable (a whole variable when not stacked), bf16."""
  import jax
  from flax import nnx
  from jmoe.config import load_config
  from jmoe.model.factory import model_factory
  config = load_config(config_path, [*overrides, "precision.params=bfloat16"])
  stacked = ("dense_blocks", "moe_blocks")
  return max(np_prod(v.shape[1:] if str(path[0]) in stacked else v.shape) * 2
             for path, v in nnx.to_flat_state(nnx.state(nnx.eval_shape(model_factory(config)))))


def write_random(config_path: str, overrides: list[str], out: str) -> None:
  """A model of the config with random bf16 values (normal, std 0.02; made a layer at a time, so
  the host holds the model and one layer in float32), written as a Hugging Face directory."""
  import tempfile
  import jax
  import numpy as np
  from flax import nnx
  from jmoe.hf.convert import export_hf
  from jmoe.checkpoint.params import save_model
  from jmoe.config import load_config
  from jmoe.model.factory import model_factory
  config = load_config(config_path, [*overrides, "precision.params=bfloat16"])
  rng = np.random.default_rng(0)

  def random(leaf: jax.ShapeDtypeStruct) -> jax.Array:
    value = np.empty(leaf.shape, leaf.dtype)
    for part in (range(leaf.shape[0]) if value.ndim > 2 else [...]):
      value[part] = rng.standard_normal(value[part].shape, np.float32) * 0.02
    return jax.device_put(value)

  state = jax.tree.map(random, nnx.state(nnx.eval_shape(model_factory(config))))
  with tempfile.TemporaryDirectory(dir=pathlib.Path(out).parent) as tmp:
    save_model(pathlib.Path(tmp) / "ckpt", state, config)
    del state
    export_hf(pathlib.Path(tmp) / "ckpt", out, shard_bytes=2 << 30, overwrite=True)


if __name__ == "__main__":
  sys.exit(main())
