"""The MoE layer as four stages, each a pure function in its own file:

  route    (route.py)    router logits -> chosen experts, their weights, balancing terms
  dispatch (dispatch.py) token copies sorted by expert, tokens counted per expert
  experts  (experts.py)  grouped GEMMs over all experts at once, through a chosen backend
  combine  (combine.py)  un-sort, weighted sum over each token's k choices

`layer.py` holds the parameters and runs the stages in order.
"""

from jmoe.moe.capacity import apply_capacity
from jmoe.moe.combine import combine
from jmoe.moe.dispatch import Dispatched, dispatch
from jmoe.moe.experts import GEMM_BACKENDS, expert_ffn, grouped_gemm
from jmoe.moe.layer import ExpertBias, MoE, bias_step
from jmoe.moe.route import RouterStats, Routing, balance_loss, route
