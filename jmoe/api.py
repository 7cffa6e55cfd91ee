"""jmoe from Python (notebooks, scripts): the pieces the commands are made of, by their short names.

  config = jmoe.load_config("configs/tiny_moe.py", ["train.steps=100"])
  with jmoe.Trainer(config, "/tmp/run") as trainer:
    records = trainer.train(50)          # logged records, as in metrics.jsonl
    load_LE = trainer.expert_load()      # [MoE layers, experts]
  config, model = jmoe.load_model("/tmp/run")   # a workdir or a model checkpoint
  logprobs = jmoe.score(model, [[1, 2, 3, 4]])
  new_tokens = jmoe.generate(model, [[1, 2, 3]], max_new_tokens=8)   # greedy, with a KV cache
  print(jmoe.estimate_memory(config).table())   # per device, before compiling
"""

from __future__ import annotations

import pathlib
from typing import Sequence

import jax
from flax import nnx

from jmoe.config import Config, ParallelConfig, load_config
from jmoe.train.loop import Trainer

__all__ = ["Config", "Trainer", "estimate_memory", "generate", "load_config", "load_model",
           "score"]


def load_model(path: str | pathlib.Path, devices: Sequence[jax.Device] | None = None
               ) -> tuple[Config, nnx.Module]:
  """The config and model of a training workdir (its latest checkpoint) or a model checkpoint,
  with the variables replicated for data-parallel use on `devices` (default: all)."""
  from jmoe.checkpoint.params import load_model as load
  from jmoe.parallel import make_layout
  return load(path, make_layout(ParallelConfig(), devices))


def score(model: nnx.Module, sequences: list[list[int]],
          devices: Sequence[jax.Device] | None = None) -> list[list[float]]:
  """log p(token i+1 | tokens up to i) for each sequence, as `python -m jmoe.score` writes."""
  from jmoe.inference.score import score as score_on
  from jmoe.parallel import make_layout
  return score_on(model, make_layout(ParallelConfig(), devices), sequences)


def generate(model: nnx.Module, prompts: list[list[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, cache: bool = True,
             devices: Sequence[jax.Device] | None = None) -> list[list[int]]:
  """New tokens after each prompt, as `python -m jmoe.generate` prints them (`cache=False`:
  the whole sequence again each step, the reference)."""
  from jmoe.inference.generate import generate as generate_on
  from jmoe.parallel import make_layout
  return generate_on(model, make_layout(ParallelConfig(), devices), prompts,
                     max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                     seed=seed, cache=cache)


def estimate_memory(config: Config, devices: Sequence[jax.Device] | None = None,
                    platform: str | None = None):
  """The per-device memory of `config`'s train step on its layout over `devices` (default: all),
  by category, before compiling (jmoe/memory/; docs/MEMORY.md). `platform`: the one estimated
  for (default: this one)."""
  from jmoe.memory import estimate
  from jmoe.parallel import make_layout
  return estimate(config, make_layout(config.parallel, devices), platform=platform)
