"""Per-device memory of a training step, estimated before anything is compiled.

The train step (the one `jmoe.train` compiles) is traced, not compiled, on the config's layout, and
its jaxpr walked as XLA's buffer assignment would see it (jmoe/memory/walk.py says what the walk
assumes): the most bytes ever live at once, plus the state, is the step's peak. The bytes
live there are put in categories by where they come from: parameters, optimizer state, gradients,
weight copies (weights cast or laid out anew), activations, dispatch buffers (the MoE layer's
exchange of tokens), the optimizer's update, the batch; values offloaded to host memory are
counted apart. docs/MEMORY.md has the estimate's measured error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import jax
import numpy as np

from jmoe.config import Config
from jmoe.memory.flat import divisor, flatten, is_literal, nbytes
from jmoe.memory.gpu import as_on_gpu, gpu_kernels_replaced
from jmoe.memory.liveness import Value
from jmoe.memory.walk import Walker
from jmoe.parallel import Layout
from jmoe.train.optimizer import learning_rate, make_optimizer
from jmoe.train.state import state_spec
from jmoe.train.step import compiled_peak, fitting_schedule, make_train_step

log = logging.getLogger("jmoe")

CATEGORIES = ("parameters", "optimizer state", "gradients", "weight copies", "activations",
              "dispatch buffers", "optimizer update", "batch")


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Per-device bytes at the step's peak, by category; `host` is what waits in host memory."""
  by_category: dict[str, int]
  host: int
  num_devices: int
  where: str  # the source line that allocates at the peak
  largest: tuple[tuple[int, str, str], ...] = ()  # (bytes, category, value) live at the peak

  @property
  def total(self) -> int:
    return sum(self.by_category.values())

  def table(self, device_bytes: int | None = None) -> str:
    unit, scale = ("GiB", 2**30) if max(self.total, device_bytes or 0) >= 2**30 else ("MiB", 2**20)
    gib = lambda b: f"{b / scale:10.2f}"
    rows = [f"{'per device':<20}{unit:>10}"]
    rows += [f"{name:<20}{gib(b)}" for name, b in self.by_category.items() if b]
    rows.append(f"{'total':<20}{gib(self.total)}")
    if self.host:
      rows.append(f"{'host (offloaded)':<20}{gib(self.host)}")
    if device_bytes:
      rows.append(f"{'device memory':<20}{gib(device_bytes)}  "
                  f"({'fits' if self.total <= device_bytes else 'does NOT fit'})")
    rows.append(f"peak at: {self.where}")
    return "\n".join(rows)


def _step_inputs(config: Config, layout: Layout):
  """The optimizer, the state's spec and the batch's shape of `config`'s train step on `layout`."""
  optimizer = make_optimizer(config.train, config.precision.moments)
  batch = {"tokens": jax.ShapeDtypeStruct((config.train.batch_size, config.data.seq_len + 1),
                                          np.int32)}
  return optimizer, state_spec(config, layout, optimizer), batch


def estimate(config: Config, layout: Layout, *, platform: str | None = None) -> MemoryEstimate:
  """Traces the config's train step on `layout` and walks it. `platform`: the one to estimate for
  (default: this one). For "gpu", attention is cuDNN's fused kernel and the grouped GEMM is
  XLA's, through the stand-ins of jmoe/memory/gpu.py, on whatever platform the trace runs."""
  platform = platform or jax.default_backend()
  if config.model.scan_unroll > 1:
    log.warning("model.scan_unroll=%d: the estimate walks the layers as a loop (their stacked "
                "buffers live throughout), which XLA's unrolled code does not keep: expect it "
                "too high (+58%% on the unrolled 1-GPU bench config, docs/MEMORY.md)",
                config.model.scan_unroll)
  if platform == "gpu":
    config = as_on_gpu(config)
  optimizer, spec, batch = _step_inputs(config, layout)
  step = make_train_step(spec.graphdef, config, optimizer, learning_rate(config.train))
  with layout.active(), (gpu_kernels_replaced() if platform == "gpu" else contextlib.nullcontext()):
    jaxpr = flatten(jax.make_jaxpr(step)(spec.abstract, batch).jaxpr)

  mesh = layout.mesh.shape
  splits = [divisor(s.spec, mesh) for s in jax.tree.leaves(spec.shardings)]
  splits.append(divisor(layout.batch.spec, mesh))
  kinds = _state_kinds(spec.abstract) + ["batch"]
  # Weight-shaped values (gradients, weights cast for compute) are placed like the weights.
  weights: dict[tuple[int, ...], tuple[int, Any]] = {}
  moe_layers = config.moe_layers
  for leaf, sharding in zip(jax.tree.leaves(spec.abstract.params),
                            jax.tree.leaves(spec.shardings.params)):
    d = divisor(sharding.spec, mesh)
    weights.setdefault(tuple(leaf.shape), (d, leaf.dtype))
    if leaf.ndim > 2:  # a stacked layer's slice, as the scan over layers sees it
      weights.setdefault(tuple(leaf.shape[1:]), (d, leaf.dtype))
    for shape in _stage_shapes(leaf.shape, sharding.spec, layout, moe_layers):
      weights.setdefault(shape, (d, leaf.dtype))

  env = {v: Value(nbytes(v.aval, d), d, kind) for v, d, kind in zip(jaxpr.invars, splits, kinds)}
  by_category = {name: 0 for name in CATEGORIES}
  for value in env.values():  # the state and the batch, there throughout
    by_category[value.kind] += value.bytes
  # The new state is written over the donated old one: its outputs take no new memory.
  in_place = {v for v in jaxpr.outvars[:len(kinds) - 1] if not is_literal(v)}
  result = Walker(dict(mesh), weights, platform).walk(jaxpr, env, in_place=in_place)
  for kind, b in result.at_peak.items():
    by_category[kind] += b
  return MemoryEstimate(by_category=by_category, host=result.host, num_devices=layout.mesh.size,
                        where=f"{result.where} ({'backward' if result.backward else 'forward'})",
                        largest=tuple((x.bytes, x.kind, x.what) for x in result.largest))


def compiled_bytes(config: Config, layout: Layout) -> int:
  """What XLA's compiled train step takes per device: its arguments (the state, donated, and the
  batch), the outputs that do not reuse them, and its temporaries. Compiles; for checking the
  estimate on devices at hand."""
  return compiled_peak(compiled_step(config, layout))


def compiled_step(config: Config, layout: Layout,
                  compiler_options: dict | None = None) -> jax.stages.Compiled:
  """The config's train step compiled for `layout`, from shapes alone."""
  return resolved_step(config, layout, compiler_options)[1]


def resolved_step(config: Config, layout: Layout, compiler_options: dict | None = None
                  ) -> tuple[Config, jax.stages.Compiled]:
  """The config with its pipeline schedule resolved (`auto`: the one that fits, as training picks
  it) and its train step compiled for `layout`, from shapes alone."""
  optimizer, spec, batch = _step_inputs(config, layout)
  return fitting_schedule(config, layout, spec, optimizer, batch, compiler_options)


def function_peak(fn, *args, platform: str = "gpu") -> int:
  """Bytes a function needs on one device beyond its arguments, at its peak, by the same walk
  (`args`: arrays or ShapeDtypeStructs)."""
  jaxpr = flatten(jax.make_jaxpr(fn)(*args).jaxpr)
  env = {v: Value(nbytes(v.aval, 1), 1, "batch") for v in jaxpr.invars}
  return Walker({}, {}, platform).walk(jaxpr, env).peak


def _stage_shapes(shape, spec, layout: Layout, moe_layers: int) -> list[tuple[int, ...]]:
  """The shapes pipeline stages regroup a stacked layer weight into (jmoe/model/pipeline.py):
  [R, W, S, ...] for the whole stack (W: the largest group's layers, the slots every stage
  holds), [W, S, ...] for one repeat and [S, ...] for one layer of every stage (the stages'
  programs run as one, vmapped over the stage axis)."""
  S, R = layout.stages, layout.repeats
  split = {a for entry in spec for a in (entry if isinstance(entry, tuple) else (entry,))}
  if S == 1 or len(shape) < 3 or shape[0] != moe_layers or not split & set(layout.stage_axes):
    return []
  width = max(layout.layer_groups(moe_layers))
  return [(R, width, S, *shape[1:]), (width, S, *shape[1:]), (S, *shape[1:])]


# Each TrainState field's category; the fields flatten in this (their declaration) order.
_STATE_KINDS = {"step": "optimizer state", "params": "parameters", "rest": "parameters",
                "opt_state": "optimizer state"}


def _state_kinds(abstract) -> list[str]:
  return [kind for field, kind in _STATE_KINDS.items()
          for _ in jax.tree.leaves(getattr(abstract, field))]
