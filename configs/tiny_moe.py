"""A small MoE that trains on a 2-core CPU in a few minutes on the built-in corpus.

Experts, heads and the global batch are multiples of 8, so every 8-device layout applies to it.
Every key not set here keeps its default (see jmoe/config/schema.py).
"""

from jmoe.config import defaults


def get_config():
  c = defaults()
  c.model.update(vocab_size=264, d_model=128, num_layers=4, num_heads=8, num_kv_heads=4,
                 head_dim=16, d_ff=512, rope_theta=10_000.0, norm_eps=1e-6,
                 tie_embeddings=False, init_std=0.02)
  c.moe.update(num_experts=8, top_k=2, d_ff_expert=128, num_shared_experts=0, first_k_dense=1,
               dispatcher="allgather", capacity_factor=None, gemm="auto")
  c.moe.router.update(score="softmax", norm_topk_prob=True)
  c.moe.balance.update(aux_loss_coef=0.01, aux_loss_type="global", z_loss_coef=0.001,
                       bias_update_rate=0.0)
  c.parallel.dense.update(data=-1, fsdp=1, context=1, tensor=1)
  c.parallel.expert.update(data=-1, expert=1, tensor=1)
  c.train.update(steps=400, batch_size=16, micro_batch_size=0, seed=0, lr=3e-3,
                 min_lr_ratio=0.1, warmup_steps=30, weight_decay=0.1, b1=0.9, b2=0.95,
                 eps=1e-8, grad_clip=1.0, log_every=20, remat="none")
  c.data.update(source="stdlib", seq_len=128, max_corpus_bytes=16_000_000)
  c.precision.update(params="float32", compute="float32")
  c.checkpoint.update(every=0, keep=3)
  return c
