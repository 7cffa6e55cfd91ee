"""DeepSeek-V3 (671B) on 256 GPUs as NeMo AutoModel's published pre-training row lays it out:
4 pipeline stages of 64 GPUs, 8 virtual stages per GPU, experts 64 ways and everything else
FSDP over the 64 GPUs of a stage, batch 512 x 4096, micro-batches of one sequence per
data-parallel rank, every layer recomputed in the backward pass, bf16 parameters and AdamW state.

Where it comes from: AutoModel's performance summary (docs/performance-summary.md, 2025-10-02:
DGX-H100, BF16; 256 GPUs, GBS 512, MBS 1, LBS 8, GA 1, TP 1, PP 4, CP 1, EP 64, VP 8, FSDP 64;
8.18 s a step, 250 model TFLOP/s and 1,002 tokens/s per GPU) and its recipe
(examples/benchmark/configs/deepseek_v3_te_deepep.yaml: interleaved 1F1B, pipeline micro-batch
1, two layers per virtual stage, activation checkpointing on, DeepEP, a forced balanced gate,
Adam without weight decay, no gradient clipping, mock data). Read here as:
- 256 devices; `parallel.pipeline` 4 x `pipeline_repeats` 8 = 32 virtual stages for the 58 MoE
  layers (the 3 dense layers, embedding and head run outside the stages, where jmoe splits the
  batch and the weights over all 256 GPUs): 26 of 2 layers and 6 of 1 (jmoe's default split,
  the earlier groups taking the extra layer); AutoModel cuts the 61 layers, embedding and head
  included, into 2-layer stages, which jmoe's stack of MoE blocks cannot copy exactly.
- per stage: dense FSDP 64, experts 64 ways (4 of the 256 per GPU), all-to-all dispatch (the
  DeepEP dispatcher's pattern).
- batch 512 sequences of 4096 in micro-batches of 64 (one per data-parallel rank, MBS 1): 8
  micro-batches, one pipeline pass (AutoModel: GA 1).
- the recipe's activation checkpointing as `train.remat=none`: under jmoe's interleaved schedule
  each backward slot already recomputes its stage visit's forward pass from the visit's input
  (the stage keeps only those inputs between its slots), which is the work checkpointing every
  layer costs; `remat=full` would recompute each layer a second time inside the slot (all-to-all
  585.8 against 441.5 GiB per GPU and step, 2.93 against 2.21 times the routed copies, and a
  fifth more expert and attention work; `scripts/comm_volume.py`, 2026-12-04). The price is one
  visit's layer activations held during its backward slot: the estimate 72.4 GiB against 51.9.
- bf16 parameters, moments and compute: the published rows are "BF16" and AutoModel builds the
  model in bf16, whose Adam then keeps bf16 moments (an assumption: the recipe does not set the
  dtypes itself).
- `moe.router.force_balanced`, as AutoModel's `fake_balanced_gate`; grad_clip 0, weight decay 0.
- no multi-token prediction module (`model.mtp_depth=0`): AutoModel's DeepSeek-V3, like
  transformers', has none (an assumption from the model code, not stated in the table).
The schedule is the published one, interleaved 1F1B (`pipeline_schedule=interleaved`): the
estimate fits an H200 at 72.4 GiB (GPipe: 88.7, docs/MEMORY.md); XLA's figure, compiled for 256
mocked H200s with cuDNN's attention (2026-12-03, with `remat=full`, before jmoe stopped
replicating a micro-batch its stage x FSDP devices do not divide), was 64.7 GiB against that
estimate's 51.9; this plan's `remat=none` has not been compiled for mocked GPUs yet.

  python scripts/estimate_memory.py --config configs/plans/deepseek_v3_256gpu.py --devices 256
  python scripts/estimate_memory.py --config configs/plans/deepseek_v3_256gpu.py --compare \
      --mock-gpus 256   # on one GPU
  python scripts/comm_volume.py --config configs/plans/deepseek_v3_256gpu.py --devices 256
"""

import pathlib

from jmoe.config import read_config_file

DEVICES = 256


def get_config():
  c = read_config_file(pathlib.Path(__file__).parents[1] / "deepseek_v3.py")
  c.model.mtp_depth = 0
  c.parallel.update(pipeline=4, pipeline_repeats=8, pipeline_schedule="interleaved")
  c.parallel.dense.update(data=1, fsdp=64, context=1, tensor=1)
  c.parallel.expert.update(data=1, expert=64, tensor=1)
  c.moe.dispatcher = "alltoall"
  c.moe.router.force_balanced = True
  c.train.update(batch_size=512, micro_batch_size=64, remat="none", grad_clip=0.0,
                 weight_decay=0.0)
  c.precision.update(params="bfloat16", moments="bfloat16", compute="bfloat16")
  c.data.seq_len = 4096
  return c
