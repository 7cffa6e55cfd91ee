"""Rematerialisation policies: what the backward pass keeps of each layer's forward, by name.

The names are `jax.ad_checkpoint.checkpoint_name` points in the model: "attention_out" (the
attention kernel's output, so the kernel never reruns), "moe_input" (the normed input of the MoE
layer, before routing and dispatch) and "expert_hidden" (the experts' gated activations). The rest
is recomputed. `REMAT_POLICIES` is the list of names `train.remat` may take.
"""

from __future__ import annotations

import jax

_names = jax.checkpoint_policies.save_only_these_names
REMAT_POLICIES = {
    "none": None,  # keep everything
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only each layer's input
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep GEMM outputs
    "attention": _names("attention_out"),
    "attention_moe": _names("attention_out", "moe_input"),
    "attention_moe_experts": _names("attention_out", "moe_input", "expert_hidden"),
    # as attention_moe, but the saved tensors wait in host memory until the backward pass
    "offload_attention_moe": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["attention_out", "moe_input"],
        offload_src="device", offload_dst="pinned_host"),
}
