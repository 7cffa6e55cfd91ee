"""The train state: parameters, optimizer state, step; created directly in its final placement."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jmoe.config import Config
from jmoe.model.factory import model_factory
from jmoe.moe.layer import keep_weight_amax
from jmoe.ops.fp8 import WeightAmax
from jmoe.ops.params import FROZEN_PARAMS, LoRAParam
from jmoe.parallel import Layout
from jmoe.train.optimizer import AdamW


@struct.dataclass
class TrainState:
  step: jax.Array
  params: nnx.State  # trainable variables: every nnx.Param, or with LoRA the adapters only
  # every other model variable: selection biases, FP8 amax histories and kept weight amaxes,
  # and with LoRA the frozen model itself (`frozen`)
  rest: nnx.State
  opt_state: Any


def placed_zeros(abstract: Any, shardings: Any) -> Any:
  """Zeros shaped as `abstract`'s ShapeDtypeStructs, each placed by its sharding in `shardings`."""
  return jax.tree.map(lambda a, s: jnp.zeros(a.shape, a.dtype, device=s), abstract, shardings)


def trainable(config: Config):
  """The filter of the variables that train: with lora.rank > 0 the adapters, else every
  parameter."""
  return LoRAParam if config.lora.rank else nnx.Param


def frozen(config: Config):
  """The filter of the frozen parameters in `rest` (with LoRA: the model under the adapters)."""
  return FROZEN_PARAMS if config.lora.rank else nnx.Nothing


@dataclasses.dataclass(frozen=True)
class StateSpec:
  """Everything about the train state except its values: how to build it and where it lives."""
  graphdef: nnx.GraphDef
  abstract: TrainState  # ShapeDtypeStructs
  shardings: TrainState  # NamedShardings
  init: Callable[[], TrainState]  # jitted; builds the state directly in its sharded placement
  # jitted: a state at step 0 with fresh optimizer state around given model variables
  init_from: Callable[[nnx.State, nnx.State], TrainState]
  init_adapters: Callable[[], nnx.State]  # jitted: new LoRA adapters (empty without LoRA)
  # jitted: (params, rest) -> the FP8 expert weights' kept amaxes (`WeightAmax`) made from
  # those parameters (empty where the model keeps none)
  weight_amax: Callable[[nnx.State, nnx.State], nnx.State]

  def with_weight_amax(self, state: TrainState) -> TrainState:
    """`state` with the kept weight amaxes made from its parameters: the ones it has replaced,
    or added where it has none (a checkpoint holds none: they are derived from the parameters,
    and parameters read from elsewhere bring none)."""
    zeros = placed_zeros(nnx.filter_state(self.abstract.rest, WeightAmax),
                         nnx.filter_state(self.shardings.rest, WeightAmax))
    if not jax.tree.leaves(zeros):
      return state
    rest = nnx.merge_state(nnx.filter_state(state.rest, nnx.Not(WeightAmax)), zeros)
    return state.replace(rest=nnx.merge_state(rest, self.weight_amax(state.params, rest)))


def state_spec(config: Config, layout: Layout, optimizer: AdamW) -> StateSpec:
  build = model_factory(config, train_state=True)

  def init() -> TrainState:
    _, params, rest = nnx.split(build(), trainable(config), ...)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest,
                      opt_state=optimizer.init(params))

  def init_from(params: nnx.State, rest: nnx.State) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest,
                      opt_state=optimizer.init(params))

  def init_adapters() -> nnx.State:  # (XLA drops the rest of the model it builds)
    return nnx.state(build(), LoRAParam)

  graphdef = nnx.graphdef(nnx.eval_shape(build))

  def weight_amax(params: nnx.State, rest: nnx.State) -> nnx.State:
    model = nnx.merge(graphdef, params, rest)
    keep_weight_amax(model)
    return nnx.state(model, WeightAmax)

  abstract = jax.eval_shape(init)
  shardings = layout.shardings(abstract)
  return StateSpec(graphdef=graphdef, abstract=abstract,
                   shardings=shardings, init=jax.jit(init, out_shardings=shardings),
                   init_from=jax.jit(init_from, out_shardings=shardings),
                   init_adapters=jax.jit(init_adapters, out_shardings=shardings.params),
                   weight_amax=jax.jit(weight_amax, out_shardings=nnx.filter_state(
                       shardings.rest, WeightAmax)))
