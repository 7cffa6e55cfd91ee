"""The two logical-axis rule tables: logical name -> the layout role whose mesh axes shard it.

Parameters and activations of attention and dense layers follow the dense layout; expert weights
follow the expert layout. A dimension that its mesh axes do not divide stays whole (replicated).
"""

DENSE_PARAMS = {
    "embed": "fsdp",  # FSDP shards every dense weight along the model width ...
    "latent": "fsdp",  # ... or, for MLA's up-projections (no model-width axis), the latent rank
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
}

EXPERT_PARAMS = {
    "expert": "expert",
    "expert_embed": "data",  # expert weights are FSDP-sharded over their expert-data replicas
    "expert_mlp": "tensor",
}

DENSE_ACTIVATIONS = {
    "act_batch": ("data", "fsdp"),
    "act_seq": ("context",),  # attention: queries split over context; keys/values gathered
    "act_seq_sp": ("context", "tensor"),  # residual stream and norms: sequence parallel
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
}
