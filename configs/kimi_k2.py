"""Kimi K2 (Moonshot AI; checkpoints declare DeepseekV3ForCausalLM with model_type kimi_k2): the
DeepSeek-V3 architecture with more experts and fewer heads. 61 layers (the first dense), multi-head
latent attention with 64 heads, 384 routed experts of 2048 + 1 shared, top-8 by sigmoid scores
with a selection bias and no expert groups; YaRN by 32 from 4K; no multi-token prediction module
in the released checkpoints. 1T total, 32B active parameters as the model card rounds them (the
technical report: 1.04T / 32.6B; jmoe counts 1.026T / 32.9B). Published hyperparameters.

Sources: config.json of moonshotai/Kimi-K2-Instruct on Hugging Face (the first release, July
2025; later ones stretch YaRN to 64) for every field below; the Kimi K2 technical report (arXiv
2507.20534) for the training recipe (MuonClip, not in jmoe yet: see issue 36). What jmoe does not
take from config.json (its loss weights) follows DeepSeek-V3's recipe, as import does.
"""

from jmoe.config import defaults


def get_config():
  c = defaults()
  # vocab_size 163840, hidden_size 7168, num_hidden_layers 61, num_attention_heads 64 (=
  # num_key_value_heads: latent attention), intermediate_size 18432 (the dense layer),
  # rope_theta 50000, rms_norm_eps 1e-6, tie_word_embeddings false, num_nextn_predict_layers 0.
  c.model.update(vocab_size=163840, d_model=7168, num_layers=61, num_heads=64, num_kv_heads=64,
                 head_dim=192, d_ff=18432, rope_theta=50_000.0, norm_eps=1e-6,
                 tie_embeddings=False, attention="mla", mtp_depth=0, family="deepseek_v3")
  # q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128
  # (head_dim above is qk_nope + qk_rope, as for DeepSeek-V3).
  c.model.mla.update(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                     qk_rope_head_dim=64, v_head_dim=128)
  # rope_scaling: type yarn, factor 32, original_max_position_embeddings 4096, beta_fast 1.0 and
  # beta_slow 1.0 (DeepSeek-V3 has 32 and 1), mscale 1.0, mscale_all_dim 1.0;
  # max_position_embeddings 131072 = 4096 x 32.
  c.model.yarn.update(factor=32.0, original_max_len=4096, beta_fast=1.0, beta_slow=1.0,
                      mscale=1.0, mscale_all_dim=1.0)
  # n_routed_experts 384, n_shared_experts 1, num_experts_per_tok 8, moe_intermediate_size 2048,
  # first_k_dense_replace 1, moe_layer_freq 1.
  c.moe.update(num_experts=384, top_k=8, d_ff_expert=2048, num_shared_experts=1,
               first_k_dense=1)
  # scoring_func sigmoid, topk_method noaux_tc (the selection bias), norm_topk_prob true,
  # routed_scaling_factor 2.827, n_group 1 and topk_group 1 (no group-limited selection).
  c.moe.router.update(score="sigmoid", norm_topk_prob=True, scaling_factor=2.827, num_groups=1,
                      topk_groups=1)
  # config.json's aux_loss_alpha (0.001) and seq_aux belong to the original training code and
  # change nothing at inference; jmoe keeps DeepSeek-V3's sequence-wise balance loss and bias rate.
  c.moe.balance.update(aux_loss_coef=0.0001, aux_loss_type="seq", bias_update_rate=0.001)
  c.precision.update(params="float32", compute="bfloat16")
  c.data.seq_len = 4096
  return c
