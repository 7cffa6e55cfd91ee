"""The FP8 grouped-GEMM kernels of moe.gemm=mosaic (jmoe/ops/fp8_mosaic.py) on a Hopper GPU.

  python scripts/check_gpu.py --fp8 [--rows 16384] [--shapes up,down] [--no-attention]
  python scripts/check_gpu_fp8.py [--quick] [--rows 16384] [--shapes up,odd] [--checks swiglu,gated]
                                  [--bench]

Kernel cases (fp8_kernels/SHAPE/ROUTING), on the balanced, skewed and empty-expert routings of
scripts/check_gpu.py (the last with rows past the groups): the operands are quantized here as
jmoe quantizes them (x per row and w per expert in E4M3; dy per row in E5M2 for the input
gradient; for the weight gradient dy x (x's row scale) with one E5M2 scale), the kernels run, the
scales are applied as jmoe's caller applies them, and each of y, dx and every expert's dw is
compared with a float32 reference computed expert by expert (check_gpu.reference: on the
device, at full float32 precision) from the same DEQUANTIZED values. So FP8's own rounding is
not in the error; what is left is the kernel's one rounding of its float32 accumulator to the
bf16 output (8 significant bits: half an ulp is 2^-9 to 2^-8 of a value; 1.66e-3 RMS relative,
measured with stand-in kernels that round the same way, tests/test_fp8_mosaic.py) and float32
summation order (~1e-6). The case passes at
FP8_TOLERANCE = 3e-3; a scale off by 2x on one expert's rows costs that expert 100% and the whole
output about 1/sqrt(E) of that (9% at 128 experts), rows taken from the wrong expert about 140%
(each case reports what doubling the busiest expert's scale would give, and fails if the
tolerance would not catch that by 10x). An expert with no rows must get an exactly zero weight
gradient (the kernel writes zeros).
End-to-end cases (fp8_grouped/SHAPE/ROUTING, the weight gradient in bf16, and
fp8_grouped_wfp8/..., in FP8): moe.gemm=mosaic with precision.gemm=fp8
(`grouped_gemm("mosaic", "e5m2", weight_gradient=...)`) against float32 on the unquantized bf16
inputs, within FP8's own error (5% forward, 12% gradients, as tests/test_fp8.py), with rows past
the groups exactly zero in y and dx: the wiring, the scales and the zeroing.
Kernel cases with every row-kernel call's sums promoted to float32 each K step
(fp8_kernels_promoted/SHAPE/ROUTING; `promoted_rows`, as precision.fp8_promote=always runs it;
the fp8_kernels cases run it, as the default `long` does, where the contraction is PROMOTE_FROM_K
or more; unpromoted there, Mixtral's up input gradient, K = 28,672, was 4.2e-3 off on the H200,
2026-12-05): the same tolerance. Blockwise cases
(fp8_blockwise/SHAPE/ROUTING): the row kernel with DeepSeek-V3's tile scales applied per K step,
forward and input gradient, on inputs whose tiles differ in magnitude (2^-4 to 2^4), against the
float32 reference of the dequantized tiles, with the same tolerance.
SwiGLU's backward pass with its quantization (fp8_swiglu/SHAPE/ROUTING): jmoe/ops/fp8_swiglu.py's
Triton kernels against the same arithmetic through XLA on the GPU, with each path's time; and the
first projection fused with SwiGLU end to end (fp8_gated/..., fp8_gated_wfp8/...: the weight
gradient in bf16 and in FP8) against float32 per expert, the forward within 8% (SwiGLU multiplies
two FP8 results). `--checks` picks the kinds of case.
`--bench`: TFLOP/s of the FP8 kernels beside the bf16 Mosaic kernels on the shapes asked (`odd`
left out); the forward and input gradient also promoted, and blockwise.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from check_gpu import ROUTINGS, SHAPES, named, reference, relative_error, routing, run_jobs

FP8_TOLERANCE = 3e-3
# Mixtral's both: the longest contractions (its down projection's forward, K = 14,336, and its
# up projection's input gradient, K = 28,672), where the accumulator's precision shows first.
FP8_SHAPES = ("up", "down", "odd", "mixtral_up", "mixtral_down")
E2E_FWD, E2E_GRAD = 0.05, 0.12


def quantized_case(shape: str, kind: str, rows: int, seed: int) -> dict:
  """bf16 inputs, their float8 forms and float32 scales, as jmoe's FP8 expert GEMMs make them."""
  from jmoe.ops.fp8 import E4M3, E5M2, amax, quantize, scale_for
  experts, d, f = SHAPES[shape]
  rows = rows if shape != "odd" else 300
  sizes = routing(kind, experts, rows, np.random.default_rng(seed)).astype(np.int32)
  keys = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(keys[0], (rows, d), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (experts, d, f), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
  dy = jax.random.normal(keys[2], (rows, f), jnp.bfloat16)
  s_x = scale_for(amax(x, axis=1, keepdims=True), E4M3)
  s_w = scale_for(amax(w, axis=(1, 2), keepdims=True), E4M3)
  s_dy = scale_for(amax(dy, axis=1, keepdims=True), E5M2)
  folded = dy.astype(jnp.float32) * s_x
  s_folded = scale_for(amax(folded), E5M2)
  return dict(sizes=sizes, x=x, w=w, dy=dy, s_x=s_x, s_w=s_w, s_dy=s_dy, s_folded=s_folded,
              x_q=quantize(x, s_x, E4M3), w_q=quantize(w, s_w, E4M3),
              dy_q=quantize(dy, s_dy, E5M2), folded_q=quantize(folded, s_folded, E5M2))


def host(a) -> np.ndarray:
  return np.asarray(jax.device_get(a), np.float32)


def expert_rows(sizes) -> list[slice]:
  ends = np.cumsum(sizes)
  return [slice(int(s), int(e)) for s, e in zip(ends - sizes, ends)]


def doubled_scale_error(y: np.ndarray, y_ref: np.ndarray, sizes) -> float:
  """The error y would have against y_ref with the busiest expert's scale doubled: what the
  tolerance must catch."""
  doubled = y.copy()
  doubled[expert_rows(sizes)[int(np.argmax(sizes))]] *= 2
  return relative_error(doubled, y_ref)


def kernel_case(c: dict, promote_from_k: int | None = None) -> dict:
  """The three kernels on one case, scaled as the caller scales them, against the dequantized
  float32 reference; the row kernels' sums promoted to float32 every K step in the calls that
  contract over `promote_from_k` or more (None: none; PROMOTE_SETTINGS' values)."""
  from jmoe.ops.fp8_mosaic import fp8_aligned_contract, fp8_ragged_dot, promotes
  sizes = c["sizes"]
  groups = jnp.asarray(sizes)
  row_expert = np.repeat(np.arange(len(sizes)), sizes)
  used = int(sizes.sum())
  s_x, s_dy, s_w = host(c["s_x"])[:used], host(c["s_dy"])[:used], host(c["s_w"])[:, 0, 0]
  # (as moe.gemm=mosaic decides: by each call's contraction, x_q's D and dy_q's F)
  promoted = [promotes(c[name].shape[1], promote_from_k) for name in ("x_q", "dy_q")]
  y = jax.jit(lambda x, w: fp8_ragged_dot(x, jnp.swapaxes(w, 1, 2), groups,
                                          promote=promoted[0]))(c["x_q"], c["w_q"])
  dx = jax.jit(lambda dy, w: fp8_ragged_dot(dy, w, groups, promote=promoted[1]))(
      c["dy_q"], c["w_q"])
  dw = jax.jit(lambda x, g: fp8_aligned_contract(x, g, groups))(c["x_q"], c["folded_q"])
  y = host(y)[:used] * s_x * s_w[row_expert][:, None]
  dx = host(dx)[:used] * s_dy * s_w[row_expert][:, None]
  dw = host(dw) * float(c["s_folded"])
  # the same float8 values, dequantized
  dequantized = lambda q, s: q.astype(jnp.float32) * s
  y_ref, dx_ref, _ = reference(dequantized(c["x_q"], c["s_x"]), dequantized(c["w_q"], c["s_w"]),
                               dequantized(c["dy_q"], c["s_dy"]), sizes)
  y_ref, dx_ref = y_ref[:used], dx_ref[:used]
  dw_ref = reference(c["x_q"], c["w_q"], c["folded_q"], sizes)[2] * float(c["s_folded"])
  per_expert = [relative_error(dw[e], dw_ref[e]) for e in range(len(sizes)) if sizes[e]]
  result = {"rows": used, "promoted": promoted, "out": relative_error(y, y_ref),
            "dx": relative_error(dx, dx_ref), "dw_worst_expert": max(per_expert),
            "doubled_scale_error": doubled_scale_error(y, y_ref, sizes),
            "empty_experts_zero": bool(all(np.all(dw[e] == 0) for e in range(len(sizes))
                                           if not sizes[e])),
            "finite": bool(np.all(np.isfinite(y)) and np.all(np.isfinite(dx))
                           and np.all(np.isfinite(dw)))}
  result["ok"] = bool(max(result["out"], result["dx"], result["dw_worst_expert"]) <= FP8_TOLERANCE
                      and result["doubled_scale_error"] > 10 * FP8_TOLERANCE
                      and result["empty_experts_zero"] and result["finite"])
  return result


def tile_magnitudes(a: jax.Array, tile: tuple[int, ...], seed: int) -> jax.Array:
  """`a` times a power of two from 2^-4 to 2^4 drawn per tile of shape `tile` (x and dy: 1 x 128
  pieces of each row; w: each expert's 128 x 128 tiles), so that tiles, rows and experts differ
  in scale and a scale read from the wrong one shows."""
  shape = [-(-n // t) for n, t in zip(a.shape, tile)]
  factor = 2.0 ** np.random.default_rng(seed).integers(-4, 5, shape)
  for axis, t in enumerate(tile):
    factor = np.repeat(factor, t, axis=axis)
  return (a.astype(jnp.float32) * factor[tuple(slice(0, n) for n in a.shape)]).astype(a.dtype)


def blockwise_case(c: dict) -> dict:
  """The row kernel with blockwise scales (precision.fp8_recipe=blockwise: x and dy in 1 x 128
  tiles, w in 128 x 128), forward and input gradient, against the float32 reference of the
  dequantized tiles, expert by expert. Every tile of the inputs is given a magnitude from 2^-4
  to 2^4, so that a scale taken from the wrong tile, row or expert shows; and the case reports
  what the busiest expert's tile scales doubled would give (and fails if the tolerance would
  not catch it by 10x)."""
  from jmoe.ops.fp8 import E5M2
  from jmoe.ops.fp8_blockwise import dequantize_blocks, quantize_blocks
  from jmoe.ops.fp8_mosaic import fp8_blockwise_ragged_dot
  sizes = c["sizes"]
  groups = jnp.asarray(sizes)
  used = int(sizes.sum())
  x_q, s_x = quantize_blocks(tile_magnitudes(c["x"], (1, 128), 1), (1,))
  w_q, s_w = quantize_blocks(tile_magnitudes(c["w"], (1, 128, 128), 2), (1, 2))
  dy_q, s_dy = quantize_blocks(tile_magnitudes(c["dy"], (1, 128), 3), (1,), E5M2)
  dot = jax.jit(lambda a, sa, b, sb: fp8_blockwise_ragged_dot(a, sa, b, sb, groups))
  y = host(dot(x_q, s_x, jnp.swapaxes(w_q, 1, 2), jnp.swapaxes(s_w, 1, 2)))[:used]
  dx = host(dot(dy_q, s_dy, w_q, s_w))[:used]
  y_ref, dx_ref, _ = reference(*(dequantize_blocks(q, s, axes) for q, s, axes in
                                  ((x_q, s_x, (1,)), (w_q, s_w, (1, 2)), (dy_q, s_dy, (1,)))),
                                sizes)
  y_ref, dx_ref = y_ref[:used], dx_ref[:used]
  result = {"rows": used, "out": relative_error(y, y_ref), "dx": relative_error(dx, dx_ref),
            "doubled_scale_error": doubled_scale_error(y, y_ref, sizes),
            "finite": bool(np.all(np.isfinite(y)) and np.all(np.isfinite(dx)))}
  result["ok"] = bool(max(result["out"], result["dx"]) <= FP8_TOLERANCE and result["finite"]
                      and result["doubled_scale_error"] > 10 * FP8_TOLERANCE)
  return result


def grouped_case(c: dict, weight_gradient: str = "bf16") -> dict:
  """moe.gemm=mosaic in FP8, through jmoe's own custom VJP, against float32 on the bf16 inputs;
  the weight gradient in `weight_gradient` (precision.fp8_weight_gradient), the row kernels'
  sums promoted as precision.fp8_promote's default says."""
  from jmoe.config import PrecisionConfig
  from jmoe.ops.grouped_gemm import grouped_gemm
  gemm = jax.jit(grouped_gemm("mosaic", "e5m2", weight_gradient=weight_gradient,
                              promote=PrecisionConfig().fp8_promote))
  sizes = c["sizes"]
  y, vjp = jax.vjp(lambda x, w: gemm(x, w, jnp.asarray(sizes)), c["x"], c["w"])
  y, dx, dw = (host(a) for a in (y, *vjp(c["dy"])))
  return end_to_end((y, dx, dw), reference(c["x"], c["w"], c["dy"], sizes), sizes, E2E_FWD)


def end_to_end(got, want, sizes, forward_tolerance: float) -> dict:
  """(y, dx, dw) against float32's, per expert for dw: within `forward_tolerance` and
  E2E_GRAD, zeros past the groups and for experts with no rows."""
  (y, dx, dw), (y_ref, dx_ref, dw_ref), used = got, want, int(sizes.sum())
  per_expert = [relative_error(dw[e], dw_ref[e]) for e in range(len(sizes)) if sizes[e]]
  result = {"rows": len(y), "out": relative_error(y[:used], y_ref[:used]),
            "dx": relative_error(dx[:used], dx_ref[:used]), "dw_worst_expert": max(per_expert),
            "rows_past_groups_zero": bool(np.all(y[used:] == 0) and np.all(dx[used:] == 0)),
            "empty_experts_zero": bool(all(np.all(dw[e] == 0) for e in range(len(sizes))
                                           if not sizes[e]))}
  result["ok"] = bool(result["out"] <= forward_tolerance
                      and max(result["dx"], result["dw_worst_expert"]) <= E2E_GRAD
                      and result["rows_past_groups_zero"] and result["empty_experts_zero"])
  return result


def transpose_case(c: dict) -> dict:
  """jmoe's Triton transpose (the weight gradient's operands) against XLA's gather and
  transpose: the same bytes, x_q and dy_q in the group-aligned column order."""
  from jmoe.ops.fp8_mosaic import group_aligned_columns
  from jmoe.ops.fp8_transpose import transpose_rows, xla_transpose_rows
  source, _ = group_aligned_columns(jnp.asarray(c["sizes"]), c["x_q"].shape[0], 128)
  bytes_ = lambda a: np.asarray(jax.device_get(jax.lax.bitcast_convert_type(a, jnp.uint8)))
  result = {"rows": int(c["x_q"].shape[0])}
  for name in ("x_q", "dy_q"):
    kernel, xla = (jax.jit(f)(c[name], source) for f in (transpose_rows, xla_transpose_rows))
    result[f"{name}_differing_bytes"] = int(np.sum(bytes_(kernel) != bytes_(xla)))
  result["ok"] = not result["x_q_differing_bytes"] and not result["dy_q_differing_bytes"]
  return result


def swiglu_case(c: dict, reps: int = 10) -> dict:
  """jmoe/ops/fp8_swiglu.py's Triton kernels against the same arithmetic through XLA on the
  GPU, on h of the shape's output width (gate and up halves) with NaN in the rows past the
  groups: row amaxes within 1e-5 (the two exps may differ in their last bits), at most 1 in
  10^4 float8 values of dh per row and of dh folded (and of its bf16 copy) different, rows past
  the groups zero; the forward kernel (`swiglu_quantized`) likewise: its row scales within
  1e-5, at most 1 in 10^4 float8 values of the hidden different, rows past the groups zero;
  and each path's time over `reps` calls (none for 0)."""
  from jmoe.ops.fp8 import E5M2, scale_for
  from jmoe.ops.fp8_swiglu import swiglu_grad_amax, swiglu_grad_quantized, swiglu_quantized
  used, (rows, width) = int(c["sizes"].sum()), c["dy"].shape
  valid = jnp.arange(rows) < used
  h = jnp.where(valid[:, None], c["dy"] * 3, jnp.nan).astype(jnp.bfloat16)
  d = (c["x"][:, :1] * c["dy"][:, : width // 2] * 1e-3).astype(jnp.bfloat16)
  made = (h, c["s_x"][:, 0] * 512, d, valid)

  def run(*made, path):  # as the fused op's backward pass calls them
    amax = swiglu_grad_amax(*made, path=path)
    fold = (made[1], scale_for(jnp.max(amax * made[1]), E5M2))
    return (amax, *swiglu_grad_quantized(*made, scale_for(amax, E5M2), E5M2, fold=fold,
                                         with_bf16=True, path=path))

  ours, xla = (functools.partial(run, path=path) for path in (None, "xla"))
  got, want = (jax.jit(fn)(*made) for fn in (ours, xla))
  result = {"rows": rows, "amax": relative_error(host(got[0]), host(want[0]))}
  for name, a, b in zip(("dh_q", "folded_q", "dh_bf16"), got[1:], want[1:]):
    result[f"{name}_differing"] = float(np.mean(host(a) != host(b)))
  result["rows_past_groups_zero"] = bool(np.all(host(got[1])[used:] == 0))
  # the forward kernel: the hidden quantized per row (its bf16 copy is XLA's on both paths)
  forward = lambda path: jax.jit(lambda h, s, v: swiglu_quantized(h, s, v, path=path)[:2])
  fwd_args = (made[0], made[1], made[3])
  (hq, hs), (hq_xla, hs_xla) = (forward(path)(*fwd_args) for path in (None, "xla"))
  result["forward_scale"] = relative_error(host(hs), host(hs_xla))
  result["forward_q_differing"] = float(np.mean(host(hq) != host(hq_xla)))
  result["forward_rows_past_groups_zero"] = bool(np.all(host(hq)[used:] == 0))
  if reps:
    from tune_gemm import median_seconds
    result["ms"], result["xla_ms"] = (1e3 * median_seconds(jax.jit(fn), *made, reps=reps)
                                      for fn in (ours, xla))
    result["forward_ms"], result["forward_xla_ms"] = (
        1e3 * median_seconds(forward(path), *fwd_args, reps=reps) for path in (None, "xla"))
  result["ok"] = bool(result["amax"] < 1e-5 and result["rows_past_groups_zero"] and max(
      result[f"{n}_differing"] for n in ("dh_q", "folded_q", "dh_bf16")) <= 1e-4
      and result["forward_scale"] < 1e-5 and result["forward_q_differing"] <= 1e-4
      and result["forward_rows_past_groups_zero"])
  return result


def gated_case(c: dict, weight_gradient: str) -> dict:
  """moe.gemm=mosaic's first projection and SwiGLU in one op, in FP8 (`GroupedGemm.swiglu`),
  against float32 on the bf16 inputs: the forward within 8% (two FP8 errors multiplied),
  dx and every expert's dw within FP8's gradient tolerance, zeros past the groups and for
  experts with no rows."""
  from jmoe.config import PrecisionConfig
  from jmoe.ops.grouped_gemm import grouped_gemm
  gated = jax.jit(grouped_gemm("mosaic", "e5m2", weight_gradient=weight_gradient,
                               promote=PrecisionConfig().fp8_promote).swiglu)
  sizes = c["sizes"]
  width = c["w"].shape[2]
  d = c["dy"][:, : width // 2]
  y, vjp = jax.vjp(lambda x, w: gated(x, w, jnp.asarray(sizes))[0], c["x"], c["w"])
  y, dx, dw = (host(a) for a in (y, *vjp(d)))
  h = reference(c["x"], c["w"], jnp.zeros_like(c["dy"]), sizes)[0]
  y_ref, silu_vjp = jax.vjp(lambda g, u: jax.nn.silu(g) * u, h[:, : width // 2],
                            h[:, width // 2:])
  dh = np.concatenate([host(a) for a in silu_vjp(jnp.asarray(host(d)))], axis=1)
  _, dx_ref, dw_ref = reference(c["x"], c["w"], jnp.asarray(dh), sizes)
  return end_to_end((y, dx, dw), (host(y_ref), dx_ref, dw_ref), sizes, 0.08)


CHECKS = ("transpose", "kernels", "kernels_promoted", "blockwise", "grouped", "grouped_wfp8",
          "swiglu", "gated", "gated_wfp8")


# --quick: every kind of case once per shape class, each on one routing (Qwen3's up shape with
# empty experts and rows past the groups, the odd one skewed, Mixtral's two longest
# contractions balanced)
QUICK_CASES = (("up", "empty"), ("odd", "skewed"), ("mixtral_up", "balanced"),
               ("mixtral_down", "balanced"))


def fp8_jobs(rows: int, shapes=FP8_SHAPES, checks=CHECKS, cases=None, timed=True) -> list:
  """Per (shape, routing): a transpose job, two kernel jobs (the row kernels as
  precision.fp8_promote's default, `long`, runs them: promoted from PROMOTE_FROM_K on; and every
  call promoted, as `always`), a blockwise job, two end-to-end jobs, the SwiGLU kernels and two
  end-to-end jobs of the first projection fused with SwiGLU. `timed`: the SwiGLU jobs time
  their kernels (only worth it with the jobs one at a time: beside other workers' kernels the
  skewed case once read 81.5 ms for 1.97)."""
  def job(kind_of_check, shape, kind):
    check = f"fp8_{kind_of_check}/{shape}/{kind}"

    def run():
      c = quantized_case(shape, kind, rows, ROUTINGS.index(kind))
      if kind_of_check == "transpose":
        return {"check": check, **transpose_case(c)}
      if kind_of_check.startswith("kernels"):
        from jmoe.ops.fp8_mosaic import PROMOTE_SETTINGS
        promote = "always" if "promoted" in kind_of_check else "long"
        return {"check": check, **kernel_case(c, PROMOTE_SETTINGS[promote])}
      if kind_of_check == "blockwise":
        return {"check": check, **blockwise_case(c)}
      if kind_of_check == "swiglu":
        return {"check": check, **swiglu_case(c, reps=10 if timed else 0)}
      if kind_of_check.startswith("gated"):
        return {"check": check, **gated_case(c, "fp8" if "wfp8" in kind_of_check else "bf16")}
      return {"check": check, **grouped_case(c, "fp8" if "wfp8" in kind_of_check else "bf16")}
    return named(run, check)

  cases = cases or [(shape, kind) for shape in shapes for kind in ROUTINGS]
  return [job(which, shape, kind) for shape, kind in cases for which in checks]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rows", type=int, default=16384)
  parser.add_argument("--shapes", default=",".join(FP8_SHAPES))
  parser.add_argument("--workers", type=int, default=4,
                      help="jobs at once; the SwiGLU cases time their kernels only with 1")
  parser.add_argument("--checks", default=",".join(CHECKS), help="which kinds of case to run")
  parser.add_argument("--quick", action="store_true",
                      help="each kind of case on QUICK_CASES' shapes and routings only")
  parser.add_argument("--bench", action="store_true", help="time the kernels after the checks")
  parser.add_argument("--bench-only", action="store_true", help="time the kernels, check nothing")
  args = parser.parse_args(argv)
  print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__}))
  results = [] if args.bench_only else run_jobs(
      fp8_jobs(args.rows, args.shapes.split(","), args.checks.split(","),
               QUICK_CASES if args.quick else None, timed=args.workers == 1), args.workers)
  if args.bench or args.bench_only:
    from bench_fp8_kernels import bench
    shapes = [s for s in args.shapes.split(",") if s != "odd"]
    for line in bench(args.rows, shapes):
      print(json.dumps(line), flush=True)
  failed = [r["check"] for r in results if not r["ok"]]
  if not args.bench_only:
    print(json.dumps({"failed": failed, "ok": not failed}))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
