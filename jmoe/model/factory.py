"""The model a config describes: the one place a `Config` becomes a `Transformer`."""

from __future__ import annotations

from typing import Callable

from flax import nnx

from jmoe.config import Config
from jmoe.model.transformer import Transformer
from jmoe.ops.fp8 import recipe_from_config
from jmoe.ops.params import DTYPES


def model_factory(config: Config, seed: int | None = None, train_state: bool = False
                  ) -> Callable[[], Transformer]:
  """A zero-argument constructor for the model the config describes (its parameters drawn from
  `seed`, default `train.seed`); `train_state`: the model of a train state, with the variables
  only its train step keeps (the FP8 expert weights' amax, jmoe/ops/fp8.py `WeightAmax`)."""
  seed = config.train.seed if seed is None else seed

  def build() -> Transformer:
    return Transformer(config.model, config.moe, param_dtype=DTYPES[config.precision.params],
                       dtype=DTYPES[config.precision.compute], remat=config.train.remat,
                       fp8=recipe_from_config(config.precision, train_state),
                       lora=config.lora if config.lora.rank else None,
                       max_logit=bool(config.train.qk_clip),
                       rngs=nnx.Rngs(params=seed))

  return build
