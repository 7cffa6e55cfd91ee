"""The Layout: one mesh over all devices, and where parameters, batches and activations go on it."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmoe.config import ParallelConfig
from jmoe.parallel import rules
from jmoe.parallel.fold import Folding, fold


@dataclasses.dataclass(frozen=True)
class ExpertAxes:
  """Mesh axes of the expert layout, for the MoE layer's shard_map."""
  tokens: tuple[str, ...]  # every mesh axis: tokens are split over all devices in the MoE layer
  expert: tuple[str, ...]
  tensor: tuple[str, ...]
  num_expert_shards: int
  num_tensor_shards: int


@dataclasses.dataclass(frozen=True)
class Layout:
  """With pipeline stages, the stage axis splits the stacked MoE blocks (logical axis
  `stage_layers`); everywhere else (embedding, dense layers first, head, MTP) it is one more
  data axis for the batch and FSDP axis for the weights. `inside` is the view while a stage's
  program is traced: there the stage axis is the stages' own (jmoe/model/pipeline.py)."""
  mesh: Mesh
  folding: Folding
  inside: bool = False

  # ---- pipeline stages
  @property
  def stage_axes(self) -> tuple[str, ...]:
    return self.folding.stage

  @property
  def stages(self) -> int:
    return self.folding.stages

  @property
  def repeats(self) -> int:
    return self.folding.repeats

  def layer_groups(self, num_layers: int) -> tuple[int, ...]:
    """The layers of each group of the stack the stages split (stage s, repeat r: group
    r S + s), in layer order; one group without stages."""
    if self.stages == 1:
      return (num_layers,)
    return self.folding.parallel.layer_groups(num_layers)

  def inside_stages(self) -> Layout:
    return dataclasses.replace(self, inside=True)

  def on_stages(self, x: jax.Array) -> jax.Array:
    """x's leading axis split over the stages (the rest as XLA propagates it)."""
    if not self.stage_axes:
      return x
    spec = P(self.stage_axes, *([P.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def next_stage(self, x: jax.Array, *, wrap: bool = False) -> jax.Array:
    """x (leading axis over the stages) handed on: stage s + 1 gets stage s's slice, stage 0
    zeros (`wrap`: the last stage's). One collective-permute of a stage's slice per stage
    boundary, where a roll over the stage axis also sends the slice that stage 0 drops."""
    return self._hand_off(x, 1, wrap)

  def previous_stage(self, x: jax.Array, *, wrap: bool = False) -> jax.Array:
    """As `next_stage`, backwards (gradients in a schedule that runs them in its own loop):
    stage s - 1 gets stage s's slice, the last stage zeros (`wrap`: stage 0's)."""
    return self._hand_off(x, -1, wrap)

  def _hand_off(self, x: jax.Array, step: int, wrap: bool) -> jax.Array:
    if not self.stage_axes:
      return jnp.roll(x, step, axis=0) if wrap else jnp.zeros_like(x)
    axis, S = self.stage_axes, self.stages
    pairs = [(s, s + step) for s in range(S) if 0 <= s + step < S or wrap]
    pairs = [(s, t % S) for s, t in pairs]
    spec = P(axis)
    return jax.shard_map(lambda block: jax.lax.ppermute(block, axis, pairs), mesh=self.mesh,
                         in_specs=spec, out_specs=spec, axis_names=set(axis))(x)

  @property
  def _batch_stage(self) -> tuple[str, ...]:
    """The stage axis where it splits the batch: outside the stages' programs."""
    return () if self.inside else self.stage_axes

  # ---- parameters
  def param_spec(self, axes: Sequence[str | None], shape: Sequence[int], *,
                 stored: bool = True) -> P:
    """Where a weight is kept; `stored=False`: without the axes that only store it."""
    # Weights outside the stages are FSDP-sharded over the stage axis too, and so is a stack
    # whose layers the stages do not divide (uneven groups: each step gathers a stage's own).
    layers = dict(zip(axes, shape)).get("stage_layers")
    by_layers = layers is not None and layers % self.stages == 0
    more = () if by_layers else self.stage_axes

    def mesh_axes(name):
      if name == "stage_layers":
        return self.stage_axes if stored and by_layers else ()
      if name in rules.EXPERT_PARAMS:
        role = rules.EXPERT_PARAMS[name]
        if role == "data":
          return self.folding.expert[role] + more if stored else ()
        return self.folding.expert[role]
      if name in rules.DENSE_PARAMS:
        role = rules.DENSE_PARAMS[name]
        if role == "fsdp":
          return self.folding.dense[role] + more if stored else ()
        return self.folding.dense[role]
      return ()
    return self._spec([mesh_axes(a) if a else () for a in axes], shape)

  def whole_matrix_spec(self, axes: Sequence[str | None], shape: Sequence[int],
                        whole: Sequence[bool]) -> P:
    """Where an operation that needs the dimensions marked `whole` unsplit (Muon's Newton-Schulz
    on a stack of matrices) runs: those dimensions whole; the others split as stored, and the
    mesh axes freed from the whole ones moved onto them where they divide (each device then
    orthogonalises its share of the stack's matrices rather than every device all of them:
    an all-to-all in and out instead of an all-gather, and no computation repeated)."""
    stored = [tuple(e) if isinstance(e, tuple) else (() if e is None else (e,))
              for e in self.param_spec(axes, shape)]
    stored += [()] * (len(shape) - len(stored))
    freed = [a for e, w in zip(stored, whole) if w for a in e]
    entries = [() if w else e for e, w in zip(stored, whole)]
    for a in freed:
      for i, (dim, w) in enumerate(zip(shape, whole)):
        pieces = math.prod(self.mesh.shape[b] for b in entries[i]) * self.mesh.shape[a]
        if not w and dim % pieces == 0:
          entries[i] = entries[i] + (a,)
          break
    return P(*(e if e else None for e in entries))

  def compute_spec(self, axes: Sequence[str | None], shape: Sequence[int]) -> P:
    """Where one layer's weight is while its GEMM reads it: split as stored by tensor and expert
    parallelism, whole along what only stores it (FSDP, expert data, the stage axis)."""
    return self.param_spec(axes, shape, stored=False)

  def shardings(self, tree: Any) -> Any:
    """The same pytree with a NamedSharding for each array: nnx Variables (model and optimizer
    state) are placed by their `axes` metadata; other arrays are replicated."""

    def one(leaf):
      if isinstance(leaf, nnx.Variable):
        axes = leaf.get_metadata().get("axes")
        spec = self.param_spec(axes, leaf.shape) if axes else P()
        return leaf.replace(NamedSharding(self.mesh, spec))
      return NamedSharding(self.mesh, P())

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))

  # ---- activations and batches
  def activation_spec(self, axes: Sequence[str | None], shape: Sequence[int]) -> P:
    groups = []
    for a in axes:
      roles = rules.DENSE_ACTIVATIONS[a] if a else ()
      group = tuple(ax for role in roles for ax in self.folding.dense[role])
      groups.append(self._batch_stage + group if a == "act_batch" else group)
    return self._spec(groups, shape)

  @property
  def batch(self) -> NamedSharding:
    """Batches: sequences split over the data and FSDP devices (and the stages)."""
    return NamedSharding(self.mesh, P(self._batch_stage + self.folding.dense["data"]
                                      + self.folding.dense["fsdp"]))

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  @property
  def data_parallel_size(self) -> int:
    stages = 1 if self.inside else self.stages
    return stages * self.folding.dense_sizes["data"] * self.folding.dense_sizes["fsdp"]

  @property
  def expert_axes(self) -> ExpertAxes:
    f = self.folding
    tokens = tuple(a for a in f.axis_names if a not in self.stage_axes or not self.inside)
    return ExpertAxes(tokens=tokens, expert=f.expert["expert"], tensor=f.expert["tensor"],
                      num_expert_shards=f.expert_sizes["expert"],
                      num_tensor_shards=f.expert_sizes["tensor"])

  def describe(self, moe_layers: int | None = None) -> str:
    """A table of the mesh axes and what each layout uses them for; with pipeline stages and
    the model's `moe_layers`, how they are shared out over the stages."""
    f = self.folding
    rows = [f"{'mesh axis':<16}{'size':>5}  {'dense role':<10}  expert role"]
    for name, size in zip(f.axis_names, f.axis_sizes):
      dense_role, expert_role = (name, name) if name in f.stage else name.split("/")
      rows.append(f"{name:<16}{size:>5}  {dense_role:<10}  {expert_role}")
    sizes = lambda d: " x ".join(f"{k} {v}" for k, v in d.items() if v > 1) or "1 device"
    per_stage = " (each stage)" if f.stages > 1 else ""
    rows.append(f"dense:  {sizes(f.dense_sizes)}{per_stage}")
    rows.append(f"expert: {sizes(f.expert_sizes)}{per_stage}")
    if f.stages > 1:
      rows.append(f"pipeline: {f.stages} stages x {f.repeats} repeat(s) of the MoE blocks; "
                  f"elsewhere the stage axis splits the batch and shards the weights")
      if moe_layers:
        rows.append(f"pipeline: {stage_balance(self.layer_groups(moe_layers), f.stages)}")
    return "\n".join(rows)

  def _spec(self, groups: Sequence[tuple[str, ...]], shape: Sequence[int]) -> P:
    """Each dimension split over its group of mesh axes, or, where the group's size does not
    divide it, over the run of consecutive axes of the group with the most devices that does (the
    later axes first among equals: a micro-batch of 64 over 4 stages and 64 FSDP devices splits
    over the FSDP ones), else whole."""
    entries = []
    for group, dim in zip(groups, shape):
      group = tuple(a for a in group if self.mesh.shape[a] > 1)
      size = lambda run: math.prod(self.mesh.shape[a] for a in run)
      runs = [group[i:i + n] for n in range(len(group), 0, -1)
              for i in range(len(group) - n, -1, -1)]
      fits = [run for run in runs if dim % size(run) == 0]
      entries.append(max(fits, key=size) if fits else None)
    return P(*entries)

  # ---- the layout in effect while a step is traced
  @contextlib.contextmanager
  def active(self) -> Iterator[Layout]:
    token = _ACTIVE.set(self)
    try:
      yield self
    finally:
      _ACTIVE.reset(token)


_ACTIVE: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("jmoe_layout", default=None)


def active_layout() -> Layout | None:
  return _ACTIVE.get()


def stage_balance(counts: Sequence[int], stages: int) -> str:
  """How the MoE layers are shared out: per stage, and per group (virtual stage) where the
  stages have repeats; `counts`: each group's layers, group r * stages + s on stage s."""
  counts_RS = np.asarray(counts).reshape(-1, stages)
  text = "MoE layers per stage: " + ", ".join(str(c) for c in counts_RS.sum(0))
  if counts_RS.shape[0] > 1:
    text += (" (per virtual stage, each stage's repeats: "
             + ", ".join("+".join(str(c) for c in counts_RS[:, s]) for s in range(stages)) + ")")
  if len(set(counts)) > 1:
    text += f"; each group runs {max(counts)} slots, masked where it has fewer layers"
  return text


def gathered(variable: nnx.Variable, dtype) -> jax.Array:
  """A dense weight as its GEMM reads it, in `dtype`, placed by `Layout.compute_spec`: FSDP's
  all-gather of the weight before the product (and the reduce-scatter of its gradient after).
  Left to itself, XLA may instead gather the activations over the FSDP devices, a whole
  micro-batch on every device at real sizes. A layer of a stack (read inside the loop over
  layers) keeps the stack's axis names: the leading ones its value no longer has are dropped."""
  w = variable[...].astype(dtype)
  layout, axes = active_layout(), variable.get_metadata().get("axes")
  if layout is None or not axes:
    return w
  axes = tuple(axes)[len(axes) - w.ndim:]
  spec = layout.compute_spec(axes, w.shape)
  if spec == layout.param_spec(axes, w.shape):  # nothing to gather
    return w
  return jax.lax.with_sharding_constraint(w, NamedSharding(layout.mesh, spec))


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Pins an activation's placement by logical axis names; a no-op outside `Layout.active()`."""
  layout = active_layout()
  if layout is None:
    return x
  spec = layout.activation_spec(axes, x.shape)
  return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, spec))


def in_stages() -> bool:
  """Whether the code runs inside the pipeline's stages (vmapped over them)."""
  layout = active_layout()
  return layout is not None and layout.inside


def split_count(axes: Sequence[str | None], shape: Sequence[int], dim: int = 0) -> int:
  """Into how many parts the active layout splits dimension `dim` of an activation of logical
  `axes` and `shape` (1 outside `Layout.active()`)."""
  layout = active_layout()
  if layout is None:
    return 1
  names = layout.activation_spec(axes, shape)[dim] or ()
  names = (names,) if isinstance(names, str) else names
  return int(np.prod([layout.mesh.shape[name] for name in names], dtype=np.int64))


def make_layout(cfg: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Layout:
  devices = list(devices if devices is not None else jax.devices())
  folding = fold(cfg, len(devices))
  mesh = Mesh(np.asarray(devices).reshape(folding.axis_sizes), folding.axis_names)
  return Layout(mesh=mesh, folding=folding)
