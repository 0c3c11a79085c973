"""Quantized KV cache: the contract both backends implement, and its numpy reference.

`kv_cache_dtype="int8"|"fp8"` stores every K and V vector (one token, one KV head, `head_dim`
values) as 8-bit codes with its own float32 scale (per token, per head: finer than per-head or
per-tensor scales, no calibration needed, and robust to outlier tokens):

    scale = max(|x|) / QMAX            (QMAX: int8 127, fp8 e4m3 448); scale = 1 when x == 0
    int8: q = clip(round_half_even(x / scale), -127, 127)
    fp8:  q = float8_e4m3fn(x / scale)   (round to nearest even by the cast)
    x_hat = float32(q) * scale

Cache layout per layer: (k_q, v_q, k_scale, v_scale) with k_q, v_q [num_blocks, block_size,
num_kv_heads, head_dim] of int8 / float8_e4m3fn and k_scale, v_scale [num_blocks, block_size,
num_kv_heads] float32. With "auto" the layer tuple stays (k, v) in the model dtype.
Bytes per token and head: head_dim + 4 (vs 2 * head_dim for bf16: 1.94x the capacity at head_dim
128, 1.88x at 64).

Backend-neutral: numpy only (ml_dtypes for float8), no torch or jax.
"""

from __future__ import annotations

import numpy as np

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
QMAX = {"int8": 127.0, "fp8": 448.0}


def kv_elem_bytes(kv_cache_dtype: str) -> int:
    """Bytes of one cached element for a quantized cache dtype."""
    if kv_cache_dtype not in QMAX:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return 1


def quantize_kv_ref(x: np.ndarray, kv_cache_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Reference quantizer. x [..., head_dim] float -> (codes [..., head_dim] int8 or
    float8_e4m3fn, scales [...] float32)."""
    qmax = QMAX[kv_cache_dtype]
    x = np.asarray(x, dtype=np.float32)
    amax = np.max(np.abs(x), axis=-1)
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    y = x / scale[..., None]
    if kv_cache_dtype == "int8":
        q = np.clip(np.rint(y), -127, 127).astype(np.int8)
    else:
        import ml_dtypes

        q = np.clip(y, -qmax, qmax).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def dequantize_kv_ref(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """codes [..., head_dim], scales [...] -> float32 [..., head_dim]."""
    return q.astype(np.float32) * np.asarray(scale, dtype=np.float32)[..., None]
