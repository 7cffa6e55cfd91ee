"""GPT-OSS-120B (GptOssForCausalLM): GPT-OSS-20B's layer, deeper and with more experts. 36 layers
alternating 128-token sliding-window and full attention with sinks and projection biases (64
query heads, 8 key/value heads of 64), 128 experts with biases and clamped SwiGLU, top-4 by a
softmax over the chosen router logits; YaRN to 128K. 116.8B total, 5.1B active parameters
(OpenAI's count, without the input embedding). Published hyperparameters.

Sources: config.json of openai/gpt-oss-120b on Hugging Face (num_hidden_layers 36,
num_local_experts 128, experts_per_token 4, hidden_size 2880, intermediate_size 2880,
num_attention_heads 64, num_key_value_heads 8, head_dim 64, sliding_window 128 on every other
layer, vocab_size 201088, rope_theta 150000, rope_scaling yarn factor 32 from 4096, beta_fast 32,
beta_slow 1, rms_norm_eps 1e-5, swiglu_limit 7.0, tie_word_embeddings false) and the gpt-oss model
card (arXiv 2508.10925: parameter counts, alpha 1.702). Every field but the layer and expert counts
is GPT-OSS-20B's.
"""

import pathlib
import runpy


def get_config():
  c = runpy.run_path(str(pathlib.Path(__file__).with_name("gpt_oss_20b.py")))["get_config"]()
  c.model.num_layers = 36
  c.moe.num_experts = 128
  return c
