"""`scripts/check_gpu_fp8.py --bench`: the FP8 grouped-GEMM kernels' TFLOP/s beside the bf16 Mosaic
kernels' on the same GEMMs, on a Hopper GPU (the checks' quantized operands, balanced routing).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from check_gpu import SHAPES
from check_gpu_fp8 import quantized_case


def bench(rows: int, shapes=("up", "down"), reps: int = 10) -> list[dict]:
  """TFLOP/s of each FP8 kernel and of the bf16 Mosaic kernel on the same GEMM, balanced routing;
  the row kernels also with their sums promoted to float32 every K step, and with blockwise
  scales."""
  from jmoe.ops.fp8_mosaic import fp8_aligned_contract, fp8_blockwise_ragged_dot, fp8_ragged_dot
  from jmoe.ops.mosaic_gemm import ragged, ragged_contract
  from tune_gemm import median_seconds
  seconds = lambda fn, *args: median_seconds(fn, *args, reps=reps)

  out = []
  for shape in shapes:
    c = quantized_case(shape, "balanced", rows, 0)
    groups = jnp.asarray(c["sizes"])
    experts, d, f = SHAPES[shape]
    w_t = jnp.swapaxes(c["w_q"], 1, 2)  # the forward's K-major copy, made once here
    runs = {"fwd": (lambda x, w: fp8_ragged_dot(x, w, groups), (c["x_q"], w_t),
                    lambda x, w: ragged(x, w, groups, False), (c["x"], c["w"])),
            "dlhs": (lambda g, w: fp8_ragged_dot(g, w, groups), (c["dy_q"], c["w_q"]),
                     lambda g, w: ragged(g, w, groups, True), (c["dy"], c["w"])),
            "drhs": (lambda x, g: fp8_aligned_contract(x, g, groups), (c["x_q"], c["folded_q"]),
                     lambda x, g: ragged_contract(x, g, groups), (c["x"], c["dy"]))}
    flops = 2 * rows * d * f
    for name, (fp8, fp8_args, bf16, bf16_args) in runs.items():
      t8, t16 = seconds(jax.jit(fp8), *fp8_args), seconds(jax.jit(bf16), *bf16_args)
      line = {"bench": f"fp8/{shape}/{name}", "rows": rows, "fp8_tflops": flops / t8 / 1e12,
              "bf16_tflops": flops / t16 / 1e12, "speedup": t16 / t8}
      if name != "drhs":
        x, w = fp8_args
        # (fp8_tflops above is the unpromoted kernel, which fp8_promote=long runs below 8,192)
        t = seconds(jax.jit(functools.partial(fp8_ragged_dot, group_sizes_E=groups,
                                              promote=True)), x, w)
        line["fp8_promoted_tflops"] = flops / t / 1e12
        # blockwise scales: one per 128 of each row's K, one per 128 x 128 tile of w
        x_scale = jnp.ones((x.shape[0], -(-x.shape[1] // 128)), jnp.float32)
        w_scale = jnp.ones((experts, -(-w.shape[1] // 128), -(-w.shape[2] // 128)), jnp.float32)
        t = seconds(jax.jit(functools.partial(fp8_blockwise_ragged_dot, group_sizes_E=groups)),
                    x, x_scale, w, w_scale)
        line["fp8_blockwise_tflops"] = flops / t / 1e12
      out.append(line)
  return out
