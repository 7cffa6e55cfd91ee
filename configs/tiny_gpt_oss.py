"""A CPU-sized model of the GPT-OSS family (alternating sliding/full attention with sinks and
biases, biased experts with clamped SwiGLU, softmax over the top-k router logits), trainable on the
built-in corpus and exportable to Hugging Face's GptOssForCausalLM."""

import pathlib
import runpy


def get_config():
  c = runpy.run_path(str(pathlib.Path(__file__).with_name("tiny_moe.py")))["get_config"]()
  c.model.update(family="gpt_oss", sliding_window=32, full_attention_every=2, attention_bias=True,
                 attention_sinks=True)
  c.moe.update(first_k_dense=0, expert_bias=True, activation="clamped_swiglu")
  c.moe.router.update(score="softmax_topk", bias=True)
  return c
