"""Model FLOPs per token, counted as Megatron-Core and NeMo AutoModel count them.

6 x the parameters of the GEMMs a token goes through (attention projections, dense MLPs or its top-k
and shared experts, the router, the LM head; not the embedding lookup), plus attention's scores and
weighted sums: 3 passes x 2 GEMMs x 2 FLOPs per multiply-add over the keys a query sees (half the
sequence when causal, about the window when windowed). Forward and backward, no recomputation.
"""

from __future__ import annotations

from flax import nnx

from jmoe.config import Config
from jmoe.model.factory import model_factory
from jmoe.ops.params import is_expert_weight, kind_of


def active_gemm_params(config: Config) -> int:
  """Parameters of the GEMMs one token passes through (experts: only the k it chooses), read
  from each parameter's kind (jmoe/ops/params.py)."""
  state = nnx.state(nnx.eval_shape(model_factory(config)), nnx.Param)
  total = 0
  for _, leaf in nnx.to_flat_state(state):
    if kind_of(leaf) != "gemm":
      continue
    if is_expert_weight(leaf):
      total += leaf.size // config.moe.num_experts * config.moe.top_k
    else:
      total += leaf.size
  if config.model.tie_embeddings:  # the head multiplies by the embedding table
    total += config.model.vocab_size * config.model.d_model
  return total


def attention_flops_per_token(config: Config, seq_len: int) -> float:
  m = config.model
  if m.attention == "mla":
    width = m.num_heads * (m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim + m.mla.v_head_dim)
  else:
    width = m.num_heads * 2 * m.head_dim  # the score GEMM and the value GEMM
  total = 0.0
  for layer in range(m.num_layers + m.mtp_depth):
    keys = seq_len / 2
    if m.windowed(layer) and m.sliding_window < seq_len:
      keys = m.sliding_window * (1 - m.sliding_window / (2 * seq_len))
    total += 3 * 2 * keys * width
  return total


def model_flops_per_token(config: Config, seq_len: int | None = None) -> float:
  seq_len = seq_len or config.data.seq_len
  return 6 * active_gemm_params(config) + attention_flops_per_token(config, seq_len)
