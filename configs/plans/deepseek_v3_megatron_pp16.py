"""DeepSeek-V3 (671B) on 1024 GPUs as Megatron-Core's DeepSeek-V3 benchmark lays it out: 16
pipeline stages of 64 GPUs with uneven first and last stages, experts 64 ways, batch 8192 x 4096
in micro-batches of one sequence per data-parallel rank, float32 master weights and AdamW moments
with bf16 compute.

Where it comes from: the Megatron MoE model zoo's benchmark table
(runtime_configs/benchmarking/runtime.conf, DeepSeek-V3: TP 1, PP 16, EP 64, CP 1, VPP 1, MBS 1,
GBS 8192, 61 layers, the flex dispatcher (DeepEP), 128 nodes of 8, first and last pipeline
stages of 4 and 1 layers) with its model file (model_configs/benchmarking/DeepSeek-V3.yaml:
bf16 mixed precision with the distributed optimizer, sequence parallelism, 3 dense layers then
58 MoE layers, the multi-token prediction layer commented out). Read here as:
- 1024 devices; `parallel.pipeline` 16, no virtual stages. Megatron's first stage holds the 3
  dense layers and the first MoE layer (4), the last stage one MoE layer before the head, the
  14 others 4 each. jmoe pipelines the MoE blocks only (the dense layers, embedding and head
  run outside the stages, split over all 1024 GPUs): `pipeline_first` 1 and `pipeline_last` 1
  leave 56 MoE layers for the 14 middle stages, 4 each, as Megatron has them.
- per stage: dense FSDP 64 (Megatron: data-parallel 64 with its distributed optimizer, which
  shards the optimizer state but keeps a stage's bf16 weights and gradients whole, so jmoe's
  FSDP holds less), experts 64 ways (4 of the 256 per GPU), all-to-all dispatch.
- batch 8192 sequences of 4096 in micro-batches of 64 (one per data-parallel rank): 128
  micro-batches in one pass, 143 iterations of the schedule.
- `train.remat=full`: the benchmark's recomputation is left to the command line (the zoo's
  examples use selective recomputation of MLA's up-projections and norms); a plausible choice,
  not the published one. Under 1F1B, as Megatron, at most 2 S - 1 = 31 micro-batches' stage
  inputs are in flight on the first stage, whatever the 128.
- float32 parameters and moments, bf16 compute (Megatron's bf16 mode keeps float32 master weights
  and Adam moments); no multi-token prediction module, as the benchmark ran.
- `moe.router.force_balanced`: the zoo's scripts name `--moe-router-force-load-balancing` for
  forced-balance (dropless) speed runs, as AutoModel's rows use a balanced gate.
The schedule is the published one, 1F1B: the estimate fits an H200 at 59.9 GiB (GPipe: 96.2,
docs/MEMORY.md), and so does XLA's compile for 1,024 mocked H200s (`--compare --mock-gpus 1024`,
2026-12-03, afternoon): 41.6 GiB. Before 3fb6145 it needed 965.9 GiB: XLA replicated the stages'
copies of the 128 micro-batches when it cut the batch into them; jmoe now cuts it in two moves
that XLA plans as collectives (docs/MEMORY.md, "the three rows on mocked H200s";
tests/test_pipeline.py).

  python scripts/estimate_memory.py --config configs/plans/deepseek_v3_megatron_pp16.py --devices 1024
  python scripts/comm_volume.py --config configs/plans/deepseek_v3_megatron_pp16.py --devices 1024
"""

import pathlib

from jmoe.config import read_config_file

DEVICES = 1024


def get_config():
  c = read_config_file(pathlib.Path(__file__).parents[1] / "deepseek_v3.py")
  c.model.mtp_depth = 0
  c.parallel.update(pipeline=16, pipeline_first=1, pipeline_last=1, pipeline_schedule="1f1b")
  c.parallel.dense.update(data=1, fsdp=64, context=1, tensor=1)
  c.parallel.expert.update(data=1, expert=64, tensor=1)
  c.moe.dispatcher = "alltoall"
  c.moe.router.force_balanced = True
  c.train.update(batch_size=8192, micro_batch_size=64, remat="full")
  c.precision.update(params="float32", moments="float32", compute="bfloat16")
  c.data.seq_len = 4096
  return c
