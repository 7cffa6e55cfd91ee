"""configs/bench/qwen3_30b_a3b_1gpu.py on two GPUs: experts split in two (EP 2), attention data
parallel, batch 4 x 4096 (2 sequences per GPU, as on one).

  python scripts/benchmark.py --config configs/bench/qwen3_30b_a3b_2gpu_ep2.py
"""

import pathlib

from jmoe.config import read_config_file


def get_config():
  c = read_config_file(pathlib.Path(__file__).with_name("qwen3_30b_a3b_1gpu.py"))
  c.train.batch_size = 4
  c.parallel.dense.update(data=2)
  c.parallel.expert.update(data=1, expert=2)
  c.moe.dispatcher = "alltoall"
  return c
