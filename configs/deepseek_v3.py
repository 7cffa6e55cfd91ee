"""DeepSeek-V3 (DeepseekV3ForCausalLM): 61 layers (first 3 dense), multi-head latent attention,
256 routed experts of 2048 + 1 shared, top-8 of 4 of 8 groups by sigmoid scores with a selection
bias; YaRN to 128K; one multi-token prediction module. 671B total, 37B active parameters in the
main model (the prediction module adds its own). Published hyperparameters."""

from jmoe.config import defaults


def get_config():
  c = defaults()
  c.model.update(vocab_size=129280, d_model=7168, num_layers=61, num_heads=128, num_kv_heads=128,
                 head_dim=192, d_ff=18432, rope_theta=10_000.0, norm_eps=1e-6,
                 tie_embeddings=False, attention="mla", mtp_depth=1, family="deepseek_v3")
  c.model.mla.update(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                     qk_rope_head_dim=64, v_head_dim=128)
  c.model.yarn.update(factor=40.0, original_max_len=4096, beta_fast=32.0, beta_slow=1.0,
                      mscale=1.0, mscale_all_dim=1.0)
  c.moe.update(num_experts=256, top_k=8, d_ff_expert=2048, num_shared_experts=1,
               first_k_dense=3)
  c.moe.router.update(score="sigmoid", norm_topk_prob=True, scaling_factor=2.5, num_groups=8,
                      topk_groups=4)
  c.moe.balance.update(aux_loss_coef=0.0001, aux_loss_type="seq", bias_update_rate=0.001)
  c.train.mtp_loss_weight = 0.3
  c.precision.update(params="float32", compute="bfloat16")
  c.data.seq_len = 4096
  return c
