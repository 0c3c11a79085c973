"""Shared Torch layers the model files compose (linear, rotary, norms, MLP, paged attention)."""
