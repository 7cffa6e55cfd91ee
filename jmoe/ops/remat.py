"""Rematerialisation policies: what the backward pass keeps of each layer's forward, by name.

The names are `jax.ad_checkpoint.checkpoint_name` points in the model: "attention_out" (the
attention kernel's output, so the kernel never reruns), "moe_input" (the normed input of the MoE
layer, before routing and dispatch), "expert_hidden" (the experts' gated activations), and
"moe_dispatched" / "moe_returned" (the token rows an expert-parallel MoE layer received from the
other devices with the routing that sent them, and its experts' results received back). The rest
is recomputed. `REMAT_POLICIES` is the list of names `train.remat` may take.

`exchanges` keeps only what crossed devices: the backward pass recomputes each layer (attention,
router, experts) but sends no token rows beyond the gradients' own exchanges, where `full` and
`attention_moe` send the forward's twice more. The kept rows go with the forward's routing (the
experts and weights each copy was sent with, also kept), never with a recomputed one that a near
tie could change. Its memory: each MoE layer's received and returned rows (about 2 x
dispatch_factor x top_k x the tokens' rows with `alltoall`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_names = jax.checkpoint_policies.save_only_these_names
REMAT_POLICIES = {
    "none": None,  # keep everything
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only each layer's input
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep GEMM outputs
    "attention": _names("attention_out"),
    "attention_moe": _names("attention_out", "moe_input"),
    "attention_moe_experts": _names("attention_out", "moe_input", "expert_hidden"),
    "exchanges": _names("moe_dispatched", "moe_returned"),
    # as attention_moe, but the saved tensors wait in host memory until the backward pass
    "offload_attention_moe": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["attention_out", "moe_input"],
        offload_src="device", offload_dst="pinned_host"),
}


def zeros_with(shape: tuple[int, ...], dtype, value) -> jax.Array:
  """Zeros of `shape`, made only once `value` exists: from a zero tied to it by an optimization
  barrier. From a plain constant, XLA may make a backward pass's zeros (a scatter's operand, a
  loop's starting sums) at its start and hold them to their use (scripts/compile_for_gpu.py)."""
  zero, _ = jax.lax.optimization_barrier((jnp.zeros((), dtype), value))
  return jnp.broadcast_to(zero, shape)
