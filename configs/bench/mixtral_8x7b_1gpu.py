"""Mixtral 8x7B's real layer (d_model 4096, 32 query / 8 key-value heads, 8 experts of 14,336,
top-2) with 6 layers on one H200: batch 2 x 4096 tokens, bf16 parameters and AdamW state, the
6 layers unrolled (no loop over the layer stack, whose buffers held 102.6 GiB against the
transformers peer's 69.3 on 2026-12-02). Its 50.1 GiB train state goes to the host 6 GB at a
time where nothing changes it meanwhile (`checkpoint.staging_gb`): `--loop 600` with a save every
200 holds two checkpoints in /dev/shm at its end, which beside the whole state in page-locked
memory outgrew a host of 128 GiB.

  python scripts/benchmark.py --config configs/bench/mixtral_8x7b_1gpu.py
"""

import pathlib

from jmoe.config import read_config_file


def get_config():
  c = read_config_file(pathlib.Path(__file__).parents[1] / "mixtral_8x7b.py")
  c.model.update(num_layers=6, scan_unroll=6)
  c.train.update(batch_size=2, micro_batch_size=0, remat="none", warmup_steps=2, steps=100)
  c.precision.update(params="bfloat16", compute="bfloat16", moments="bfloat16")
  c.data.seq_len = 4096
  c.checkpoint.staging_gb = 6.0
  return c
