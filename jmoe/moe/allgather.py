"""The all-gather dispatcher: gather the tokens of the EP x ETP group, compute the local experts on
the rows routed to them, reduce-scatter the partial outputs back to their tokens' devices.

Simple and dropless; every device receives every token of its group, whatever the routing. With
`fp8` the gathered token rows travel as float8 (jmoe/ops/exchange.py).
"""

from __future__ import annotations

from jax.ad_checkpoint import checkpoint_name

from jmoe.moe.dispatch import LocalDispatcher
from jmoe.ops.exchange import all_gather, reduce_scatter


class AllGatherDispatcher(LocalDispatcher):

  @property
  def _group(self) -> tuple[str, ...]:
    return self.axes.expert + self.axes.tensor

  def _gather(self, x_TD, expert_ids_TK, weights_TK):
    if not self._group:
      return x_TD, expert_ids_TK, weights_TK
    gather = all_gather(self._group)
    gathered = (all_gather(self._group, self.fp8)(x_TD), gather(expert_ids_TK),
                gather(weights_TK))
    # (named so that a remat policy may keep what crossed rather than gather it again)
    return tuple(checkpoint_name(a, "moe_dispatched") for a in gathered)

  def _reduce(self, y_TD):
    # Sums the other devices' experts (and ETP partial sums), keeps this device's tokens.
    return reduce_scatter(self._group)(y_TD) if self._group else y_TD
