"""Qwen3-30B-A3B's real layer (d_model 2048, 32 query / 4 key-value heads of 128, 128 experts of 768,
top-8, vocabulary 151,936) with 8 layers on one H200: batch 2 x 4096 tokens, bf16 parameters and
AdamW state (the policy of the transformers peer it is compared with), no recomputation, the 8
layers unrolled (no loop over the layer stack: 145 instead of 175 ms a step on an H200).

  python scripts/benchmark.py --config configs/bench/qwen3_30b_a3b_1gpu.py [--balanced]
"""

import pathlib

from jmoe.config import read_config_file


def get_config():
  c = read_config_file(pathlib.Path(__file__).parents[1] / "qwen3_30b_a3b.py")
  c.model.update(num_layers=8, scan_unroll=8)
  c.train.update(batch_size=2, micro_batch_size=0, remat="none", warmup_steps=2, steps=100)
  c.precision.update(params="bfloat16", compute="bfloat16", moments="bfloat16")
  c.data.seq_len = 4096
  return c
