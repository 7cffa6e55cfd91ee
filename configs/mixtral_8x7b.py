"""Mixtral 8x7B (MixtralForCausalLM): 32 layers, 8 experts of 14336, top-2; 46.7B total, 12.9B
active parameters. Published hyperparameters."""

from jmoe.config import defaults


def get_config():
  c = defaults()
  c.model.update(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                 head_dim=128, d_ff=14336, rope_theta=1_000_000.0, norm_eps=1e-5,
                 tie_embeddings=False, sliding_window=0, family="mixtral")
  c.moe.update(num_experts=8, top_k=2, d_ff_expert=14336, first_k_dense=0)
  c.moe.router.update(score="softmax", norm_topk_prob=True)
  c.moe.balance.update(aux_loss_coef=0.02)
  c.precision.update(params="float32", compute="bfloat16")
  c.data.seq_len = 4096
  return c
