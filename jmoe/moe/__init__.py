"""The MoE layer as four stages (`MoE.__call__` in layer.py runs them in order, each under a
`jax.named_scope` of its name, so profiles and the memory estimate see them):

  route     route.py      router logits -> each token's k experts, their weights, balancing terms
  dispatch  dispatch.py   capacity (capacity.py) on a device's own copies, then the copies moved
            allgather.py  to their experts' devices and sorted by local expert; a dispatcher per
            alltoall.py   way of moving them (`DISPATCHERS`, layer.py; the no-mesh case)
  experts   experts.py    each local expert's gated FFN through grouped GEMMs (jmoe/ops/), or
                          per-expert blocks through a batched GEMM
  combine   combine.py    the outputs moved back (the dispatcher's `combine`), un-sorted, and each
                          token's k outputs summed with their weights

dispatch -> experts -> combine run on each device's tokens and experts, inside `jax.shard_map`
when a layout is active (`on_expert_shards`, dispatch.py).
"""

from jmoe.moe.capacity import apply_capacity
from jmoe.moe.combine import combine
from jmoe.moe.dispatch import Dispatcher, Rows, sort_by_expert
from jmoe.moe.experts import ExpertCompute, ExpertWeights, expert_ffn
from jmoe.moe.layer import DISPATCHERS, ExpertBias, MoE, bias_step
from jmoe.moe.route import RouterStats, Routing, balance_loss, route
