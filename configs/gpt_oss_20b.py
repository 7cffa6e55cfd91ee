"""GPT-OSS-20B (GptOssForCausalLM): 24 layers alternating 128-token sliding-window and full
attention with sinks and projection biases, 32 experts with biases and clamped SwiGLU, top-4 by a
softmax over the chosen router logits; YaRN to 128K. 20.9B total, 3.6B active parameters.
Published hyperparameters."""

from jmoe.config import defaults


def get_config():
  c = defaults()
  c.model.update(vocab_size=201088, d_model=2880, num_layers=24, num_heads=64, num_kv_heads=8,
                 head_dim=64, d_ff=2880, rope_theta=150_000.0, norm_eps=1e-5,
                 tie_embeddings=False, sliding_window=128, full_attention_every=2,
                 attention_bias=True, attention_sinks=True, family="gpt_oss")
  c.model.yarn.update(factor=32.0, original_max_len=4096, beta_fast=32.0, beta_slow=1.0,
                      truncate=False)
  c.moe.update(num_experts=32, top_k=4, d_ff_expert=2880, expert_bias=True,
               activation="clamped_swiglu", swiglu_limit=7.0, swiglu_alpha=1.702)
  c.moe.router.update(score="softmax_topk", bias=True)
  c.moe.balance.update(aux_loss_coef=0.0)
  c.precision.update(params="float32", compute="bfloat16")
  c.data.seq_len = 4096
  return c
