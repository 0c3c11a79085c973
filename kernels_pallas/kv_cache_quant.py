"""jnp side of the quantized KV cache (contract: xlaserve.quantization.kv_quant).

Every K/V vector (one token, one KV head, D values) becomes 8-bit codes plus one float32 scale:
scale = max|x| / QMAX (1 where x == 0), int8 codes = clip(round_half_even(x / scale), -127, 127),
fp8 codes = float8_e4m3fn(clip(x / scale, -448, 448)); x_hat = float32(codes) * scale. Same
arithmetic as the numpy reference `quantize_kv_ref`, so both give bit-identical codes and scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xlaserve.quantization.kv_quant import QMAX

# kv_cache_dtype name -> the dtype of the cached codes.
CODE_DTYPES: dict[str, jnp.dtype] = {
    "int8": jnp.dtype(jnp.int8),
    "fp8": jnp.dtype(jnp.float8_e4m3fn),
}


def code_dtype(kv_cache_dtype: str) -> jnp.dtype:
    """dtype of the codes of a quantized cache ("int8" | "fp8")."""
    if kv_cache_dtype not in CODE_DTYPES:
        raise ValueError(
            f"quantized kv_cache_dtype must be 'int8' or 'fp8', got {kv_cache_dtype!r}"
        )
    return CODE_DTYPES[kv_cache_dtype]


def kv_cache_dtype_of(dtype: jnp.dtype) -> str | None:
    """ "int8" / "fp8" for a code dtype, None for a float (unquantized) cache dtype."""
    for name, dt in CODE_DTYPES.items():
        if jnp.dtype(dtype) == dt:
            return name
    return None


def quantize_kv(x: jax.Array, kv_cache_dtype: str) -> tuple[jax.Array, jax.Array]:
    """x [..., D] float -> (codes [..., D] int8 / float8_e4m3fn, scales [...] float32)."""
    dt = code_dtype(kv_cache_dtype)
    qmax = QMAX[kv_cache_dtype]
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    # XLA's simplifier turns `a / broadcast(b)` into `a * broadcast(1 / b)` (1 ulp off the
    # contract's correctly rounded division, which flips codes at ties); dividing by a
    # materialized divisor behind an optimization barrier keeps the true division.
    qm = jax.lax.optimization_barrier(jnp.full(amax.shape, qmax, jnp.float32))
    scale = jnp.where(amax > 0, amax / qm, jnp.float32(1.0))
    y = x / jax.lax.optimization_barrier(jnp.broadcast_to(scale[..., None], x.shape))
    if kv_cache_dtype == "int8":
        q = jnp.clip(jnp.round(y), -127, 127).astype(dt)  # jnp.round: half to even
    else:
        q = jnp.clip(y, -qmax, qmax).astype(dt)
    return q, scale


def dequantize_kv(q: jax.Array, scale: jax.Array) -> jax.Array:
    """codes [..., D], scales [...] -> float32 [..., D]."""
    return q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]
