"""Model checkpoints: a model's variables (Orbax) and its config (JSON) in one directory.

    CKPT/config.json   the jmoe config the model belongs to
    CKPT/model/        an Orbax checkpoint of every model variable (parameters, expert biases)

`jmoe.convert import-hf` writes these; `jmoe.score` and `jmoe.convert export-hf` read them, and
also read the latest train state of a training workdir.
"""

from __future__ import annotations

import json
import pathlib

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jmoe.config import Config, ConfigError, from_config_dict, to_dict
from jmoe.parallel import Layout
from jmoe.train.optimizer import make_optimizer
from jmoe.train.state import model_factory, state_spec


def save_model(directory: str | pathlib.Path, state: nnx.State, config: Config) -> None:
  directory = pathlib.Path(directory).absolute()
  directory.mkdir(parents=True, exist_ok=True)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(directory / "model", nnx.to_pure_dict(state), force=True)
  (directory / "config.json").write_text(json.dumps(to_dict(config), indent=2))


def read_config(directory: str | pathlib.Path) -> Config:
  path = pathlib.Path(directory) / "config.json"
  if not path.is_file():
    raise ConfigError(f"{path} does not exist: pass a directory written by `jmoe.convert "
                      f"import-hf` or a training --workdir")
  return from_config_dict(json.loads(path.read_text()))


def load_model(directory: str | pathlib.Path, layout: Layout) -> tuple[Config, nnx.Module]:
  """The model of a model checkpoint, or of a training workdir's latest checkpoint, with its
  variables placed on `layout`."""
  directory = pathlib.Path(directory).absolute()
  config = read_config(directory)
  abstract_model = nnx.eval_shape(model_factory(config))
  graphdef, abstract = nnx.split(abstract_model)
  if (directory / "model").is_dir():
    shardings = layout.shardings(abstract)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nnx.to_pure_dict(abstract), nnx.to_pure_dict(shardings))
    with ocp.StandardCheckpointer() as checkpointer:
      pure = checkpointer.restore(directory / "model", target)
    nnx.replace_by_pure_dict(abstract, pure)
    return config, nnx.merge(graphdef, abstract)
  from jmoe.checkpoint.manager import Checkpointer  # a training workdir
  checkpointer = Checkpointer(directory / "checkpoints", keep=1)
  step = checkpointer.latest_step()
  if step is None:
    raise ConfigError(f"{directory} holds neither model/ nor a checkpoint under checkpoints/")
  spec = state_spec(config, layout, make_optimizer(config.train))
  state = checkpointer.restore(step, spec.abstract, spec.shardings)
  checkpointer.close()
  return config, nnx.merge(spec.graphdef, state.params, state.rest)
