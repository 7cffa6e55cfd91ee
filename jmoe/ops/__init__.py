"""The primitives the model and the MoE layer stand on; this package imports neither.

  params.py        parameters with logical axes and a kind (what FLOPs and weight decay read)
  grouped_gemm.py  grouped GEMM backends behind one signature, and the batched GEMM
  fp8.py           float8 quantization and the dense FP8 GEMM (delayed or current scaling)
  fp8_grouped.py   FP8 grouped and batched expert GEMMs (row-wise scales)
  fp8_mosaic.py    the FP8 grouped GEMM on Hopper: what XLA prepares for jmoe's kernels
  fp8_mosaic_kernels.py  those kernels, on Pallas Mosaic-GPU (not imported until called)
  fp8_transpose.py the kernels' transposed (and gathered) float8 operands, on Pallas Triton
  fp8_blockwise.py DeepSeek-V3's blockwise scaling (1 x 128, 128 x 128 tiles)
  attention.py     attention kernels (cuDNN, XLA)
  max_logit.py     each attention head's largest logit, a block of queries at a time (QK-clip)
  activations.py   gated activations of the expert FFNs
  embedding.py     the embedding lookup, its gradient summed by token before the scatter
  remat.py         rematerialisation policies by checkpoint name
  rows.py          row moves: groups of sorted rows, gathers with gather gradients, `run_if`
Each registry here (`GEMM_BACKENDS`, `ATTENTION_KERNELS`, `GATED_ACTIVATIONS`, `REMAT_POLICIES`)
is the one list of names its config key may take: config validation reads it.
"""
