"""What a GPU run's step holds that its trace on another platform would not show: stand-ins the
estimate traces in place of GPU kernels, supplied here and nowhere in model code.

- Attention: cuDNN's fused kernel keeps, for the backward pass, its inputs, its output and float32
  softmax statistics per query and head, and recomputes the rest inside the kernel. The stand-in
  holds memory the same way (zeros of the statistics' size: estimates only trace it) and runs
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
import jax.numpy as jnp

from jmoe.config import Config
from jmoe.ops import attention as attention_ops
from jmoe.ops.grouped_gemm import GEMM_BACKENDS
from jmoe.ops.params import DTYPES

FUSED_SCOPE = "fused_attention"


def like_fused_attention(q_BSHA, k_BSGA, v_BSGA, **kwargs) -> jax.Array:
  """XLA's attention, holding memory as cuDNN's fused kernel does."""
  arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
  static = {k: v for k, v in kwargs.items() if k not in arrays}
  attend = lambda q, k, v, a: jax.nn.dot_product_attention(q, k, v, implementation="xla",
                                                           **static, **a)

  @jax.custom_vjp
  def kernel(q, k, v, a):
    return attend(q, k, v, a)

  def forward(q, k, v, a):
    out = attend(q, k, v, a)
    return out, (q, k, v, a, out, jnp.zeros(q.shape[:-1], jnp.float32))

  def backward(saved, g):
    q, k, v, a = saved[:4]
    return jax.vjp(attend, q, k, v, a)[1](g)

  kernel.defvjp(forward, backward)
  with jax.named_scope(FUSED_SCOPE):
    return kernel(q_BSHA, k_BSGA, v_BSGA, arrays)


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
  kernels["cudnn"] = like_fused_attention
  try:
    yield
  finally:
    kernels["cudnn"] = cudnn
