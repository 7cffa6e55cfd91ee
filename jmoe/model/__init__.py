"""Model: embeddings, attention (GQA, MLA), dense MLP, blocks stacked over layers, MTP, output head.

`factory.model_factory(config)` builds the model a config describes; `transformer.Transformer` is
the model. The MoE layer the blocks use is jmoe.moe's; the kernels under both are jmoe.ops'.
"""
