"""Small configs for tests: a nested dict of overrides on top of a tiny model; and references
that scripts/check_gpu.py shares."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import Config, from_config_dict
from jmoe.model.factory import model_factory
from jmoe.model.transformer import Transformer

TINY = {
    "model": dict(vocab_size=264, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=8, d_ff=64, init_std=0.05),
    "moe": dict(num_experts=8, top_k=2, d_ff_expert=16, first_k_dense=1,
                balance=dict(aux_loss_coef=0.01, z_loss_coef=0.001)),
    "train": dict(steps=8, batch_size=8, seed=0, lr=3e-3, warmup_steps=2, log_every=1),
    "data": dict(seq_len=32, max_corpus_bytes=400_000),
    "precision": dict(params="float32", compute="float32"),
}


def merge(base: dict, overrides: dict) -> dict:
  out = copy.deepcopy(base)
  for key, value in overrides.items():
    if isinstance(value, dict) and isinstance(out.get(key), dict):
      out[key] = merge(out[key], value)
    else:
      out[key] = value
  return out


def tiny_config(**overrides) -> Config:
  """e.g. tiny_config(moe=dict(top_k=1), train=dict(steps=4))"""
  return from_config_dict(merge(TINY, overrides))


def build(config: Config, seed: int | None = None) -> Transformer:
  """The model `config` describes, its parameters drawn by one compiled program (the values
  model_factory(config, seed)() draws op by op, in half the time)."""
  return nnx.jit(model_factory(config, seed))()


def plain_attention(q_BSHA, k_BSGA, v_BSGW, sinks_H, *, scale, window=0, segments_BS=None):
  """Softmax attention over every visible key (causal, within `window` keys, within each
  document), each sink a key of zero value, in the inputs' dtype at full precision: the
  reference for jmoe's attention kernels, differentiated by JAX's autodiff."""
  b, s, h, _ = q_BSHA.shape
  repeat = h // k_BSGA.shape[2]
  k_BSHA, v_BSHW = (jnp.repeat(t, repeat, axis=2) for t in (k_BSGA, v_BSGW))
  logits = jnp.einsum("bshd,bthd->bhst", q_BSHA, k_BSHA, precision="highest") * scale
  pos = jnp.arange(s)
  allowed = (pos[None, :] <= pos[:, None])[None, None]
  if window:
    allowed = allowed & (pos[:, None] - pos[None, :] < window)[None, None]
  if segments_BS is not None:
    allowed = allowed & (segments_BS[:, :, None] == segments_BS[:, None, :])[:, None]
  logits = jnp.where(allowed, logits, -jnp.inf)
  if sinks_H is not None:
    sink = jnp.broadcast_to(sinks_H[None, :, None, None], (b, h, s, 1))
    logits = jnp.concatenate([sink, logits], axis=-1)
  p = jax.nn.softmax(logits, axis=-1)
  if sinks_H is not None:
    p = p[..., 1:]
  return jnp.einsum("bhst,bthw->bshw", p, v_BSHW, precision="highest")


def opaque(fn):
  """`fn` with its first two operands made opaque to XLA: it must hold them in memory, as a GPU
  kernel reads its operands, rather than fuse how they are made into its consumer."""
  def call(a, b, *args, **kwargs):
    a, b = jax.lax.optimization_barrier((a, b))
    return fn(a, b, *args, **kwargs)
  return call


def sixteen_bit(x, w, sizes):
  """XLA's 16-bit grouped GEMM, differentiated by JAX: what a layer holds without FP8."""
  return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=x.dtype)


def grouped_contract(x, y, sizes):
  """Sum over each group's rows of x^T y, [E, D, F], in float32 (a weight-gradient kernel's
  stand-in); a group with no rows comes back NaN, as memory a kernel leaves unwritten."""
  expert_X = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(x.shape[0]), side="right")
  one_hot_XE = jax.nn.one_hot(expert_X, sizes.shape[0], dtype=jnp.float32)
  out = jnp.einsum("xd,xf,xe->edf", x.astype(jnp.float32), y.astype(jnp.float32), one_hot_XE)
  return jnp.where((sizes > 0)[:, None, None], out, jnp.nan)


def weight_copies_grown(gemm, more_layers: int, param_dtype=jnp.bfloat16, experts: int = 8,
                        width: int = 512, rows: int = 64) -> float:
  """How much XLA's temporaries for the gradient of a stack of `gemm` layers (x -> tanh(gemm(x,
  w, sizes)), [experts, width, width] weights in `param_dtype` cast to bf16 as the MoE layer
  casts them, `rows` tokens) grow with `more_layers` more layers, in float8 copies of one
  layer's weights: what a layer holds from its forward pass to its backward beyond its small
  activations."""
  sizes = jnp.full((experts,), rows // experts, jnp.int32)

  def temporaries(layers):
    def loss(ws, x):
      for w in ws:
        x = jnp.tanh(gemm(x, w.astype(jnp.bfloat16), sizes))
      return jnp.sum(x.astype(jnp.float32))
    ws = [jax.ShapeDtypeStruct((experts, width, width), param_dtype)] * layers
    x = jax.ShapeDtypeStruct((rows, width), jnp.bfloat16)
    return jax.jit(jax.grad(loss)).lower(ws, x).compile().memory_analysis().temp_size_in_bytes

  return (temporaries(2 + more_layers) - temporaries(2)) / (experts * width * width)


def barriers(fn, *args) -> list[list[tuple]]:
  """(shape, dtype) of the operands of each optimization barrier in fn's program (nested calls
  included): what a test of where XLA may move work checks."""
  import jax.extend
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "optimization_barrier":
        found.append([(tuple(v.aval.shape), v.aval.dtype) for v in eqn.invars])
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def recomputed_like(ours, written, args, dy) -> list[str]:
  """What `ours` keeps for its backward pass (jax.ad_checkpoint.print_saved_residuals' lines),
  after checking that its value and gradients at `args` (cotangent `dy`) are bit for bit those
  of `written`, the function it recomputes."""
  import contextlib
  import io
  import numpy as np
  from jax.ad_checkpoint import print_saved_residuals

  def value_and_grads(f):
    out, vjp = jax.vjp(f, *args)
    return (out, *vjp(dy))

  for a, b in zip(value_and_grads(ours), value_and_grads(written), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  kept = io.StringIO()
  with contextlib.redirect_stdout(kept):
    print_saved_residuals(ours, *args)
  return kept.getvalue().splitlines()
