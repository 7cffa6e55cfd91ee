"""The whole Qwen3-30B-A3B (48 layers, random initialisation) on one host of 8 H200s: attention and
the LM head FSDP over the 8 GPUs, the 128 experts split 8 ways (EP 8, 16 per GPU, all-to-all
dispatch), batch 16 x 4096 (2 sequences per GPU, as in the 1- and 2-GPU configs), bf16 parameters
and AdamW state, attention and MoE inputs kept and the rest recomputed.

  python scripts/benchmark.py --config configs/bench/qwen3_30b_a3b_8gpu.py [--balanced]
  python scripts/estimate_memory.py --config configs/bench/qwen3_30b_a3b_8gpu.py --devices 8

Other layouts to try (docs/MEMORY.md has their estimated memory):
  --config.parallel.dense.fsdp=4 --config.parallel.dense.tensor=2           (TP 2 x FSDP 4)
  --config.parallel.expert.expert=4 --config.parallel.expert.tensor=2       (EP 4 x expert-TP 2)
  --config.moe.dispatcher=allgather
"""

import pathlib

from jmoe.config import read_config_file


def get_config():
  c = read_config_file(pathlib.Path(__file__).parents[1] / "qwen3_30b_a3b.py")
  c.train.update(batch_size=16, micro_batch_size=0, remat="attention_moe", warmup_steps=2,
                 steps=100)
  c.precision.update(params="bfloat16", compute="bfloat16", moments="bfloat16")
  c.parallel.dense.update(data=1, fsdp=8, context=1, tensor=1)
  c.parallel.expert.update(data=1, expert=8, tensor=1)
  c.moe.dispatcher = "alltoall"
  c.data.seq_len = 4096
  return c
