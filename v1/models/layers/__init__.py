"""Layers shared by the models: linears with per-parameter weight loaders, RoPE, norms,
activations, embeddings and the LM head."""
