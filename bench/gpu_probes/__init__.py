"""GPU probes: one-off scripts that measure one question on a CUDA machine (JSON under $OUT)."""
