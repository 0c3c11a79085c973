"""KV-cache write (Triton): scatter this step's K/V rows into the paged cache in place.

Cache layout [N, S, Hkv, D] per layer; ``slot = block * S + offset``; slots < 0 mark padding
tokens (e.g. CUDA-graph padding) and are skipped.

Quantized cache (kv_cache_dtype "int8" / "fp8"; contract in xlaserve.quantization.kv_quant): the
caches hold int8 / float8_e4m3fn codes and k_scale / v_scale [N, S, Hkv] float32 one scale per
(token, KV head). The kernel quantizes each head's D values in registers: scale = max|x| / QMAX,
codes rounded half to even (int8 by the 1.5 * 2^23 trick, fp8 by rounding to the e4m3 grid in
float32 before an exact cast), bit-identical to the numpy reference for float32 inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xlaserve.config import KernelConfig

from ._common import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    next_pow2,
    pdl_kwargs,
    pdl_prologue,
    use_pdl,
)
from .kv_quant import QMAX, quantize_kv


@triton.jit
def _quantize_rows(x, QUANT_FP8: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] float32 (masked lanes 0) -> (codes as float32, scales [BLOCK_H])."""
    if QUANT_FP8:
        qmax = 448.0
    else:
        qmax = 127.0
    amax = tl.max(tl.abs(x), 1)
    # div_rn: IEEE division (Triton's default fp32 `/` is approximate on GPU), so the codes and
    # scales match the reference bit for bit there too.
    scale = tl.where(amax > 0, tl.math.div_rn(amax, qmax + tl.zeros_like(amax)), 1.0)
    y = tl.math.div_rn(x, scale[:, None] + tl.zeros_like(x))
    y = tl.minimum(tl.maximum(y, -qmax), qmax)
    if QUANT_FP8:
        # Round |y| to the e4m3 grid (3 mantissa bits; subnormal step 2^-9 below 2^-6) half to
        # even in float32, so the cast below is exact (the CPU interpreter's fp8 cast is not
        # round-to-nearest; GPUs' is, this is the same result).
        a = tl.abs(y)
        ebits = a.to(tl.int32, bitcast=True) & 0x7F800000
        qbits = tl.maximum(ebits - (3 << 23), (127 - 9) << 23)
        step = qbits.to(tl.float32, bitcast=True)
        magic = step * 12582912.0  # the same trick at the grid's step
        r = (a + magic) - magic
        y = tl.where(y < 0, -r, r)
    else:
        # 1.5 * 2^23: (y + M) - M rounds a float32 |y| < 2^22 to an integer, half to even.
        y = (y + 12582912.0) - 12582912.0
    return y, scale


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    ks_ptr,
    vs_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcn,
    stride_kcs,
    stride_kch,
    stride_vcn,
    stride_vcs,
    stride_vch,
    stride_sn,
    stride_ss,
    num_heads,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    QUANT_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // PAGE
    off = slot % PAGE
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < num_heads)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    kc = kc_ptr + blk * stride_kcn + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vc = vc_ptr + blk * stride_vcn + off * stride_vcs + h[:, None] * stride_vch + d[None, :]
    if QUANT:
        # Scales [N, S, Hkv] (last dim contiguous): one per (token, head).
        kq, k_s = _quantize_rows(tl.where(mask, k.to(tl.float32), 0.0), QUANT_FP8)
        vq, v_s = _quantize_rows(tl.where(mask, v.to(tl.float32), 0.0), QUANT_FP8)
        h_ok = h < num_heads
        tl.store(ks_ptr + blk * stride_sn + off * stride_ss + h, k_s, mask=h_ok)
        tl.store(vs_ptr + blk * stride_sn + off * stride_ss + h, v_s, mask=h_ok)
        tl.store(kc, kq.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, vq.to(vc_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def _check(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    name = "write_kv"
    if k.ndim != 3 or v.shape != k.shape:
        raise ValueError(
            f"{name}: k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{name}: caches must both be [N, S, Hkv, D], got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"{name}: k [T, Hkv, D] = {tuple(k.shape)} does not match cache [N, S, Hkv, D] = "
            f"{tuple(k_cache.shape)}"
        )
    if slot_mapping.dtype != torch.int32 or slot_mapping.ndim != 1:
        raise ValueError(
            f"{name}: slot_mapping must be int32 [T], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"{name}: slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} tokens"
        )
    check_kv_scales(name, k_cache, v_cache, k_scale, v_scale)
    cache_dtypes = FLOAT_DTYPES if k_scale is None else tuple(QMAX)
    for label, t in (("k", k), ("v", v)):
        check_dtype(f"{name} {label}", t, FLOAT_DTYPES)
    for label, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(f"{name} {label}", t, cache_dtypes)
    if k.dtype != v.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{name}: k/v dtypes ({k.dtype}, {v.dtype}) and cache dtypes must pair up")


def check_kv_scales(
    name: str,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Quantized cache checks: both scales or neither; float32 [N, S, Hkv], last dim contiguous,
    same strides; codes int8 / float8_e4m3fn."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError(f"{name}: pass both k_scale and v_scale or neither")
    if k_scale is None:
        if k_cache.dtype in QMAX:
            raise ValueError(
                f"{name}: a {k_cache.dtype} cache holds quantized codes: k_scale / v_scale needed"
            )
        return
    if k_cache.dtype not in QMAX:
        raise ValueError(
            f"{name}: k_scale given but the cache dtype is {k_cache.dtype} (want int8 or "
            "float8_e4m3fn codes)"
        )
    want = tuple(k_cache.shape[:3])
    for label, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.dtype != torch.float32 or tuple(t.shape) != want:
            raise ValueError(
                f"{name}: {label} must be float32 [N, S, Hkv] = {list(want)}, got {t.dtype} "
                f"{list(t.shape)}"
            )
        check_last_dim_contiguous(f"{name} {label}", t)
    if k_scale.stride() != v_scale.stride():
        raise ValueError(f"{name}: k_scale and v_scale must have the same strides")


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    kernels: KernelConfig | None = None,
) -> None:
    """Write K/V rows into the paged caches in place.

    Args:
        k, v: [T, Hkv, D] (last dim contiguous).
        k_cache, v_cache: [N, S, Hkv, D] (last dim contiguous); values are cast to the cache dtype.
        slot_mapping: int32 [T]; token t goes to block ``slot // S``, offset ``slot % S``; slots
            < 0 are skipped. Slots must be distinct (duplicates race).
        k_scale, v_scale: None, or float32 [N, S, Hkv] when the caches hold int8 /
            float8_e4m3fn codes: each (token, head) vector is quantized (scale written here).
    """
    _check(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    quant = k_scale is not None
    scales = (k_scale, v_scale) if quant else ()
    check_device("write_kv", k, v, k_cache, v_cache, slot_mapping, *scales)
    for label, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(f"write_kv {label}", t)
    t, hkv, d = k.shape
    if t == 0:
        return
    block_d = next_pow2(d)
    # About 2K elements per program: all heads of a token for small models, a few for big ones.
    block_h = min(next_pow2(hkv), max(1, 2048 // block_d))
    grid = (t, triton.cdiv(hkv, block_h))
    ks, vs = (k_scale, v_scale) if quant else (slot_mapping, slot_mapping)  # unused when float
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping, ks, vs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
        hkv,
        HEAD_DIM=d, PAGE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d,
        QUANT=quant, QUANT_FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=4, USE_PDL=(pdl := use_pdl(k, kernels)), **pdl_kwargs(pdl),
    )  # fmt: skip


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Plain torch reference of :func:`write_kv` (same arguments, in place)."""
    _check(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    n, s, hkv, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if k_scale is None:
        k_cache.view(n * s, hkv, d)[slots] = k[keep].to(k_cache.dtype)
        v_cache.view(n * s, hkv, d)[slots] = v[keep].to(v_cache.dtype)
        return
    for x, codes, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        xq, xs = quantize_kv(x[keep], codes.dtype)
        codes.view(n * s, hkv, d)[slots] = xq
        scales.view(n * s, hkv)[slots] = xs
