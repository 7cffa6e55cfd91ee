"""Typed, frozen configuration: one dataclass per concern.

The ml_collections file a user writes is converted into these once (see `load.py`); modules take
only the sub-config they need, never the whole tree (`parallel.*`, how a run uses its devices,
is in layout.py). Each number's range is in `validate.RANGES`, checked once with the rest of
validation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from jmoe.config.layout import ParallelConfig


@dataclass(frozen=True)
class YarnConfig:
  """YaRN rotary scaling; factor 1 turns it off."""
  factor: float = 1.0
  original_max_len: int = 4096  # the context length the model was pretrained with
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0
  mscale_all_dim: float = 0.0  # > 0: the softmax scale is also multiplied by mscale(all_dim)^2
  truncate: bool = True


@dataclass(frozen=True)
class MLAConfig:
  """Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank
  latents, and a decoupled rotary part shared by all heads."""
  q_lora_rank: int = 0  # 0: queries straight from the model width
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128


@dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 264
  d_model: int = 128
  num_layers: int = 4
  num_heads: int = 8
  num_kv_heads: int = 4
  head_dim: int = 16
  d_ff: int = 512  # hidden size of the dense MLP (the first_k_dense layers)
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = False
  init_std: float = 0.02
  attention: str = "gqa"  # gqa (grouped-query) | mla (multi-head latent, see `mla`)
  # auto: cuDNN's fused attention on GPUs for bf16/fp16, XLA's elsewhere | cudnn | xla
  attention_kernel: str = "auto"
  # cuDNN's attention on packed rows takes rows of up to this many documents (a batch with a row
  # of more runs XLA's kernel, a block of queries at a time, exact but slower); cuDNN's memory
  # and work grow with it (B x this many sequences of S tokens)
  attention_max_documents: int = 16
  mla: MLAConfig = field(default_factory=MLAConfig)
  yarn: YarnConfig = field(default_factory=YarnConfig)
  qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
  sliding_window: int = 0  # attend to the last this-many tokens only (0: the whole causal past)
  # With a sliding window: 0 windows every layer; k > 0 gives every k-th layer (index % k == k - 1)
  # full attention instead (GPT-OSS alternates: k = 2).
  full_attention_every: int = 0
  attention_bias: bool = False  # biases on the query, key, value and output projections
  attention_sinks: bool = False  # a learned per-head logit in every softmax denominator (GPT-OSS)
  mtp_depth: int = 0  # multi-token prediction modules (DeepSeek-V3: 1); module k predicts t+k+1
  # Layers per iteration of the loop over a stack of layers: 1 keeps compile time flat in depth;
  # num_layers (or more) gives straight-line code, with no loop buffers to initialise and fill.
  scan_unroll: int = 1
  # The Hugging Face architecture this model converts to and from (jmoe.convert): "" (none),
  # qwen3_moe, mixtral, deepseek_v3 or gpt_oss.
  family: str = ""

  def windowed(self, layer):
    """Whether layer `layer` (an int, or a traced index) attends through the sliding window."""
    if not self.sliding_window:
      return False
    if not self.full_attention_every:
      return True
    return layer % self.full_attention_every != self.full_attention_every - 1

  def layers_differ(self) -> bool:
    """Whether a layer's index decides what it does (windows on some layers, not all)."""
    return bool(self.sliding_window and self.full_attention_every)


@dataclass(frozen=True)
class RouterConfig:
  score: str = "softmax"  # softmax | softmax_topk (softmax over the k chosen logits) | sigmoid
  norm_topk_prob: bool = True  # renormalise the k chosen weights to sum to one
  scaling_factor: float = 1.0  # multiplies the final weights (DeepSeek's routed_scaling_factor)
  num_groups: int = 1  # group-limited routing: experts in this many equal groups ...
  topk_groups: int = 1  # ... and each token chooses among its this-many best groups
  bias: bool = False  # a learned bias on the router logits (GPT-OSS)
  jitter: float = 0.0  # during training, router inputs times uniform noise in [1-j, 1+j]
  # Benchmarks only: token t takes experts (t*k + j) mod E, every expert the same load (the
  # "forced balanced gate" that published MoE speeds use); weights stay the router's.
  force_balanced: bool = False


@dataclass(frozen=True)
class BalanceConfig:
  aux_loss_coef: float = 0.01  # Switch-style load-balancing loss, per MoE layer
  # Over which tokens the balance loss is computed: global (a micro-batch, all devices),
  # micro_batch (each data-parallel rank's share of it, averaged), seq (each sequence, averaged).
  aux_loss_type: str = "global"
  z_loss_coef: float = 0.0  # router z-loss (mean squared logsumexp of the router logits)
  # Aux-loss-free balancing: a per-expert selection bias moved by this much after each step
  # towards balance (bias += rate * sign(mean load - load)); 0 turns it off.
  bias_update_rate: float = 0.0


@dataclass(frozen=True)
class MoEConfig:
  num_experts: int = 8
  top_k: int = 2
  d_ff_expert: int = 128
  num_shared_experts: int = 0  # always-on experts of size d_ff_expert, summed into the output
  first_k_dense: int = 0  # the first k layers use a dense MLP instead of experts
  dispatcher: str = "allgather"  # how tokens reach experts on other devices: allgather | alltoall
  # alltoall: each peer's buffer holds this multiple of the mean copies a device sends a peer;
  # copies past it travel in further rounds (the overflow_rounds metric), none is dropped
  dispatch_factor: float = 1.25
  dispatch_chunks: int = 1  # the MoE layer's tokens in this many independent pieces (overlap)
  capacity_factor: float | None = None  # None or 0: dropless; else each expert takes at most
  # ceil(capacity_factor * T * top_k / num_experts) of the T tokens on a device
  drop_policy: str = "probability"  # which copies stay under a capacity: probability | position
  gemm: str = "auto"  # grouped GEMM backend: auto (mosaic on Hopper) | mosaic | ragged_dot | dense
  # > 0: each expert's rows, up to this multiple of the mean rows per expert, go into a block of
  # their own and all blocks run as one batched GEMM (fast on GPUs, and FP8-capable); rows past
  # a block take the grouped GEMM. Still dropless. 0: grouped GEMMs only.
  expert_blocks: float = 0.0
  activation: str = "swiglu"  # swiglu | clamped_swiglu (GPT-OSS: clamped, scaled gate, up + 1)
  swiglu_limit: float = 7.0  # clamped_swiglu: gate <= limit, |up| <= limit
  swiglu_alpha: float = 1.702  # clamped_swiglu: gate * sigmoid(alpha * gate)
  expert_bias: bool = False  # biases on each expert's projections (GPT-OSS)
  router: RouterConfig = field(default_factory=RouterConfig)
  balance: BalanceConfig = field(default_factory=BalanceConfig)


OPTIMIZERS = ("adamw", "muon")  # train.optimizer (jmoe/train/optimizer.py)


@dataclass(frozen=True)
class TrainConfig:
  steps: int = 100
  batch_size: int = 16  # global, in sequences
  micro_batch_size: int = 0  # 0: the whole batch at once; else gradients accumulate over micro-batches
  seed: int = 0
  lr: float = 3e-3
  min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
  warmup_steps: int = 20
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  grad_clip: float = 1.0  # global-norm clipping; 0 turns it off
  # adamw | muon: Muon (Newton-Schulz orthogonalised Nesterov momentum) for the hidden layers'
  # matrices, AdamW (b1, b2, eps above) for the rest; the same lr and weight decay carry over
  # (docs/OPTIMIZER.md). A resume keeps the optimizer its checkpoint was saved with.
  optimizer: str = "adamw"
  muon_momentum: float = 0.95  # Muon's Nesterov momentum
  # QK-clip (MuonClip), with either optimizer: after each update, every attention head whose
  # largest scaled logit q.k in the step exceeded qk_clip has its query and key projections
  # scaled so that it would be qk_clip (queries by eta**qk_clip_alpha, keys by the rest; MLA's
  # rotary part and grouped keys as docs/OPTIMIZER.md says). None or 0: off. Logs each layer's
  # largest logit (attention_max_logit).
  qk_clip: float | None = None
  qk_clip_alpha: float = 0.5
  # Copy each layer-stacked gradient into one array before the optimizer update. Without the copy
  # XLA may fuse the stacking of the layers' gradients into the update, where it can compute the
  # update once per output (parameter, two moments): DeepSeek-V3's bench 274.6 -> 245.7 ms with
  # the copy, at the cost of the largest stacked gradient in peak memory (+8.6 GiB); Mixtral's,
  # whose update XLA fuses well, 279.0 -> 282.7 ms. docs/PERFORMANCE.md.
  copy_stacked_grads: bool = False
  mtp_loss_weight: float = 0.3  # with model.mtp_depth > 0: weight of the mean MTP loss
  log_every: int = 10
  # Steps in a row whose loss or gradient norm is not finite (their updates are never applied)
  # after which training stops with a message.
  max_bad_steps: int = 3
  eval_every: int = 0  # steps between evaluations on the held-out split (0: none)
  # What the backward pass recomputes (jmoe/ops/remat.py): none | full | dots | attention |
  # attention_moe | attention_moe_experts | exchanges | offload_attention_moe
  remat: str = "none"

  @property
  def micro_batch(self) -> int:
    """Sequences per micro-batch (the whole batch without accumulation)."""
    return self.micro_batch_size or self.batch_size

  @property
  def num_micro_batches(self) -> int:
    return self.batch_size // self.micro_batch


@dataclass(frozen=True)
class DataConfig:
  # Where documents come from: comma-separated entries, each "[KIND:]PATH[@WEIGHT]" or "stdlib".
  # KIND: text (a file per document), jsonl, parquet (a text column), tokens (a directory from
  # `python -m jmoe.data.prepare`), chat (JSONL conversations, see jmoe/data/chat.py: rendered
  # with the tokenizer's chat template, only the assistant's tokens counted by the loss);
  # without it, it is read from the files. PATH: a file, a
  # directory or a glob. WEIGHT: the entry's share of a mixture (default 1). "stdlib": the Python
  # standard library's own sources, present on every machine (capped at max_corpus_bytes).
  source: str = "stdlib"
  tokenizer: str = ""  # a tokenizer.json file; "": bytes (258 ids)
  eod_token: str = ""  # the tokenizer's end-of-document token; "": the first of the usual names
  text_key: str = "text"  # the JSON field or Parquet column holding the text
  chat_key: str = "messages"  # chat sources: the JSON field holding a conversation's messages
  # chat sources: a .jinja file or tokenizer_config.json; "": the chat_template.jinja or
  # tokenizer_config.json beside data.tokenizer
  chat_template: str = ""
  seq_len: int = 256
  # concat: documents concatenated and cut into rows (no padding; a long document spans rows);
  # none: one document per row, cut at seq_len and padded.
  packing: str = "concat"
  shuffle: bool = True  # documents in a new random order each epoch
  eval_fraction: float = 0.0  # share of each source's documents held out for evaluation
  eval_batches: int = 4  # global batches of held-out rows in each evaluation
  prefetch: int = 2  # batches prepared ahead by a background thread
  max_corpus_bytes: int = 16_000_000


@dataclass(frozen=True)
class PrecisionConfig:
  params: str = "float32"  # storage dtype of the parameters (the master copy the optimizer updates)
  moments: str = "float32"  # storage dtype of AdamW's two moments (their update runs in float32)
  compute: str = "bfloat16"  # dtype of activations and GEMM inputs; router and losses stay float32
  # GEMM inputs: bf16 (the compute dtype) or fp8 (Hopper's FP8 tensor cores; see jmoe/ops/fp8.py).
  # mxfp8 and nvfp4 name Blackwell's block-scaled formats: planned, see docs/FP8.md.
  gemm: str = "bf16"
  # current (per-tensor amax now; experts per row and expert) | delayed (dense GEMMs: amax
  # history) | blockwise (experts: DeepSeek-V3's 1 x 128 / 128 x 128 tiles; dense as current)
  fp8_recipe: str = "current"
  fp8_amax_history: int = 16  # steps of amax kept per GEMM for delayed scaling
  fp8_grad_format: str = "e5m2"  # float8 format of the gradients: e5m2 | e4m3
  fp8_experts: bool = True  # the routed experts' GEMMs in FP8 (row-wise current scaling)
  # the dense GEMMs in FP8 as well: attention, dense MLPs, shared experts. Off by default: their
  # per-tensor scales are most of FP8's gradient error (docs/FP8.md; 200 steps on one H200 ended
  # +2.7% above bf16's held-out loss with them, +0.8% without, at about 1% less speed)
  fp8_dense: bool = False
  fp8_dispatch: bool = False  # tokens cross the expert-parallel exchange as float8 (row scales)
  # the expert GEMMs' weight gradient: fp8 (float8 kernels for it too) | bf16 (the 16-bit kernel
  # on the dequantized input) | auto (fp8 where a device's experts average 1,024 rows or more,
  # where it measured faster on moe.gemm=mosaic; docs/FP8.md)
  fp8_weight_gradient: str = "auto"
  # moe.gemm=mosaic's FP8 row kernels (forward, input gradient) with their sums added into
  # float32 registers every 128-deep K step: never | long (contractions of 8,192 and more, where
  # Hopper's FP8 accumulator lost bits: Mixtral's up input gradient 4.2e-3 off float32 against
  # 1.7e-3 promoted, at 1.8% of its bench step on one H200) | always (docs/FP8.md)
  fp8_promote: str = "long"
  # the expert weights' per-expert amax: kept (by the train step, from the weights it updates,
  # in the update's pass: one pass fewer; 2.7% of Mixtral's FP8 step) | each_use (read at use)
  fp8_weight_amax: str = "kept"


@dataclass(frozen=True)
class CheckpointConfig:
  every: int = 0  # 0: only the final save (and one on SIGTERM/SIGINT)
  keep: int = 3  # the newest this-many checkpoints are kept
  async_save: bool = True  # write in the background while training goes on
  # Threads for each of TensorStore's two pools (compression, file writes) in a save written in
  # the background; 0: half the process's cores less one, so that training keeps two of them
  # (jmoe/checkpoint/writer.py). A save that training waits for (the last) takes every core.
  write_threads: int = 0
  # A save that training waits for (the run's last, a stop signal's, each without async_save) is
  # written uncompressed, its wait the shorter (3.9 against 6.3 s for a 31.3 GiB state), unless
  # this is set: then it takes 28% less room on disk. Saves in the background are compressed.
  compress_waited: bool = False
  # Above 0: a save whose state nothing changes while it is written (the run's last, and saves
  # beside training from the state's copy on the devices) takes it to the host in parts of at
  # most this many GB, each taken while the one before is written, so that host memory holds two
  # parts rather than the whole state beside the checkpoints (page-locked memory reserved for two).
  # A save beside training without room for a copy still takes the whole state at once.
  staging_gb: float = 0.0
  # A model checkpoint or training workdir whose model variables (not optimizer state or step)
  # start this run; used only when the workdir has no checkpoint of its own yet.
  load_params: str = ""
  # True: the model's architecture (model.*, and moe.* but for how it runs: dispatch, GEMM
  # backend, capacity, balancing, router noise) is the one load_params' config.json records.
  load_params_config: bool = False


@dataclass(frozen=True)
class LoRAConfig:
  """Low-rank adapters: with rank > 0 each targeted weight W computes as W + (alpha / rank) A B,
  only A and B train (B starts at zero), and the base model stays frozen, out of the optimizer
  and out of the run's checkpoints (it is read from checkpoint.load_params)."""
  rank: int = 0  # 0: no adapters, every parameter trains
  alpha: float = 16.0
  # Comma-separated: attention (its projections), mlp (dense MLPs and shared experts), experts
  # (each routed expert's gate/up and down projections, its own factors)
  targets: str = "attention,mlp,experts"

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def applies_to(self, name: str) -> bool:
    """Whether adapters are on and `name` (attention, mlp or experts) is among the targets."""
    return self.rank > 0 and name in [t.strip() for t in self.targets.split(",")]


LORA_TARGETS = ("attention", "mlp", "experts")


@dataclass(frozen=True)
class Config:
  model: ModelConfig = field(default_factory=ModelConfig)
  moe: MoEConfig = field(default_factory=MoEConfig)
  parallel: ParallelConfig = field(default_factory=ParallelConfig)
  train: TrainConfig = field(default_factory=TrainConfig)
  data: DataConfig = field(default_factory=DataConfig)
  precision: PrecisionConfig = field(default_factory=PrecisionConfig)
  checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
  lora: LoRAConfig = field(default_factory=LoRAConfig)

  @property
  def moe_layers(self) -> int:
    """The MoE blocks' layers, after the first `moe.first_k_dense` dense ones: the stack that
    pipeline stages split."""
    return self.model.num_layers - self.moe.first_k_dense


def to_dict(config) -> dict:
  """A plain nested dict (JSON-ready) of any config dataclass."""
  return dataclasses.asdict(config)
