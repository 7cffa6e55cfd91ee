"""GPU kernels against float32 references; exits non-zero, naming the failing case, when one fails.

  python scripts/check_gpu.py [--quick] [--backends mosaic,ragged_dot] [--rows 16384] [--shapes a,b]
      [--workers 8] [--fp8]

Grouped GEMMs: for each backend, each shape class (Qwen3-30B-A3B's up and down projections, the
other families' expert shapes, LoRA factors, and a small shape no tile divides) and each routing
(balanced, skewed: busiest expert about 5x the mean, and empty experts with rows past the groups),
the forward output, the input gradient and every expert's weight gradient are compared with a
float32 reference computed expert by expert on the same bf16 inputs. A case passes when each
relative (Frobenius) error is at most 3e-3, the rows past the groups are exactly zero in the output
and the input gradient, and an expert with no rows has an exactly zero weight gradient; the same
under vmap (two routings at once, and one), as pipeline stages run the experts.
Attention (scripts/check_gpu_attention.py): cuDNN's kernels through jmoe's attention (windows,
sinks, packed documents, a window chosen at run time, latent attention's narrower values) against
plain float32 softmax attention, the output and every gradient (the sinks' too) within 2e-2, at
4096 and 8192 tokens; then the model's logits with cuDNN's kernel against XLA's, in bf16. `--quick` checks `moe.gemm=auto`'s
backend on one routing per shape class (4096 rows) and two attention cases. The grouped GEMM
cases run on `--workers` threads, so that their compiles overlap; the attention cases one at a
time. `--fp8`: also the FP8 kernels of moe.gemm=mosaic, cases fp8_* (scripts/check_gpu_fp8.py
says what they hold). Prints one JSON line per case;
`moe.gemm=auto` must pick a backend that passed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import sys
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

TOLERANCE = 3e-3
SHAPES = {"up": (128, 2048, 1536), "down": (128, 768, 2048), "odd": (6, 96, 80),  # E, D, F
          # LoRA factors of rank 16 on the up projection: x.A, then (x.A).B
          "adapter_a": (128, 2048, 16), "adapter_b": (128, 16, 1536),
          # the other families' expert shapes (their default or tuned tiles)
          "gpt_oss_up": (32, 2880, 5760), "gpt_oss_down": (32, 2880, 2880),
          "deepseek_up": (64, 7168, 4096), "deepseek_down": (64, 2048, 7168),
          "mixtral_up": (8, 4096, 28672), "mixtral_down": (8, 14336, 4096),
          "qwen3_235b_up": (128, 4096, 3072),
          "qwen3_235b_down": (128, 1536, 4096)}
ROUTINGS = ("balanced", "skewed", "empty")
# --quick: one routing per shape, each shape class once
QUICK_CASES = (("up", "empty"), ("odd", "empty"), ("gpt_oss_down", "skewed"),
               ("deepseek_up", "balanced"))


def named(run: Callable[[], dict], check: str) -> Callable[[], dict]:
  """`run` (one case's check) timed, with an exception (a kernel that does not compile or run)
  turned into a failed case named `check`."""
  def job():
    started = time.perf_counter()
    try:
      result = run()
    except Exception as e:  # noqa: BLE001 - the case fails, the others go on
      result = {"check": check, "ok": False,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result
  return job


def run_jobs(jobs: list[Callable[[], dict]], workers: int) -> list[dict]:
  """The cases on `workers` threads, so that their compiles (XLA's, Mosaic's ptxas) overlap;
  most of a case's time is its compile. Each result is printed as it ends; the list is in the
  cases' order. A case's `seconds` is its wall time beside the others'. Not for cuDNN's
  attention: it captures CUDA graphs while building its plans, which failed on the H200
  ("capturing stream has unjoined work") with other threads' kernels running."""
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    futures = [pool.submit(job) for job in jobs]
    for future in concurrent.futures.as_completed(futures):
      print(json.dumps(future.result()), flush=True)
  return [future.result() for future in futures]


def relative_error(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def routing(kind: str, experts: int, rows: int, rng) -> np.ndarray:
  """Rows per expert: `balanced`, `skewed`, or `empty` (some experts without rows, and a tail of
  rows in no group)."""
  if kind == "balanced":
    return np.full(experts, rows // experts)
  if kind == "skewed":
    p = np.exp(1.2 * rng.standard_normal(experts))
    return rng.multinomial(rows, p / p.sum())
  p = np.exp(rng.standard_normal(experts))
  p[[0, experts // 2, experts - 1]] = 0
  return rng.multinomial(rows - rows // 8, p / p.sum())


def reference(x, w, dy, sizes, block: int = 512) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """float32 y = x . w[e], dx = dy . w[e]^T and dw[e] = x_e^T . dy_e for each expert e's rows
  (`sizes`: rows per expert, in order; rows past the groups get zeros), as numpy arrays. Computed
  on the default device in float32 (Precision.HIGHEST: no tensor-core rounding), `block` rows of
  one expert at a time (the last block of each expert padded with zero rows), so that every
  product is that expert's alone and no more than the inputs' float32 copies, the outputs and one
  block are held: on the H200's host cores the same sums, expert by expert in numpy, took 80 s of
  a Mixtral-sized case's 82 (2026-12-05)."""
  sizes = np.asarray(sizes)
  ends = np.cumsum(sizes)
  tiles = [(e, first, min(block, end - first)) for e, end in enumerate(ends)
           for first in range(end - sizes[e], end, block)]
  if not tiles:  # no expert has rows: every product is empty
    return (np.zeros((x.shape[0], w.shape[2]), np.float32),
            np.zeros(x.shape, np.float32), np.zeros(w.shape, np.float32))
  expert_T, first_T, count_T = (np.asarray(column, np.int32) for column in zip(*tiles))
  slot_B = np.arange(block)
  # Tile t's slot b holds row first[t] + b; x.shape[0] marks a padding slot.
  source_TB = np.where(slot_B < count_T[:, None], first_T[:, None] + slot_B, x.shape[0])
  return tuple(np.asarray(a) for a in jax.device_get(
      _tiled_reference(x, w, dy, expert_T, source_TB.astype(np.int32))))


@jax.jit
def _tiled_reference(x, w, dy, expert_T, source_TB):
  x, w, dy = (a.astype(jnp.float32) for a in (x, w, dy))
  rows = x.shape[0]
  dot = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)

  def tile(carry, t):
    y, dx, dw = carry
    e, source_B = expert_T[t], source_TB[t]
    padding_B1 = (source_B == rows)[:, None]
    x_B, dy_B = (jnp.where(padding_B1, 0, a[jnp.minimum(source_B, rows - 1)]) for a in (x, dy))
    y = y.at[source_B].set(dot(x_B, w[e]), mode="drop")  # (padding slots: out of range)
    dx = dx.at[source_B].set(dot(dy_B, w[e].T), mode="drop")
    return (y, dx, dw.at[e].add(dot(x_B.T, dy_B))), None

  zeros = (jnp.zeros(dy.shape), jnp.zeros(x.shape), jnp.zeros(w.shape))
  return jax.lax.scan(tile, zeros, jnp.arange(len(expert_T)))[0]


def case(shape: str, kind: str, rows: int, seed: int):
  """Inputs, routing and the float32 reference of one case."""
  experts, d, f = SHAPES[shape]
  rows = rows if shape != "odd" else 300
  rng = np.random.default_rng(seed)
  sizes = routing(kind, experts, rows, rng).astype(np.int32)
  keys = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(keys[0], (rows, d), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (experts, d, f), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
  dy = jax.random.normal(keys[2], (rows, f), jnp.bfloat16)
  return (x, w, dy, sizes), reference(x, w, dy, sizes)


def check_backend(gemm, inputs, expected) -> dict:
  x, w, dy, sizes = inputs
  y, vjp = jax.vjp(lambda x, w: gemm(x, w, jnp.asarray(sizes)), x, w)
  return compare(jax.device_get((y, *vjp(dy))), sizes, expected)


def compare(outputs, sizes, expected) -> dict:
  """One case's y, dx and dw against its reference."""
  y, dx, dw = outputs
  y_ref, dx_ref, dw_ref = expected
  tail = int(sizes.sum())
  per_expert = [relative_error(dw[e], dw_ref[e]) for e in range(len(sizes)) if sizes[e]]
  result = {"rows": len(y), "out": relative_error(y[:tail], y_ref[:tail]),
            "dx": relative_error(dx[:tail], dx_ref[:tail]), "dw": relative_error(dw, dw_ref),
            "dw_worst_expert": max(per_expert),
            "empty_experts_zero": bool(all(np.all(dw[e] == 0) for e in range(len(sizes))
                                           if not sizes[e])),
            "rows_past_groups_zero": bool(np.all(y[tail:] == 0) and np.all(dx[tail:] == 0))}
  result["ok"] = bool(max(result["out"], result["dx"], result["dw_worst_expert"]) <= TOLERANCE
                      and result["empty_experts_zero"] and result["rows_past_groups_zero"])
  return result


def grouped_gemm_jobs(backends: list[str], rows: int, cases=None) -> list[Callable[[], dict]]:
  """Every backend on `cases` ((shape, routing) pairs; default: every shape on every routing),
  one job per case and backend."""
  from jmoe.ops.grouped_gemm import GEMM_BACKENDS
  cases = cases or [(shape, kind) for shape in SHAPES for kind in ROUTINGS]
  prepared: dict[tuple[str, str], tuple] = {}
  lock = threading.Lock()

  def inputs_of(shape, kind):  # built once per case, shared by the backends' jobs
    with lock:
      if (shape, kind) not in prepared:
        prepared[shape, kind] = case(shape, kind, rows, ROUTINGS.index(kind))
      return prepared[shape, kind]

  def job(shape, kind, name):
    def run():
      inputs, expected = inputs_of(shape, kind)
      return {"check": f"grouped_gemm/{name}/{shape}/{kind}",
              **check_backend(jax.jit(GEMM_BACKENDS[name]), inputs, expected)}
    return named(run, f"grouped_gemm/{name}/{shape}/{kind}")

  return [job(shape, kind, name) for shape, kind in cases for name in backends]


def vmapped_jobs(backends: list[str], rows: int, counts=(2, 1)) -> list[Callable[[], dict]]:
  """Each backend under vmap, as pipeline stages run their layers (vmapped over the stage axis):
  a batch of two cases, each with its own routing, and a batch of one, against the references."""
  from jmoe.ops.grouped_gemm import GEMM_BACKENDS
  pair = functools.cache(
      lambda: [case("down", kind, rows, seed) for seed, kind in ((3, "skewed"), (4, "empty"))])
  lock = threading.Lock()

  def job(name, count):
    def run():
      with lock:
        cases = pair()
      batched = jax.jit(jax.vmap(GEMM_BACKENDS[name]))
      x, w, dy, sizes = (jnp.stack([inputs[i] for inputs, _ in cases[:count]]) for i in range(4))
      y, vjp = jax.vjp(lambda x, w: batched(x, w, sizes), x, w)
      outputs = jax.device_get((y, *vjp(dy)))
      results = [compare([a[b] for a in outputs], cases[b][0][3], cases[b][1])
                 for b in range(count)]
      worst = max(results, key=lambda r: max(r["out"], r["dx"], r["dw_worst_expert"]))
      return {"check": f"grouped_gemm_vmapped/{name}/batch{count}", **worst,
              "ok": all(r["ok"] for r in results)}
    return named(run, f"grouped_gemm_vmapped/{name}/batch{count}")

  return [job(name, count) for name in backends for count in counts]


def main(argv: list[str] | None = None) -> int:
  from jmoe.ops.grouped_gemm import GEMM_BACKENDS, auto_gemm
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--backends", default=",".join(n for n in GEMM_BACKENDS if n != "dense"),
                      help="grouped GEMM backends to check (comma-separated)")
  parser.add_argument("--rows", type=int, help="routed rows per GEMM (default 16384; with "
                      "--quick 4096)")
  parser.add_argument("--no-attention", action="store_true")
  parser.add_argument("--shapes", help="comma-separated expert shapes to check, each on every "
                      f"routing (default: all of {', '.join(SHAPES)})")
  parser.add_argument("--quick", action="store_true",
                      help="moe.gemm=auto's backend on one routing per shape class, the vmapped "
                      "pair, and two attention cases")
  parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                      help="cases checked at once (their compiles overlap)")
  parser.add_argument("--fp8", action="store_true", help="also the FP8 grouped GEMM kernels")
  args = parser.parse_args(argv)
  if args.shapes:
    unknown = sorted(set(args.shapes.split(",")) - set(SHAPES))
    if unknown:
      parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    cases = [(shape, kind) for shape in args.shapes.split(",") for kind in ROUTINGS]
  else:
    cases = QUICK_CASES if args.quick else None
  unknown = sorted(set(args.backends.split(",")) - set(GEMM_BACKENDS))
  if unknown:
    parser.error(f"unknown backends {unknown}; known: {', '.join(GEMM_BACKENDS)}")
  print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                    "auto": auto_gemm()}))
  backends = [auto_gemm()] if args.quick else args.backends.split(",")
  args.rows = args.rows or (4096 if args.quick else 16384)
  started = time.perf_counter()
  results = []
  if not args.no_attention:  # one at a time, alone on the GPU: see run_jobs
    from check_gpu_attention import ATTENTION_CASES, QUICK_ATTENTION, attention_jobs
    results += run_jobs(attention_jobs(QUICK_ATTENTION if args.quick else ATTENTION_CASES), 1)
  results += run_jobs(grouped_gemm_jobs(backends, args.rows, cases)
                      + vmapped_jobs(backends, args.rows, (2,) if args.quick else (2, 1)),
                      args.workers)
  if args.fp8:
    from check_gpu_fp8 import FP8_SHAPES, fp8_jobs
    shapes = [s for s in FP8_SHAPES if not args.shapes or s in args.shapes.split(",")]
    results += run_jobs(fp8_jobs(args.rows, shapes, timed=args.workers == 1), args.workers)
  if not args.no_attention and not args.quick:
    from check_gpu_attention import check_attention
    for r in check_attention():
      print(json.dumps(r), flush=True)
      results.append(r)
  failed = [r["check"] for r in results if not r["ok"]]
  auto_checked = [r for r in results if r["check"].startswith(f"grouped_gemm/{auto_gemm()}/")]
  if auto_gemm() in backends and not auto_checked:
    failed.append(f"moe.gemm=auto ({auto_gemm()}) was not checked")
  print(json.dumps({"failed": failed, "ok": not failed,
                    "seconds": round(time.perf_counter() - started, 1)}))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
