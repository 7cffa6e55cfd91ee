"""AdamW, or Muon with AdamW (train.optimizer), with linear warmup, cosine decay and global-norm
clipping, precision-aware.

Parameters are stored in `precision.params` (the master copy the optimizer updates; the model casts
them to `precision.compute` where it uses them) and the two moments in `precision.moments`, as
Megatron-Core's precision-aware optimizer does: float32 master weights with bfloat16 moments halve
the optimizer state and keep the update exact where it matters. Whatever the storage, each
parameter's update is computed in float32 from one read of the parameter, its gradient and its two
moments, and one write of the parameter and the moments: the whole update per parameter is one
elementwise expression, which XLA makes one kernel.

Weight decay applies to GEMM weights and embeddings, not to norm scales or biases: each
parameter's kind says which it is (jmoe/ops/params.py).

Muon (train.optimizer = "muon") keeps one momentum per hidden matrix instead of AdamW's two
moments: its state is about half of AdamW's on a MoE model, whose expert matrices are most of
the parameters (docs/OPTIMIZER.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jmoe.config import TrainConfig
from jmoe.ops.params import DECAYED_KINDS, DTYPES, is_stacked, kind_of, matrix_roles
from jmoe.parallel import active_layout
from jmoe.train.muon import orthogonalised


_is_variable = lambda x: isinstance(x, nnx.Variable)


def learning_rate(cfg: TrainConfig) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps, decay_steps=cfg.steps,
      end_value=cfg.lr * cfg.min_lr_ratio)


@struct.dataclass
class AdamWState:
  count: jax.Array  # updates applied so far
  mu: Any  # first moments, like the parameters, in the moments' dtype
  nu: Any  # second moments


@dataclasses.dataclass(frozen=True)
class _Step:
  """One update's scalars, shared by every parameter. Where the update is not applied: no
  learning rate, moments that keep their value (decay 1), and gradients read as zeros, so that
  every value comes out exactly as it went in. Scalars only: each parameter's expression stays
  one pass."""
  applied: jax.Array
  lr: jax.Array
  scale: jax.Array | float  # global-norm clipping's factor on the gradient
  b1: jax.Array
  b2: jax.Array
  correction1: jax.Array
  correction2: jax.Array

  def gradient(self, g) -> jax.Array:
    return jnp.where(self.applied, g.astype(jnp.float32) * self.scale, 0.0)


@dataclasses.dataclass(frozen=True)
class AdamW:
  schedule: optax.Schedule
  b1: float
  b2: float
  eps: float
  weight_decay: float
  grad_clip: float  # global-norm clipping threshold; 0: none
  moments_dtype: Any = jnp.float32
  copy_stacked_grads: bool = False  # TrainConfig.copy_stacked_grads

  def init(self, params) -> AdamWState:
    zeros = lambda p: jnp.zeros(p.shape, self.moments_dtype)
    return AdamWState(count=jnp.zeros((), jnp.int32), mu=jax.tree.map(zeros, params),
                      nu=jax.tree.map(zeros, params))

  def apply(self, grads, state: AdamWState, params, grad_norm: jax.Array,
            applied: jax.Array | bool = True):
    """(new parameters, new state) after one update with `grads`, whose global norm is
    `grad_norm`; where `applied` is false, the parameters and state as they were."""
    step, count = self._step(state.count, grad_norm, applied)
    leaves, treedef = jax.tree.flatten(params)
    new = [self._update(step, *args) for args in zip(
        leaves, self._gradients(grads, params), jax.tree.leaves(state.mu),
        jax.tree.leaves(state.nu), _decayed(params))]
    params, mu, nu = (jax.tree.unflatten(treedef, [n[i] for n in new]) for i in range(3))
    return params, AdamWState(count=count, mu=mu, nu=nu)

  def _step(self, count, grad_norm, applied) -> tuple[_Step, jax.Array]:
    applied = jnp.asarray(applied)
    new_count = count + applied.astype(jnp.int32)
    n = jnp.maximum(new_count, 1).astype(jnp.float32)
    scale = (jnp.where(grad_norm < self.grad_clip, 1.0, self.grad_clip / grad_norm)
             if self.grad_clip > 0 else 1.0)
    return _Step(applied=applied, lr=jnp.where(applied, self.schedule(count), 0.0), scale=scale,
                 b1=jnp.where(applied, self.b1, 1.0), b2=jnp.where(applied, self.b2, 1.0),
                 correction1=1 - self.b1 ** n, correction2=1 - self.b2 ** n), new_count

  def _update(self, step: _Step, p, g, m, v, decay: bool):
    g32 = step.gradient(g)
    m32 = step.b1 * m.astype(jnp.float32) + (1 - step.b1) * g32
    v32 = step.b2 * v.astype(jnp.float32) + (1 - step.b2) * jnp.square(g32)
    update = (m32 / step.correction1) / (jnp.sqrt(v32 / step.correction2) + self.eps)
    p32 = p.astype(jnp.float32)
    if decay:
      update = update + self.weight_decay * p32
    return (p32 - step.lr * update).astype(p.dtype), m32.astype(m.dtype), v32.astype(v.dtype)

  def _gradients(self, grads, params) -> list:
    # The barrier makes a stacked gradient an array of its own, read by the update as any
    # other input (see TrainConfig.copy_stacked_grads).
    stacks = jax.tree.leaves(jax.tree.map(is_stacked, params, is_leaf=_is_variable))
    return [jax.lax.optimization_barrier(g) if stacked and self.copy_stacked_grads else g
            for g, stacked in zip(jax.tree.leaves(grads), stacks)]


def _decayed(params) -> list[bool]:
  return jax.tree.leaves(jax.tree.map(lambda v: kind_of(v) in DECAYED_KINDS, params,
                                      is_leaf=_is_variable))


def _is_matrix(_, variable) -> bool:  # an nnx filter: Muon's parameters
  return matrix_roles(variable) is not None


@struct.dataclass
class MuonState:
  count: jax.Array  # updates applied so far
  mu: Any  # like the parameters: Muon's momentum, or AdamW's first moment; the moments' dtype
  nu: Any  # AdamW's second moments, for the parameters Muon leaves to AdamW only


@dataclasses.dataclass(frozen=True)
class Muon(AdamW):
  """Muon (jmoe/train/muon.py) for the hidden layers' matrices (those whose parameter names its
  `matrix` roles: attention's and MLA's projections, dense and expert MLPs, shared experts, MTP's
  projection); AdamW, as configured, for every other parameter (embeddings, LM head, router,
  norms, biases, sinks, LoRA factors). Nesterov momentum `momentum`, stored like AdamW's moments,
  orthogonalised and scaled to AdamW's RMS; decoupled weight decay as AdamW's, under the same
  learning-rate schedule; gradients clipped by the same global norm."""
  momentum: float = 0.95

  def init(self, params) -> MuonState:
    zeros = lambda p: jnp.zeros(p.shape, self.moments_dtype)
    rest = nnx.split_state(params, _is_matrix, ...)[1]
    return MuonState(count=jnp.zeros((), jnp.int32), mu=jax.tree.map(zeros, params),
                     nu=jax.tree.map(zeros, rest))

  def apply(self, grads, state: MuonState, params, grad_norm: jax.Array,
            applied: jax.Array | bool = True):
    step, count = self._step(state.count, grad_norm, applied)
    beta = jnp.where(step.applied, self.momentum, 1.0)
    layout = active_layout()
    variables = jax.tree.leaves(params, is_leaf=_is_variable)
    leaves, treedef = jax.tree.flatten(params)
    nu = iter(jax.tree.leaves(state.nu))
    new = []
    for p, g, m, decay, var in zip(leaves, self._gradients(grads, params),
                                   jax.tree.leaves(state.mu), _decayed(params), variables):
      roles = matrix_roles(var)
      if roles is None:
        new.append(self._update(step, p, g, m, next(nu), decay))
        continue
      g32 = step.gradient(g)
      m32 = beta * m.astype(jnp.float32) + (1 - beta) * g32
      nesterov = beta * m32 + (1 - beta) * g32
      update = orthogonalised(nesterov, roles, var.get_metadata().get("axes"), layout)
      p32 = p.astype(jnp.float32)
      if decay:
        update = update + self.weight_decay * p32
      p32 = p32 - step.lr * update
      new.append((p32.astype(p.dtype), m32.astype(m.dtype), None))
    params, mu = (jax.tree.unflatten(treedef, [n[i] for n in new]) for i in range(2))
    nu = jax.tree.unflatten(jax.tree.structure(state.nu), [n[2] for n in new if n[2] is not None])
    return params, MuonState(count=count, mu=mu, nu=nu)


def global_norm(grads, by_layer: bool = True) -> jax.Array:
  """The gradients' global L2 norm. With `by_layer`, a stacked variable's squares are summed a
  layer at a time: its gradient is the layers' own arrays stacked, and a sum over the stack
  either fuses that stacking into the reduction or reads the stack again; a slice of the stack
  is the layer's own array (one H200: Mixtral bench 294.5 -> 279.3 ms, DeepSeek-V3 bench
  291.2 -> 278.7 ms)."""

  def squares(g):
    x = g[...]
    if by_layer and _is_variable(g) and is_stacked(g):
      return sum(jnp.sum(jnp.square(x[i].astype(jnp.float32))) for i in range(x.shape[0]))
    return jnp.sum(jnp.square(x.astype(jnp.float32)))

  return jnp.sqrt(sum(jax.tree.leaves(jax.tree.map(squares, grads, is_leaf=_is_variable))))


def make_optimizer(cfg: TrainConfig, moments: str = "float32") -> AdamW:
  """The run's optimizer (train.optimizer); `moments`: the dtype its moments are stored in."""
  common = dict(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                grad_clip=cfg.grad_clip, moments_dtype=DTYPES[moments],
                copy_stacked_grads=cfg.copy_stacked_grads)
  if cfg.optimizer == "muon":
    return Muon(learning_rate(cfg), momentum=cfg.muon_momentum, **common)
  return AdamW(learning_rate(cfg), **common)
