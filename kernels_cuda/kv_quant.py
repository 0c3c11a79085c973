"""Quantized KV cache, torch side: the torch twin of `xlaserve.quantization.kv_quant` (the
contract and its numpy reference), used by the CPU attention backends and the kernel references.

Per (token, KV head) float32 scale: ``scale = max|x| / QMAX`` (1 when x == 0); int8 codes are
``clip(round_half_even(x / scale), -127, 127)``, fp8 codes ``float8_e4m3fn(clip(x / scale,
-448, 448))`` (round to nearest even by the cast). Bit-identical to the numpy reference for
float32 inputs. Imports torch only (no triton).
"""

from __future__ import annotations

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
