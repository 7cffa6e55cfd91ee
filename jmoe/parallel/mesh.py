"""One mesh over all devices, and the placement of parameters and batches on it."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmoe.config import ConfigError, ParallelConfig

DATA = "data"

# Logical parameter axis -> mesh axes. Data parallelism replicates every parameter.
PARAM_RULES: dict[str, tuple[str, ...]] = {}


@dataclasses.dataclass(frozen=True)
class Layout:
  mesh: Mesh
  param_rules: dict[str, tuple[str, ...]]

  def spec(self, axes: Sequence[str | None]) -> P:
    return P(*(self.param_rules.get(a) if a else None for a in axes))

  def shardings(self, tree: Any) -> Any:
    """The same pytree with a NamedSharding for each array: nnx Variables (model and optimizer
    state) are placed by their `axes` metadata; other arrays are replicated."""

    def one(leaf):
      if isinstance(leaf, nnx.Variable):
        axes = leaf.get_metadata().get("axes")
        return leaf.replace(NamedSharding(self.mesh, self.spec(axes) if axes else P()))
      return NamedSharding(self.mesh, P())

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))

  @property
  def batch(self) -> NamedSharding:
    """Batches are split along their first (sequence) axis over the data-parallel devices."""
    return NamedSharding(self.mesh, P(DATA))

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  @property
  def data_parallel_size(self) -> int:
    return self.mesh.shape[DATA]


def make_layout(cfg: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Layout:
  devices = list(devices if devices is not None else jax.devices())
  n = len(devices)
  data = n if cfg.dense.data == -1 else cfg.dense.data
  if data != n:
    raise ConfigError(
        f"parallel.dense.data ({cfg.dense.data}) must equal the device count ({n}); use -1 for "
        f"all devices")
  mesh = Mesh(np.asarray(devices).reshape(data), (DATA,))
  return Layout(mesh=mesh, param_rules=PARAM_RULES)
