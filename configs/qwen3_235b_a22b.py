"""Qwen3-235B-A22B (Qwen3MoeForCausalLM): 94 layers, 128 experts of 1536, top-8; 235B total, 22B
active parameters. Published hyperparameters."""

from jmoe.config import defaults


def get_config():
  c = defaults()
  c.model.update(vocab_size=151936, d_model=4096, num_layers=94, num_heads=64, num_kv_heads=4,
                 head_dim=128, d_ff=12288, rope_theta=1_000_000.0, norm_eps=1e-6,
                 tie_embeddings=False, qk_norm=True, family="qwen3_moe")
  c.moe.update(num_experts=128, top_k=8, d_ff_expert=1536, first_k_dense=0)
  c.moe.router.update(score="softmax", norm_topk_prob=True)
  c.moe.balance.update(aux_loss_coef=0.001)
  c.precision.update(params="float32", compute="bfloat16")
  c.data.seq_len = 4096
  return c
