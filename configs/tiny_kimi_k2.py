"""A CPU-sized Kimi K2: tiny DeepSeek-V3's latent attention, shared expert and dense first layer,
with what Kimi K2 sets otherwise: sigmoid routing with a selection bias over all experts (no expert
groups), routed scaling 2.827, no multi-token prediction, and its YaRN (rope theta 50000, factor
32 from 4096, beta_fast = beta_slow = 1, the logits scaled by mscale_all_dim). Trainable on the
built-in corpus and exportable to Hugging Face's DeepseekV3ForCausalLM."""

import pathlib
import runpy


def get_config():
  c = runpy.run_path(str(pathlib.Path(__file__).with_name("tiny_deepseek_v3.py")))["get_config"]()
  c.model.update(rope_theta=50_000.0, mtp_depth=0)
  c.model.yarn.update(factor=32.0, original_max_len=4096, beta_fast=1.0, beta_slow=1.0,
                      mscale=1.0, mscale_all_dim=1.0)
  c.moe.router.update(num_groups=1, topk_groups=1, scaling_factor=2.827)
  return c
