"""Model: embeddings, attention, dense MLP, transformer blocks stacked over layers, output head.

Import `jmoe.model.transformer.Transformer`; this package init stays empty so that jmoe.moe can use
the building blocks here without an import cycle.
"""
