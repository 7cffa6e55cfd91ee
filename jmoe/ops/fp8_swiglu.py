"""SwiGLU's backward pass fused with the FP8 quantization of what it produces.

In FP8 the experts' gate and up projection takes the gradient of its output, dh = d(gate, up)
[X, 2F], quantized with one scale per row (jmoe/ops/fp8_grouped.py). Through XLA that was three
passes over dh: SwiGLU's backward writing it in bf16, a row-amax reduction reading it, and the
quantization reading it again to write the float8 operands (on Mixtral-8x7B's bench, one H100:
2.9 ms a layer for about 1 ms of bytes). Here two Pallas Triton kernels compute dh, each time
they need it, from what it is made of: the projection's output h as its kernel wrote it with
each row's scale, and the gradient of SwiGLU's output:

  swiglu_grad_amax(h_X2F, scale_X, d_XF, valid_X)       [X] each row's largest |dh|
  swiglu_grad_quantized(..., q_scale_X, dtype, ...)     dh / q_scale per row in `dtype`; and, as
      asked, dh * fold_X[row] / fold_scale in `dtype` (the float8 weight gradient's operand, the
      rows' scales folded in) or dh in bf16 (the 16-bit weight gradient's)

The forward pass likewise: `swiglu_quantized` makes the hidden silu(gate) * up from h and
quantizes it per row for the down projection in one kernel, whole rows per program held in
registers, so h is read once; through XLA that was a fusion writing the hidden in bf16 with
its row amaxes, and the quantization reading it again.

Row x's gate and up are bf16(h[x, :F] * scale[x]) and bf16(h[x, F:] * scale[x]) where valid[x],
else zeros (a kernel may leave rows past the groups unwritten: they are never read as numbers);
dh is measured and quantized in float32, one rounding fewer than the bf16 dh it replaces. Off
the GPU the same arithmetic runs through XLA (`xla_swiglu_grad`, `swiglu_quantized`'s own),
which the kernels are held to bit for bit (tests/test_fp8_swiglu.py, in Pallas' interpreter;
scripts/check_gpu_fp8.py on the GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmoe.ops.fp8 import E4M3, quantize, quantize_rows, scale_for

BLOCK_ROWS = 8
# The forward kernel's elements of the hidden per program (whole rows, held in registers: 32 of
# gate's, up's and the hidden's a thread at 16 warps); wider rows take the XLA path.
FORWARD_BLOCK = 16384
# Triton addresses an operand with 32-bit signed offsets (jmoe/ops/fp8_transpose.py): larger
# operands take the XLA path.
MAX_ELEMENTS = 2**31 - 1


def swiglu_grad(g, u, d):
  """(d gate, d up) of silu(g) * u for the output gradient d, in float32."""
  g, u, d = (v.astype(jnp.float32) for v in (g, u, d))
  sig = 1.0 / (1.0 + jnp.exp(-g))
  dg = d * u * sig * (1.0 + g * (1.0 - sig))
  du = d * g * sig
  return dg, du


def round_to_bf16(v: jax.Array) -> jax.Array:
  """Finite float32 values rounded to the nearest bf16 (ties to even), kept in float32. Written
  on the bits because XLA may drop a float32 -> bf16 -> float32 round trip inside a fusion
  (`xla_allow_excess_precision`), which would make the kernels' and XLA's values differ."""
  bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
  bits = bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))
  return jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), jnp.float32)


def scaled_rows(h, scale_X, valid_X):
  """h times each row's scale, rounded to bf16 (as float32), zeros where not valid."""
  v = round_to_bf16(h.astype(jnp.float32) * scale_X[:, None])
  return jnp.where(valid_X[:, None], v, 0.0)


def gate_and_up(h_X2F: jax.Array, scale_X: jax.Array, valid_X: jax.Array):
  """(gate, up) [X, F], bf16 values as float32: h's halves times each row's scale, zeros where
  not valid."""
  f = h_X2F.shape[1] // 2
  h_X2F = scaled_rows(h_X2F, scale_X, valid_X)
  return h_X2F[:, :f], h_X2F[:, f:]


def hidden_of(g, u):
  """silu(g) * u for gate and up as float32, rounded to bf16 (kept in float32)."""
  return round_to_bf16(g * (1.0 / (1.0 + jnp.exp(-g))) * u)


def swiglu_quantized(h_X2F, scale_X, valid_X, *, path: str | None = None):
  """(hidden_q [X, F] E4M3, its row scales [X] float32, hidden [X, F] bf16): silu(gate) * up
  from h as the projection's kernel wrote it, rounded to bf16, and quantized per row as
  jmoe/ops/fp8_grouped.py's `quantize_rows` does; rows not valid are zeros. The bf16 hidden is
  XLA's (left out of the program where nothing reads it). `path`: as for `swiglu_grad_amax`
  (XLA for rows wider than FORWARD_BLOCK)."""
  hidden = hidden_of(*gate_and_up(h_X2F, scale_X, valid_X))
  path = _path(h_X2F, path)
  if path == "xla" or h_X2F.shape[1] // 2 > FORWARD_BLOCK:
    hidden_q, scale_X1 = quantize_rows(hidden)
    scale_X = scale_X1[:, 0]
  else:
    hidden_q, scale_X = _forward_call(h_X2F, scale_X, valid_X, interpret=path == "interpret")
  return hidden_q, scale_X, hidden.astype(jnp.bfloat16)


def xla_swiglu_grad(h_X2F, scale_X, d_XF, valid_X) -> jax.Array:
  """dh [X, 2F] in float32 through XLA: the kernels' reference and, off the GPU,
  their stand-in."""
  g, u = gate_and_up(h_X2F, scale_X, valid_X)
  dg, du = swiglu_grad(g, u, jnp.where(valid_X[:, None], d_XF, 0))
  return jnp.concatenate([dg, du], axis=1)


def swiglu_grad_amax(h_X2F, scale_X, d_XF, valid_X, *, path: str | None = None):
  """[X] float32: each row's largest |dh| (zero for rows not valid). `path`: PATHS' key, None
  for the kernel on the GPU and XLA elsewhere."""
  path = _path(h_X2F, path)
  if path == "xla":
    return jnp.max(jnp.abs(xla_swiglu_grad(h_X2F, scale_X, d_XF, valid_X)), axis=1)
  partial_XC = _call(h_X2F, scale_X, d_XF, valid_X, mode="amax", interpret=path == "interpret")[0]
  return jnp.max(partial_XC, axis=1)


def swiglu_grad_quantized(h_X2F, scale_X, d_XF, valid_X, q_scale_X, dtype, fold=None,
                          with_bf16: bool = False, *, path: str | None = None):
  """(dh_q, folded_q, dh): dh quantized per row [X, 2F] in `dtype`; with `fold` = (fold_X,
  fold_scale), dh * fold_X[row] quantized by the one scale fold_scale, else None; with
  `with_bf16`, dh in bf16, else None. Rows not valid are zeros. `path`: as for
  `swiglu_grad_amax`."""
  path = _path(h_X2F, path)
  if path == "xla":
    dh = xla_swiglu_grad(h_X2F, scale_X, d_XF, valid_X)
    dh_q = quantize(dh, q_scale_X[:, None], dtype)
    folded_q = None if fold is None else quantize(dh * fold[0][:, None], fold[1], dtype)
    return dh_q, folded_q, dh.astype(jnp.bfloat16) if with_bf16 else None
  outs = list(_call(h_X2F, scale_X, d_XF, valid_X, mode="write", q_scale_X=q_scale_X,
                    dtype=dtype, fold=fold, with_bf16=with_bf16,
                    interpret=path == "interpret"))
  dh_q = outs.pop(0)
  folded_q = outs.pop(0) if fold is not None else None
  return dh_q, folded_q, outs.pop(0) if with_bf16 else None


# How dh is made: the Triton kernels (on the GPU), the same kernels through Pallas' interpreter
# (any platform; for tests), or `xla_swiglu_grad`.
PATHS = ("kernel", "interpret", "xla")


def _path(h_X2F, path: str | None) -> str:
  """`path`, or for None the kernel on the GPU and XLA elsewhere; XLA for operands the kernels
  cannot address."""
  if h_X2F.size > MAX_ELEMENTS:
    return "xla"
  if path is None:
    return "kernel" if jax.default_backend() == "gpu" else "xla"
  if path not in PATHS:
    raise ValueError(f"path={path!r}: one of {PATHS}")
  return path


def block_cols(f: int) -> int:
  """Columns of one program's tile: 512, or 256 where F is a multiple of 256 and not of 512
  (Qwen3-30B-A3B's 768: no masked quarter); any F works, the last tile masked."""
  return 256 if f % 512 and not f % 256 else 512


def _call(h_X2F, scale_X, d_XF, valid_X, *, mode, q_scale_X=None, dtype=None, fold=None,
          with_bf16=False, interpret=False):
  """The `amax` or `write` kernel over tiles of BLOCK_ROWS rows x `block_cols(F)` columns of
  gate and of up. Inputs: h, scale, d, valid, and for `write` q_scale [, fold, fold_scale];
  outputs: the partial amaxes [X, column tiles], or dh_q [, folded_q] [, dh in bf16]."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  rows, f = d_XF.shape
  br, bc = BLOCK_ROWS, block_cols(f)
  grid = (pl.cdiv(rows, br), pl.cdiv(f, bc))
  inputs = [h_X2F, scale_X.astype(jnp.float32), d_XF, valid_X.astype(jnp.int32)]
  if mode == "amax":
    out_shape = [jax.ShapeDtypeStruct((rows, grid[1]), jnp.float32)]
  else:
    inputs.append(q_scale_X.astype(jnp.float32))
    out_shape = [jax.ShapeDtypeStruct((rows, 2 * f), dtype)]
    if fold is not None:
      inputs += [fold[0].astype(jnp.float32), jnp.reshape(fold[1], (1,)).astype(jnp.float32)]
      out_shape.append(jax.ShapeDtypeStruct((rows, 2 * f), dtype))
    if with_bf16:
      out_shape.append(jax.ShapeDtypeStruct((rows, 2 * f), jnp.bfloat16))

  def kernel(*refs):
    ins, outs = refs[:len(inputs)], list(refs[len(inputs):])
    h_ref, s_ref, d_ref, v_ref = ins[:4]
    i, j = pl.program_id(0), pl.program_id(1)
    in_r_B = i * br + jnp.arange(br) < rows
    mask = in_r_B[:, None] & (j * bc + jnp.arange(bc) < f)[None, :]
    r, gate_cols, up_cols = pl.ds(i * br, br), pl.ds(j * bc, bc), pl.ds(f + j * bc, bc)
    row = lambda ref, other: plgpu.load(ref.at[r], mask=in_r_B, other=other)
    tile = lambda ref, cols: plgpu.load(ref.at[r, cols], mask=mask, other=0.0)
    scale_B, valid_B = row(s_ref, 0.0), row(v_ref, 0) != 0
    g = scaled_rows(tile(h_ref, gate_cols), scale_B, valid_B)  # as `gate_and_up`
    u = scaled_rows(tile(h_ref, up_cols), scale_B, valid_B)
    d = jnp.where(valid_B[:, None], tile(d_ref, gate_cols).astype(jnp.float32), 0.0)
    dg, du = swiglu_grad(g, u, d)
    if mode == "amax":
      top_B = jnp.max(jnp.maximum(jnp.abs(dg), jnp.abs(du)), axis=1)
      plgpu.store(outs[0].at[r, pl.ds(j, 1)], top_B[:, None], mask=in_r_B[:, None])
      return
    q_scale_B1 = row(ins[4], 1.0)[:, None]
    q_ref = outs.pop(0)
    if fold is not None:
      fold_B1 = row(ins[5], 0.0)[:, None]
      fold_scale_11 = plgpu.load(ins[6].at[pl.ds(0, 1)])[None, :]
      folded_ref = outs.pop(0)
    for cols, v in ((gate_cols, dg), (up_cols, du)):
      plgpu.store(q_ref.at[r, cols], quantize(v, q_scale_B1, dtype), mask=mask)
      if fold is not None:
        plgpu.store(folded_ref.at[r, cols], quantize(v * fold_B1, fold_scale_11, dtype),
                    mask=mask)
      if with_bf16:
        plgpu.store(outs[0].at[r, cols], v.astype(jnp.bfloat16), mask=mask)

  call = pl.pallas_call(kernel, out_shape=out_shape, grid=grid,
                        compiler_params=plgpu.CompilerParams(num_warps=4),
                        interpret=interpret, name=f"jmoe_swiglu_grad_{mode}")
  return call(*inputs)


def _forward_call(h_X2F, scale_X, valid_X, *, interpret=False):
  """`swiglu_quantized`'s kernel: each program holds whole rows of the hidden in registers
  (FORWARD_BLOCK elements: one row of Mixtral-8x7B's 14,336, sixteen of Qwen3-30B-A3B's 768,
  padded to a power of two), takes their amaxes and writes their float8 values, so h is read
  once. Returns (hidden_q, row scales)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  rows, f = h_X2F.shape[0], h_X2F.shape[1] // 2
  width = 1 << (f - 1).bit_length()  # f padded to a power of two
  br = max(1, FORWARD_BLOCK // width)

  def kernel(h_ref, s_ref, v_ref, q_ref, qs_ref):
    r = pl.ds(pl.program_id(0) * br, br)
    in_r_B = pl.program_id(0) * br + jnp.arange(br) < rows
    mask = in_r_B[:, None] & (jnp.arange(width) < f)[None, :]
    scale_B = plgpu.load(s_ref.at[r], mask=in_r_B, other=0.0)
    valid_B = plgpu.load(v_ref.at[r], mask=in_r_B, other=0) != 0
    # (the padded tile reaches past h's last column: the mask keeps the load inside it; a start
    # known only at run time keeps the slice's own bounds check, which has no mask, out of it)
    start = lambda half: half * f + 0 * pl.program_id(0)
    tile = lambda half: plgpu.load(h_ref.at[r, pl.ds(start(half), width)], mask=mask, other=0.0)
    g = scaled_rows(tile(0), scale_B, valid_B)  # as `gate_and_up`
    u = scaled_rows(tile(1), scale_B, valid_B)
    v = hidden_of(g, u)
    q_scale_B = scale_for(jnp.max(jnp.abs(v), axis=1), E4M3)
    plgpu.store(qs_ref.at[r], q_scale_B, mask=in_r_B)
    plgpu.store(q_ref.at[r, pl.ds(start(0), width)], quantize(v, q_scale_B[:, None], E4M3),
                mask=mask)

  call = pl.pallas_call(kernel, out_shape=[jax.ShapeDtypeStruct((rows, f), E4M3),
                                           jax.ShapeDtypeStruct((rows,), jnp.float32)],
                        grid=(pl.cdiv(rows, br),),
                        compiler_params=plgpu.CompilerParams(num_warps=16),
                        interpret=interpret, name="jmoe_swiglu_quantized")
  return call(h_X2F, scale_X.astype(jnp.float32), valid_X.astype(jnp.int32))
