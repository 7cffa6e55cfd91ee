"""Qwen3-30B-A3B (Qwen3MoeForCausalLM): 48 layers, 128 experts of 768, top-8; 30.5B total, 3.3B
active parameters. Published hyperparameters; import weights with `python -m jmoe.convert import-hf`."""

from jmoe.config import defaults


def get_config():
  c = defaults()
  c.model.update(vocab_size=151936, d_model=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                 head_dim=128, d_ff=6144, rope_theta=1_000_000.0, norm_eps=1e-6,
                 tie_embeddings=False, qk_norm=True, family="qwen3_moe")
  c.moe.update(num_experts=128, top_k=8, d_ff_expert=768, first_k_dense=0)
  c.moe.router.update(score="softmax", norm_topk_prob=True)
  c.moe.balance.update(aux_loss_coef=0.001)
  c.precision.update(params="float32", compute="bfloat16")
  c.data.seq_len = 4096
  return c
