"""GPU kernels against float32 references; exits non-zero, naming the failing case, when one fails.

  python scripts/check_gpu.py [--backends mosaic,ragged_dot] [--rows 16384]

Grouped GEMMs: for each backend, each shape class (Qwen3-30B-A3B's up and down projections, and a
small shape no tile divides) and each routing (balanced, skewed: busiest expert about 5x the mean,
and empty experts with rows past the groups), the forward output, the input gradient and every
expert's weight gradient are compared with a float32 reference computed expert by expert on the
same bf16 inputs. A case passes when each relative (Frobenius) error is at most 3e-3, the rows
past the groups are exactly zero in the output and the input gradient, and an expert with no rows
has an exactly zero weight gradient; the same under vmap (two routings at once, and one), as
pipeline stages run the experts. Attention: the model's logits with cuDNN's kernel against
XLA's, in bf16. Prints one JSON line per case; `moe.gemm=auto` must pick a backend that passed.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

TOLERANCE = 3e-3
SHAPES = {"up": (128, 2048, 1536), "down": (128, 768, 2048), "odd": (6, 96, 80),  # E, D, F
          # LoRA factors of rank 16 on the up projection: x.A, then (x.A).B
          "adapter_a": (128, 2048, 16), "adapter_b": (128, 16, 1536)}


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


def reference(x, w, dy, sizes):
  """float32 y, dx and dw, expert by expert."""
  x, w, dy = (np.asarray(a, np.float32) for a in (x, w, dy))
  y, dx, dw = np.zeros_like(dy), np.zeros_like(x), np.zeros_like(w)
  start = 0
  for e, n in enumerate(sizes):
    rows = slice(start, start + n)
    y[rows] = x[rows] @ w[e]
    dx[rows] = dy[rows] @ w[e].T
    dw[e] = x[rows].T @ dy[rows]
    start += n
  return y, dx, dw


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


def check_grouped_gemms(backends: list[str], rows: int) -> list[dict]:
  from jmoe.ops.grouped_gemm import GEMM_BACKENDS
  gemms = {name: jax.jit(GEMM_BACKENDS[name]) for name in backends}
  out = []
  for shape in SHAPES:
    for seed, kind in enumerate(("balanced", "skewed", "empty")):
      inputs, expected = case(shape, kind, rows, seed)
      for name, gemm in gemms.items():
        check = f"grouped_gemm/{name}/{shape}/{kind}"
        try:
          out.append({"check": check, **check_backend(gemm, inputs, expected)})
        except Exception as e:  # a kernel that does not run fails its case
          out.append({"check": check, "ok": False,
                      "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
        print(json.dumps(out[-1]), flush=True)
  return out


def check_vmapped(backends: list[str], rows: int) -> list[dict]:
  """Each backend under vmap, as pipeline stages run their layers (vmapped over the stage axis):
  a batch of two cases, each with its own routing, and a batch of one, against the references."""
  from jmoe.ops.grouped_gemm import GEMM_BACKENDS
  pair = [case("down", kind, rows, seed) for seed, kind in ((3, "skewed"), (4, "empty"))]
  out = []
  for name in backends:
    batched = jax.jit(jax.vmap(GEMM_BACKENDS[name]))
    for count in (2, 1):
      x, w, dy, sizes = (jnp.stack([inputs[i] for inputs, _ in pair[:count]]) for i in range(4))
      check = f"grouped_gemm_vmapped/{name}/batch{count}"
      try:
        y, vjp = jax.vjp(lambda x, w: batched(x, w, sizes), x, w)
        outputs = jax.device_get((y, *vjp(dy)))
        results = [compare([a[b] for a in outputs], pair[b][0][3], pair[b][1])
                   for b in range(count)]
        worst = max(results, key=lambda r: max(r["out"], r["dx"], r["dw_worst_expert"]))
        out.append({"check": check, **worst, "ok": all(r["ok"] for r in results)})
      except Exception as e:  # a kernel that cannot be vmapped fails its case
        out.append({"check": check, "ok": False,
                    "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
      print(json.dumps(out[-1]), flush=True)
  return out


def check_attention() -> list[dict]:
  """The model's logits with cuDNN attention against XLA attention, bf16, for each variant."""
  sys.path.insert(0, "tests")
  from flax import nnx
  from helpers import tiny_config
  from jmoe.model.factory import model_factory
  variants = {
      "causal": {}, "window": dict(sliding_window=16),
      "sinks_alternating": dict(attention_sinks=True, sliding_window=16, full_attention_every=2),
      "mla": dict(attention="mla", mla=dict(q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
                                            qk_rope_head_dim=16, v_head_dim=16)),
  }
  tokens = np.random.default_rng(0).integers(0, 256, (2, 128))
  segments = np.repeat(np.arange(1, 5), 32)[None].repeat(2, 0)
  positions = np.tile(np.arange(32), 4)[None].repeat(2, 0)
  out = []
  for name, model_cfg in variants.items():
    for packed in (False, True):
      logits, fused = {}, False
      for kernel in ("xla", "cudnn"):
        config = tiny_config(model=dict(model_cfg, attention_kernel=kernel, head_dim=64,
                                        num_heads=4, num_kv_heads=2, d_model=128),
                             precision=dict(params="float32", compute="bfloat16"))
        graphdef, state = nnx.split(model_factory(config)())
        forward = jax.jit(lambda state, *a: nnx.merge(graphdef, state)(*a)[0])
        args = (tokens, positions, segments) if packed else (tokens,)
        compiled = forward.lower(state, *args).compile()
        if kernel == "cudnn":
          fused = "fmha" in compiled.as_text()  # cuDNN's fused attention custom call
        logits[kernel] = compiled(state, *args)
      error = relative_error(logits["cudnn"], logits["xla"])
      out.append({"check": f"attention/{name}{'_packed' if packed else ''}",
                  "cudnn_used": fused, "cudnn_vs_xla": error, "ok": error < 2e-2})
  return out


def main(argv: list[str] | None = None) -> int:
  from jmoe.ops.grouped_gemm import GEMM_BACKENDS, auto_gemm
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--backends", default=",".join(n for n in GEMM_BACKENDS if n != "dense"),
                      help="grouped GEMM backends to check (comma-separated)")
  parser.add_argument("--rows", type=int, default=16384, help="routed rows per GEMM")
  parser.add_argument("--no-attention", action="store_true")
  args = parser.parse_args(argv)
  print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                    "auto": auto_gemm()}))
  results = check_grouped_gemms(args.backends.split(","), args.rows)
  results += check_vmapped(args.backends.split(","), args.rows)
  if not args.no_attention:
    for r in check_attention():
      print(json.dumps(r), flush=True)
      results.append(r)
  failed = [r["check"] for r in results if not r["ok"]]
  auto_checked = [r for r in results if r["check"].startswith(f"grouped_gemm/{auto_gemm()}/")]
  if auto_gemm() in args.backends.split(",") and not auto_checked:
    failed.append(f"moe.gemm=auto ({auto_gemm()}) was not checked")
  print(json.dumps({"failed": failed, "ok": not failed}))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
