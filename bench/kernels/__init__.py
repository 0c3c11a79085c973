"""Kernel micro-benchmarks (torch Triton/CUDA kernels, Pallas GPU attention) against their references."""
