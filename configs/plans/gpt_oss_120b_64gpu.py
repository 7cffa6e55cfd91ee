"""GPT-OSS-120B on 64 GPUs (8 hosts of 8) as NeMo AutoModel's published pre-training row lays it
out: everything FSDP over the 64 GPUs and the experts 64 ways, batch 512 x 4096 in 4
micro-batches of 2 sequences per GPU, bf16 parameters and AdamW state; everything recomputed but
what the exchanges received (`train.remat=exchanges`), where AutoModel recomputes nothing.

Where it comes from: AutoModel's performance summary (docs/performance-summary.md, 2025-10-02:
DGX-H100, BF16; 64 GPUs, GBS 512, MBS 2, LBS 2, GA 4, TP 1, PP 1, CP 1, EP "-", FSDP 64; 4.30 s
a step, 231 model TFLOP/s and 7,626 tokens/s per GPU) and its recipe
(examples/benchmark/configs/gptoss_120b_te_deepep.yaml: `ep_size: 64`, activation
checkpointing off, parameters resharded after the forward pass, DeepEP, FlexAttention, a forced
balanced gate, Adam without weight decay, mock data). The table leaves EP blank while the recipe
asks for 64: this plan follows the recipe (2 of the 128 experts per GPU, all-to-all dispatch).
- batch 512 sequences of 4096, micro-batches of 128 (2 per GPU): 4 accumulated micro-batches;
- `train.remat=exchanges` (see below); bf16 parameters, moments and compute (the published rows
  are "BF16"; the dtypes of the optimizer's state are an assumption);
- `moe.router.force_balanced` (AutoModel's `fake_balanced_gate`); grad_clip 0, weight decay 0.
No pipeline stages: the schedule question does not arise. Recomputing nothing, as published, does
not fit an H200 (`--config.train.remat=none`: estimate 139.2 GiB, XLA 136.7 on 64 mocked H200s;
docs/MEMORY.md): each MoE layer keeps its all-to-all blocks and its activations. `exchanges`
(estimate 45.5 GiB) keeps the blocks the exchanges received and recomputes the rest, so its
exchanges send what recomputing nothing sends (124.9 GiB per GPU per step); `attention_moe`
(33.4 GiB) exchanges every layer's rows again in the backward pass, 1.5 times as many.

  python scripts/estimate_memory.py --config configs/plans/gpt_oss_120b_64gpu.py --devices 64
  python scripts/comm_volume.py --config configs/plans/gpt_oss_120b_64gpu.py --devices 64
"""

import pathlib

from jmoe.config import read_config_file

DEVICES = 64


def get_config():
  c = read_config_file(pathlib.Path(__file__).parents[1] / "gpt_oss_120b.py")
  c.parallel.dense.update(data=1, fsdp=64, context=1, tensor=1)
  c.parallel.expert.update(data=1, expert=64, tensor=1)
  c.moe.dispatcher = "alltoall"
  c.moe.router.force_balanced = True
  c.train.update(batch_size=512, micro_batch_size=128, remat="exchanges", grad_clip=0.0,
                 weight_decay=0.0)
  c.precision.update(params="bfloat16", moments="bfloat16", compute="bfloat16")
  c.data.seq_len = 4096
  return c
