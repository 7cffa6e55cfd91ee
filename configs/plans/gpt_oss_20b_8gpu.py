"""GPT-OSS-20B on one host of 8 GPUs as NeMo AutoModel's published pre-training row lays it out:
everything FSDP over the 8 GPUs and the experts 8 ways, batch 256 x 4096 in 16 micro-batches of
2 sequences per GPU, nothing recomputed, bf16 parameters and AdamW state.

Where it comes from: AutoModel's performance summary (docs/performance-summary.md, 2025-10-02:
DGX-H100, BF16; 8 GPUs, GBS 256, MBS 2, LBS 2, GA 16, TP 1, PP 1, CP 1, EP "-", FSDP 8; 10.04 s
a step, 279 model TFLOP/s and 13,058 tokens/s per GPU) and its recipe
(examples/benchmark/configs/gptoss_20b_te_deepep.yaml: `ep_size: 8`, activation checkpointing
off, DeepEP, FlexAttention, a forced balanced gate, Adam without weight decay, mock data). The
table leaves EP blank while the recipe asks for 8: this plan follows the recipe (4 of the 32
experts per GPU, all-to-all dispatch).
- batch 256 sequences of 4096, micro-batches of 16 (2 per GPU): 16 accumulated micro-batches;
- `train.remat=none` (no activation checkpointing); bf16 parameters, moments and compute (the
  published rows are "BF16"; the dtypes of the optimizer's state are an assumption);
- `moe.router.force_balanced` (AutoModel's `fake_balanced_gate`); grad_clip 0, weight decay 0.
No pipeline stages: the schedule question does not arise.
Its step takes 76.99 GiB per GPU (XLA, compiled for 8 H200s by scripts/compile_for_gpu.py on
2026-12-05; 108.9 before the clamped SwiGLU kept only its inputs for the backward pass), within
the 75% of an H200's memory JAX takes by default (about 105 GiB), not within an 80 GB H100's.

  python scripts/estimate_memory.py --config configs/plans/gpt_oss_20b_8gpu.py --devices 8
  python scripts/compile_for_gpu.py --config configs/plans/gpt_oss_20b_8gpu.py --devices 8
  python scripts/comm_volume.py --config configs/plans/gpt_oss_20b_8gpu.py --devices 8
"""

import pathlib

from jmoe.config import read_config_file

DEVICES = 8


def get_config():
  c = read_config_file(pathlib.Path(__file__).parents[1] / "gpt_oss_20b.py")
  c.parallel.dense.update(data=1, fsdp=8, context=1, tensor=1)
  c.parallel.expert.update(data=1, expert=8, tensor=1)
  c.moe.dispatcher = "alltoall"
  c.moe.router.force_balanced = True
  c.train.update(batch_size=256, micro_batch_size=16, remat="none", grad_clip=0.0,
                 weight_decay=0.0)
  c.precision.update(params="bfloat16", moments="bfloat16", compute="bfloat16")
  c.data.seq_len = 4096
  return c
