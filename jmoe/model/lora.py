"""Low-rank adapters (LoRA) on the model's dense weights.

With `lora.rank > 0`, a targeted weight W [in..., out...] gets factors A [in..., r] and B [r, out...]
(`LoRAParam`s, split over the devices like W's own axes), and its product becomes
x.W + (alpha / r) (x.A).B: the adapter's two thin products run beside W's, so W itself gets no
gradient. A module keeps its adapters in `self.lora`, keyed by the weight's attribute name; that
pairing is what `jmoe.ops.lora.merged` folds into the weights for export. The routed experts'
factors (one pair per expert) run through the experts' grouped GEMMs (jmoe/moe/experts.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmoe.config import LoRAConfig
from jmoe.ops.fp8 import Fp8Dot, project
from jmoe.ops.params import lora_factors
from jmoe.parallel import gathered


class Adapter(nnx.Module):
  """The factors of one dense weight, contracted with the input over its first `n_in` axes."""

  def __init__(self, weight: nnx.Param, n_in: int, cfg: LoRAConfig, *, rngs: nnx.Rngs):
    self.n_in, self.scale = n_in, cfg.scale
    self.a, self.b = lora_factors(rngs, weight.shape, weight.get_metadata()["axes"], n_in,
                                  cfg.rank, weight.dtype)

  def __call__(self, x: jax.Array, dtype) -> jax.Array:
    low = project(x, gathered(self.a, dtype), self.n_in, None)
    return project(low, gathered(self.b, dtype) * jnp.asarray(self.scale, dtype), 1, None)


def adapters(cfg: LoRAConfig | None, target: str, rngs: nnx.Rngs,
             **weights: tuple[nnx.Param | None, int]) -> nnx.Dict | None:
  """`self.lora` for a module: an Adapter for each (weight, n_in) given, when `target` is among
  lora.targets; else None."""
  if cfg is None or not cfg.applies_to(target):
    return None
  return nnx.Dict({name: Adapter(weight, n_in, cfg, rngs=rngs)
                   for name, (weight, n_in) in weights.items() if weight is not None})


def adapted(x: jax.Array, weight: nnx.Param, n_in: int, site: Fp8Dot | None, dtype,
            lora: nnx.Dict | None, name: str) -> jax.Array:
  """x . W over x's last `n_in` axes (in FP8 through `site`), plus W's adapter if it has one."""
  y = project(x, gathered(weight, dtype), n_in, site)
  if lora is None or name not in lora:
    return y
  return y + lora[name](x, dtype).astype(y.dtype)
