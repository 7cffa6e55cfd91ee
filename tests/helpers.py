"""Small configs for tests: a nested dict of overrides on top of a tiny model."""

from __future__ import annotations

import copy

from flax import nnx

from jmoe.config import Config, from_config_dict
from jmoe.model.factory import model_factory
from jmoe.model.transformer import Transformer

TINY = {
    "model": dict(vocab_size=264, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=8, d_ff=64, init_std=0.05),
    "moe": dict(num_experts=8, top_k=2, d_ff_expert=16, first_k_dense=1,
                balance=dict(aux_loss_coef=0.01, z_loss_coef=0.001)),
    "train": dict(steps=8, batch_size=8, seed=0, lr=3e-3, warmup_steps=2, log_every=1),
    "data": dict(seq_len=32, max_corpus_bytes=400_000),
    "precision": dict(params="float32", compute="float32"),
}


def merge(base: dict, overrides: dict) -> dict:
  out = copy.deepcopy(base)
  for key, value in overrides.items():
    if isinstance(value, dict) and isinstance(out.get(key), dict):
      out[key] = merge(out[key], value)
    else:
      out[key] = value
  return out


def tiny_config(**overrides) -> Config:
  """e.g. tiny_config(moe=dict(top_k=1), train=dict(steps=4))"""
  return from_config_dict(merge(TINY, overrides))


def build(config: Config, seed: int | None = None) -> Transformer:
  """The model `config` describes, its parameters drawn by one compiled program (the values
  model_factory(config, seed)() draws op by op, in half the time)."""
  return nnx.jit(model_factory(config, seed))()
