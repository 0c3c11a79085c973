"""Quantized KV cache, torch side: the torch twin of `xlaserve.quantization.kv_quant` (the
contract and its numpy reference), used by the CPU attention backends and the kernel references.

Per (token, KV head) float32 scale: ``scale = max|x| / QMAX`` (1 when x == 0); int8 codes are
``clip(round_half_even(x / scale), -127, 127)``, fp8 codes ``float8_e4m3fn(clip(x / scale,
-448, 448))`` (round to nearest even by the cast). Bit-identical to the numpy reference for
float32 inputs. Imports torch only (no triton).
"""

from __future__ import annotations

import math

import torch

# kv_cache_dtype -> code dtype in the cache.
KV_CODE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def kv_code_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """Cache code dtype for `kv_cache_dtype` ("auto" -> None: the cache stays in model dtype)."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype not in KV_CODE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto', 'int8' or 'fp8', got {kv_cache_dtype!r}")
    return KV_CODE_DTYPES[kv_cache_dtype]


def quantize_kv(x: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (codes [..., D] of code_dtype, scales [...] float32)."""
    if code_dtype not in QMAX:
        raise ValueError(f"KV code dtype must be int8 or float8_e4m3fn, got {code_dtype}")
    qmax = QMAX[code_dtype]
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    y = (x / scale[..., None]).clamp(-qmax, qmax)
    if code_dtype == torch.int8:
        return torch.round(y).to(torch.int8), scale  # torch.round: half to even
    return y.to(torch.float8_e4m3fn), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [..., D], scales [...] -> float32 [..., D]."""
    return q.float() * scale.float()[..., None]


def gather_context(
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    block_row: torch.Tensor,
    kv_len: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One sequence's keys (or values) from the paged cache: [kv_len, Hkv, D] in `dtype` (the
    torch reference backend and prefill_sdpa read a context this way).

    cache [N, S, Hkv, D]; scales [N, S, Hkv] float32 for a quantized cache (else None);
    block_row: the sequence's row of the block table (>= cdiv(kv_len, S) entries)."""
    _, page, hkv, d = cache.shape
    blocks = block_row[: math.ceil(kv_len / page)].long()
    x = cache[blocks].reshape(-1, hkv, d)[:kv_len]
    if scales is None:
        return x if x.dtype == dtype else x.to(dtype)
    return dequantize_kv(x, scales[blocks].reshape(-1, hkv)[:kv_len]).to(dtype)
