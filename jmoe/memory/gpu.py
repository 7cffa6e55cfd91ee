"""What a GPU run's step holds that its trace on another platform would not show: stand-ins the
estimate traces in place of GPU kernels, supplied here and nowhere in model code.

- Attention: cuDNN's fused kernel keeps, for the backward pass, its inputs, its output and float32
  softmax statistics per query and head, and recomputes the rest inside the kernel. The stand-in
  is XLA's kernel of the same interface, under the same custom VJP (so it holds the same), run
  under the `FUSED_SCOPE` name scope, so the walk counts what is made inside as the kernel's own
  working memory, never stored.
- Grouped GEMMs: XLA's ragged dot in place of a GPU-only kernel (they hold the same buffers: their
  operands and results), since it traces anywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import jax

from jmoe.config import Config
from jmoe.ops import attention as attention_ops
from jmoe.ops import attention_kernels
from jmoe.ops.grouped_gemm import GEMM_BACKENDS
from jmoe.ops.params import DTYPES

FUSED_SCOPE = "fused_attention"


def _scoped(fn):
  def run(*args, **kwargs):
    with jax.named_scope(FUSED_SCOPE):
      return fn(*args, **kwargs)
  return run


# XLA's kernel in the scope of a fused one: jmoe/ops/attention.py's custom VJP keeps what cuDNN's
# kernel keeps (inputs, output, float32 statistics), and the walk counts the [S, S] scores made
# inside as the kernel's working memory.
LIKE_FUSED_ATTENTION = attention_kernels.AttentionKernel(_scoped(attention_kernels.xla_forward),
                                                         _scoped(attention_kernels.xla_backward))


def as_on_gpu(config: Config) -> Config:
  """`config` with the kernel choices a GPU run would make spelled out, for tracing elsewhere:
  `auto` attention as cuDNN would be chosen there, and a GPU-only grouped GEMM (or `auto`'s) as
  XLA's ragged dot."""
  model, moe = config.model, config.moe
  if model.attention_kernel == "auto":
    kernel = attention_ops.auto_kernel("gpu", DTYPES[config.precision.compute])
    model = dataclasses.replace(model, attention_kernel=kernel)
  if moe.gemm == "auto" or not GEMM_BACKENDS[moe.gemm].portable:
    moe = dataclasses.replace(moe, gemm="ragged_dot")
  return dataclasses.replace(config, model=model, moe=moe)


@contextlib.contextmanager
def gpu_kernels_replaced() -> Iterator[None]:
  """While tracing: the cuDNN attention kernel is the stand-in above. (The registry entry is
  swapped for the duration; tracing runs on one thread.)"""
  kernels = attention_ops.ATTENTION_KERNELS
  cudnn = kernels["cudnn"]
  kernels["cudnn"] = LIKE_FUSED_ATTENTION
  try:
    yield
  finally:
    kernels["cudnn"] = cudnn
