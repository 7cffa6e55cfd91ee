"""GPT-OSS-20B's real layer (d_model 2880, 64 query / 8 key-value heads of 64 with sinks and
biases, alternating 128-token sliding-window and full attention, 32 experts of 2880 with biases
and clamped SwiGLU, top-4, vocabulary 201,088) with 8 layers on one H200: batch 2 x 4096 tokens,
bf16 parameters and AdamW state, no recomputation, the 8 layers unrolled.

  python scripts/benchmark.py --config configs/bench/gpt_oss_20b_1gpu.py [--peer]
"""

import pathlib

from jmoe.config import read_config_file


def get_config():
  c = read_config_file(pathlib.Path(__file__).parents[1] / "gpt_oss_20b.py")
  c.model.update(num_layers=8, scan_unroll=8)
  c.train.update(batch_size=2, micro_batch_size=0, remat="none", warmup_steps=2, steps=100)
  c.precision.update(params="bfloat16", compute="bfloat16", moments="bfloat16")
  c.data.seq_len = 4096
  return c
