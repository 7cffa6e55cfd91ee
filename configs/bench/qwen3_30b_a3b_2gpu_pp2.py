"""configs/bench/qwen3_30b_a3b_1gpu.py on two GPUs as two pipeline stages of 4 layers each
(PP 2), batch 4 x 4096 (2 sequences per GPU, as on one) in 4 micro-batches of one sequence:
7 iterations of the schedule for 4 micro-batches, a bubble of 1 / 5 = 20%.

  python scripts/benchmark.py --config configs/bench/qwen3_30b_a3b_2gpu_pp2.py

Each GPU keeps the activations of its 4 layers for all 4 micro-batches (as one GPU keeps 8 layers
for 2 sequences); more micro-batches shrink the bubble and grow that memory:
  --config.train.batch_size=8                               (8 micro-batches: bubble 11%)
  --config.parallel.pipeline_repeats=2                      (circular stages: bubble 11%)
"""

import pathlib

from jmoe.config import read_config_file


def get_config():
  c = read_config_file(pathlib.Path(__file__).with_name("qwen3_30b_a3b_1gpu.py"))
  c.train.update(batch_size=4, micro_batch_size=1)
  c.parallel.update(pipeline=2)
  c.parallel.dense.update(data=1, fsdp=1, context=1, tensor=1)
  c.parallel.expert.update(data=1, expert=1, tensor=1)
  return c
