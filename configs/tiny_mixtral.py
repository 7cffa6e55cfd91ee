"""A CPU-sized model of the Mixtral family (8 experts, top-2, sliding-window attention), trainable
on the built-in corpus and exportable to Hugging Face's MixtralForCausalLM."""

import pathlib
import runpy


def get_config():
  c = runpy.run_path(str(pathlib.Path(__file__).with_name("tiny_moe.py")))["get_config"]()
  c.model.update(family="mixtral", sliding_window=64)
  c.moe.update(first_k_dense=0, d_ff_expert=256)
  return c
