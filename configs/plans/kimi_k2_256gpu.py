"""Kimi K2 (1T) on 256 GPUs as NeMo AutoModel's published pre-training row lays it out: 8
pipeline stages of 32 GPUs, 4 virtual stages per GPU, experts 32 ways and everything else FSDP
over the 32 GPUs of a stage, batch 512 x 4096, micro-batches of one sequence per data-parallel
rank, every layer recomputed in the backward pass, bf16 parameters and AdamW state.

Where it comes from: AutoModel's performance summary (docs/performance-summary.md, 2025-10-02:
DGX-H100, BF16; 256 GPUs, GBS 512, MBS 1, LBS 8, GA 2, TP 1, PP 8, CP 1, EP 32, VP 4, FSDP 32;
8.86 s a step, 189 model TFLOP/s and 924 tokens/s per GPU) and its recipe
(examples/benchmark/configs/kimi_k2_te_deepep.yaml: interleaved 1F1B, pipeline micro-batch 1,
two layers per virtual stage, activation checkpointing on, DeepEP, a forced balanced gate, Adam
without weight decay, mock data). Read here as:
- 256 devices; `parallel.pipeline` 8 x `pipeline_repeats` 4 = 32 virtual stages for the 60 MoE
  layers (the dense first layer, embedding and head run outside the stages, split over all 256
  GPUs): 28 of 2 layers and 4 of 1 (jmoe's default split).
- per stage: dense FSDP 32, experts 32 ways (12 of the 384 per GPU), all-to-all dispatch.
- batch 512 sequences of 4096 in micro-batches of 32 (one per data-parallel rank, MBS 1): 16
  micro-batches in one pipeline pass. AutoModel runs them as two passes of 8 (LBS 8, GA 2); jmoe
  accumulates gradients over micro-batches only through its one pipelined pass (under the
  interleaved schedule the stage inputs in flight are bounded by the stages, not the 16).
- the recipe's activation checkpointing as `train.remat=none`, for the reason
  configs/plans/deepseek_v3_256gpu.py gives (the interleaved schedule's backward slots recompute
  each stage visit once already; `remat=full`: all-to-all 616.8 against 466.4 GiB per GPU and
  step, 3.03 against 2.29 times the routed copies; the estimate 81.9 GiB against 72.4).
- bf16 parameters, moments and compute (the published rows are "BF16"; the dtypes of the
  optimizer's state are an assumption, as for configs/plans/deepseek_v3_256gpu.py).
- `moe.router.force_balanced` (AutoModel's `fake_balanced_gate`); grad_clip 0, weight decay 0.
The schedule is the published one, interleaved 1F1B: the estimate fits an H200 at 81.9 GiB; XLA,
compiling for 256 mocked H200s (`--compare --mock-gpus 256`, 2026-12-03, with `remat=full`,
whose estimate was 72.4), at 79.7 GiB; `remat=none` has not been compiled for mocked GPUs yet.
Under GPipe it does not (201.3 GiB, docs/MEMORY.md: circular GPipe keeps each iteration's layer
weights for the backward pass).

  python scripts/estimate_memory.py --config configs/plans/kimi_k2_256gpu.py --devices 256
  python scripts/comm_volume.py --config configs/plans/kimi_k2_256gpu.py --devices 256
"""

import pathlib

from jmoe.config import read_config_file

DEVICES = 256


def get_config():
  c = read_config_file(pathlib.Path(__file__).parents[1] / "kimi_k2.py")
  c.parallel.update(pipeline=8, pipeline_repeats=4, pipeline_schedule="interleaved")
  c.parallel.dense.update(data=1, fsdp=32, context=1, tensor=1)
  c.parallel.expert.update(data=1, expert=32, tensor=1)
  c.moe.dispatcher = "alltoall"
  c.moe.router.force_balanced = True
  c.train.update(batch_size=512, micro_batch_size=32, remat="none", grad_clip=0.0,
                 weight_decay=0.0)
  c.precision.update(params="bfloat16", moments="bfloat16", compute="bfloat16")
  c.data.seq_len = 4096
  return c
