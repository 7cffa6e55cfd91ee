"""Attention kernels behind one call: `jax.nn.dot_product_attention` through cuDNN or XLA.

`ATTENTION_KERNELS` is the list of names `model.attention_kernel` may take (besides `auto`):
  cudnn  cuDNN's fused kernel (NVIDIA GPUs, 16-bit inputs); a case it refuses runs through XLA's,
         with the reason logged once
  xla    XLA's own attention, on any platform
`auto` is cuDNN on GPUs for bf16/fp16 inputs and XLA's otherwise. A mask (packed documents,
alternating windows) and the sinks reach either kernel as a mask and a bias.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp

from jmoe.errors import choice

log = logging.getLogger("jmoe")

# (q_BSHA, k_BSGA, v_BSGA, **dot_product_attention keywords) -> out_BSHA
AttentionKernel = Callable[..., jax.Array]


@functools.cache
def _refused(reason: str) -> None:
  log.warning("cuDNN attention refused a case (%s); it runs through XLA's attention", reason)


def _xla(q_BSHA, k_BSGA, v_BSGA, **kwargs) -> jax.Array:
  return jax.nn.dot_product_attention(q_BSHA, k_BSGA, v_BSGA, implementation="xla", **kwargs)


def _cudnn(q_BSHA, k_BSGA, v_BSGA, **kwargs) -> jax.Array:
  try:
    return jax.nn.dot_product_attention(q_BSHA, k_BSGA, v_BSGA, implementation="cudnn", **kwargs)
  except (ValueError, NotImplementedError, TypeError, RuntimeError) as e:
    _refused(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
  return _xla(q_BSHA, k_BSGA, v_BSGA, **kwargs)


ATTENTION_KERNELS: dict[str, AttentionKernel] = {"cudnn": _cudnn, "xla": _xla}


def auto_kernel(platform: str, dtype) -> str:
  """What `auto` means on `platform` for inputs of `dtype`."""
  return "cudnn" if platform == "gpu" and dtype in (jnp.bfloat16, jnp.float16) else "xla"


def check_kernel(name: str) -> None:
  if name != "auto":
    choice("model.attention_kernel", name, ATTENTION_KERNELS)


def attention(q_BSHA, k_BSGA, v_BSGA, *, kernel: str = "auto", **kwargs) -> jax.Array:
  """Attention through the kernel named `kernel` (or `auto`'s choice on this platform)."""
  if kernel == "auto":
    kernel = auto_kernel(jax.default_backend(), q_BSHA.dtype)
  return choice("model.attention_kernel", kernel, ATTENTION_KERNELS)(q_BSHA, k_BSGA, v_BSGA,
                                                                      **kwargs)
