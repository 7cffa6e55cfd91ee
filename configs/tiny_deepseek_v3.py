"""A CPU-sized model of the DeepSeek-V3 family (multi-head latent attention with a query latent,
shared expert, dense first layer, sigmoid group-limited routing with a selection bias), trainable
on the built-in corpus and exportable to Hugging Face's DeepseekV3ForCausalLM."""

import pathlib
import runpy


def get_config():
  c = runpy.run_path(str(pathlib.Path(__file__).with_name("tiny_moe.py")))["get_config"]()
  # Latent attention has a key and a value per query head (num_kv_heads = num_heads).
  c.model.update(attention="mla", family="deepseek_v3", head_dim=24, num_kv_heads=8)
  c.model.mla.update(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                     v_head_dim=16)
  c.moe.update(num_shared_experts=1, first_k_dense=1)
  c.moe.router.update(score="sigmoid", num_groups=4, topk_groups=2, scaling_factor=2.5)
  c.moe.balance.update(aux_loss_coef=0.0001, aux_loss_type="seq", bias_update_rate=0.001)
  return c
