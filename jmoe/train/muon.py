"""Muon's orthogonalisation: a stack of matrices' nearest semi-orthogonal matrices, approximately.

Muon replaces a hidden matrix's momentum M by Newton-Schulz's approximation of U V^T
(M = U S V^T): every direction of the update the same size. jmoe's weights are rarely plain 2-D: a parameter names each axis's role (`matrix` in
jmoe/ops/params.py): `b` axes (layers of a stack, experts, gate/up) index separate matrices,
the `i` axes flattened are the matrix's rows and the `o` axes its columns. So attention's
W_q [D, H, A] is one D x HA matrix and an expert stack [L, E, D, 2, F] is L x E x 2 matrices
of D x F, each orthogonalised on its own.

The iteration is batched over the `b` axes as they are stored: an expert's matrices are
orthogonalised on the devices that hold the expert, nothing crosses the expert-parallel axes.
What the iteration needs whole, the matrix's own axes, is gathered from the axes that split it
(FSDP, tensor, expert-data and expert-tensor parallelism), and those mesh axes are lent to the
stack's `b` axes where they divide them (Layout.whole_matrix_spec): each device then takes its
share of the stack's matrices (an all-to-all there and back rather than an all-gather, and no
matrix computed twice). A single dense matrix under FSDP (MTP's projection, an unstacked first
dense layer) has no such axis: it is gathered whole and every device of its group computes it.

optax (0.2.8) has Muon (optax.contrib.muon) but its per-matrix reshape merges every batch axis
into one, which splits a stack [L, E, ...] sharded over E differently (a reshard across the
expert-parallel devices), its Newton-Schulz is not public API, and its state takes no part in
jmoe's skipped steps and storage dtypes; the iteration itself is a few lines, written here with
the usual quintic coefficients.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jmoe.parallel import Layout

# The quintic x -> a x + b x^3 + c x^5 on the singular values, with the largest slope at zero
# that still maps (0, 1] into about [0.7, 1.2] in five steps.
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
# The update's RMS ~ 0.2, AdamW's typical, whatever the matrix's shape
# (U V^T of an m x n matrix has RMS 1 / sqrt(max(m, n))), so that train.lr carries over.
RMS_MATCH = 0.2


def newton_schulz(x_BMN: jax.Array, steps: int = NS_STEPS, eps: float = 1e-7) -> jax.Array:
  """Approximately U V^T of each matrix [..., M, N] (batched over the leading axes), in
  x's dtype."""
  a, b, c = NS_COEFFS
  wide = x_BMN.shape[-2] <= x_BMN.shape[-1]
  x = x_BMN if wide else jnp.swapaxes(x_BMN, -1, -2)  # X X^T on the smaller side
  x = x / (jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True)) + eps)
  for _ in range(steps):
    a_BMM = jnp.einsum("...mn,...kn->...mk", x, x)
    b_BMM = b * a_BMM + c * jnp.einsum("...mk,...kj->...mj", a_BMM, a_BMM)
    x = a * x + jnp.einsum("...mk,...kn->...mn", b_BMM, x)
  return x if wide else jnp.swapaxes(x, -1, -2)


def matrix_shape(shape: tuple[int, ...], roles: str) -> tuple[int, int]:
  """(rows, columns) of each matrix of a parameter of `shape` and `roles`."""
  rows = math.prod(d for d, r in zip(shape, roles) if r == "i")
  return rows, math.prod(d for d, r in zip(shape, roles) if r == "o")


def orthogonalised(x: jax.Array, roles: str, axes: tuple | None = None,
                   layout: Layout | None = None) -> jax.Array:
  """Each matrix of `x` (laid out as `roles` says) orthogonalised, in float32, and scaled to
  AdamW's update RMS. `axes` and `layout`: the parameter's logical axes and the layout in
  effect, to place the iteration (none: as XLA likes)."""
  x = x.astype(jnp.float32)
  place = lambda y: y
  if layout is not None and axes:
    spec = layout.whole_matrix_spec(axes, x.shape, [r != "b" for r in roles])
    place = lambda y: jax.lax.with_sharding_constraint(y, NamedSharding(layout.mesh, spec))
  x = place(x)
  order = [i for r in "bio" for i, ri in enumerate(roles) if ri == r]
  moved = jnp.transpose(x, order)
  lead = moved.shape[:roles.count("b")]
  rows, columns = matrix_shape(x.shape, roles)
  y = newton_schulz(moved.reshape(*lead, rows, columns))
  y = jnp.transpose(y.reshape(moved.shape), [order.index(i) for i in range(x.ndim)])
  return place(y * (RMS_MATCH * math.sqrt(max(rows, columns))))
