"""DeepSeek-V3's real layer (d_model 7168, multi-head latent attention over 128 heads, experts of
2048 + 1 shared, top-8 of 4 of 8 groups by sigmoid scores, a dense first layer of 18,432,
vocabulary 129,280) with 4 layers on one H200: 1 dense + 3 MoE layers, 64 routed experts in the
same 8 groups (8 to a group instead of 32), no multi-token prediction module; batch 1 x 4096 tokens,
bf16 parameters and AdamW state, no recomputation, the 3 MoE layers unrolled, each stacked
gradient copied into one array before the update (`train.copy_stacked_grads`: 274.6 -> 245.7 ms).
Measured on 2026-12-02 (one H200): 247.9 ms, 356.7 model TFLOP/s, 102.0 GiB peak memory; the
transformers peer 318.7 TFLOP/s, 87.9 GiB (without the copy jmoe holds 93.5 GiB).

  python scripts/benchmark.py --config configs/bench/deepseek_v3_1gpu.py [--peer]
"""

import pathlib

from jmoe.config import read_config_file


def get_config():
  c = read_config_file(pathlib.Path(__file__).parents[1] / "deepseek_v3.py")
  c.model.update(num_layers=4, mtp_depth=0, scan_unroll=3)
  c.moe.update(num_experts=64, first_k_dense=1)
  c.moe.router.update(num_groups=8, topk_groups=4)
  c.train.update(batch_size=1, micro_batch_size=0, remat="none", warmup_steps=2, steps=100,
                 copy_stacked_grads=True)
  c.precision.update(params="bfloat16", compute="bfloat16", moments="bfloat16")
  c.data.seq_len = 4096
  return c
