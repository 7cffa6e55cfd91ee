"""The trees a restore reads into: the arrays a run expects, with the shardings to place them in,
and the first way a checkpoint's saved arrays differ from them, said for the user.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs that carry the shardings to restore into."""
  return jax.tree.map(
      lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
      abstract, shardings)


def describe_mismatch(saved: Any, target: Any) -> str | None:
  """The first difference in structure, shape or dtype between saved metadata and a target tree,
  or None when they agree."""
  def by_name(tree):
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

  saved_leaves, target_leaves = by_name(saved), by_name(target)
  missing = sorted(target_leaves.keys() - saved_leaves.keys())
  if missing:
    return f"{len(missing)} array(s) this config needs are not in it, e.g. {missing[0]}"
  extra = sorted(saved_leaves.keys() - target_leaves.keys())
  if extra:
    return f"it holds {len(extra)} array(s) this config does not have, e.g. {extra[0]}"
  for name, want in target_leaves.items():
    have = saved_leaves[name]
    if tuple(have.shape) != tuple(want.shape) or np.dtype(have.dtype) != np.dtype(want.dtype):
      return (f"{name} is {np.dtype(have.dtype).name}{list(have.shape)} there but "
              f"{np.dtype(want.dtype).name}{list(want.shape)} in this config")
  return None
