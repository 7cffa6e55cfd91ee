"""A CPU-sized model of the Qwen3-MoE family (QK-norm, softmax top-k with renormalised weights),
trainable on the built-in corpus and exportable to Hugging Face's Qwen3MoeForCausalLM."""

import pathlib
import runpy


def get_config():
  c = runpy.run_path(str(pathlib.Path(__file__).with_name("tiny_moe.py")))["get_config"]()
  c.model.update(qk_norm=True, family="qwen3_moe")
  c.moe.update(first_k_dense=0)
  return c
