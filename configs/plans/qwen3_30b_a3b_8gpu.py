"""Qwen3-30B-A3B on one host of 8 GPUs as NeMo AutoModel's published pre-training row lays it
out: experts 8 ways and everything else FSDP over the 8 GPUs, batch 512 x 4096 in 16
micro-batches of 4 sequences per GPU, every layer recomputed in the backward pass but for the
token rows its expert exchanges received, bf16 parameters and AdamW state.

Where it comes from: AutoModel's performance summary (docs/performance-summary.md, 2025-10-02:
DGX-H100, BF16; 8 GPUs, GBS 512, MBS 4, LBS 4, GA 16, TP 1, PP 1, CP 1, EP 8, FSDP 8; 21.773 s a
step, 277 model TFLOP/s and 12,040 tokens/s per GPU) and its recipe
(examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml: activation checkpointing on, DeepEP,
a forced balanced gate, Adam without weight decay, mock data). Read here as:
- 8 devices: dense FSDP 8, experts 8 ways (16 of the 128 per GPU), all-to-all dispatch;
- batch 512 sequences of 4096, micro-batches of 32 (4 per GPU): 16 accumulated micro-batches;
- `train.remat=exchanges` where AutoModel recomputes whole layers: the backward pass recomputes
  each layer but keeps the rows its all-to-alls received, so it sends a third less (1,681.8
  against 2,521.8 GiB of all-to-all per GPU per step with `full`) for 59 GiB more per GPU
  (compiled for 8 mocked H200s on 2026-12-04: 107.8 GiB against 48.7 with `full`;
  docs/MEMORY.md); bf16 parameters, moments and compute (the published rows are "BF16"; the
  dtypes of the optimizer's state are an assumption);
- `moe.router.force_balanced` (AutoModel's `fake_balanced_gate`); grad_clip 0, weight decay 0.
No pipeline stages: the schedule question does not arise.
Its step takes 107.8 GiB per GPU (XLA, compiled for 8 mocked H200s), more than the 75% of a GPU's
memory JAX takes by default (about 105 GiB of an H200): run it with
`XLA_PYTHON_CLIENT_MEM_FRACTION=0.92`, as scripts/launch_slurm.sh sets.

  python scripts/estimate_memory.py --config configs/plans/qwen3_30b_a3b_8gpu.py --devices 8
  python scripts/comm_volume.py --config configs/plans/qwen3_30b_a3b_8gpu.py --devices 8
"""

import pathlib

from jmoe.config import read_config_file

DEVICES = 8


def get_config():
  c = read_config_file(pathlib.Path(__file__).parents[1] / "qwen3_30b_a3b.py")
  c.parallel.dense.update(data=1, fsdp=8, context=1, tensor=1)
  c.parallel.expert.update(data=1, expert=8, tensor=1)
  c.moe.dispatcher = "alltoall"
  c.moe.router.force_balanced = True
  c.train.update(batch_size=512, micro_batch_size=32, remat="exchanges", grad_clip=0.0,
                 weight_decay=0.0)
  c.precision.update(params="bfloat16", moments="bfloat16", compute="bfloat16")
  c.data.seq_len = 4096
  return c
