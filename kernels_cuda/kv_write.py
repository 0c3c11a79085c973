"""KV-cache write (Triton): scatter this step's K/V rows into the paged cache in place.

Cache layout [N, S, Hkv, D] per layer; ``slot = block * S + offset``; slots < 0 mark padding
tokens (e.g. CUDA-graph padding) and are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device, check_dtype, check_last_dim_contiguous, next_pow2


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
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
    num_heads,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
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
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def _check(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
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
    for label, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(f"{name} {label}", t, FLOAT_DTYPES)
    if k.dtype != v.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{name}: k/v dtypes ({k.dtype}, {v.dtype}) and cache dtypes must pair up")


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write K/V rows into the paged caches in place.

    Args:
        k, v: [T, Hkv, D] (last dim contiguous).
        k_cache, v_cache: [N, S, Hkv, D] (last dim contiguous); values are cast to the cache dtype.
        slot_mapping: int32 [T]; token t goes to block ``slot // S``, offset ``slot % S``; slots
            < 0 are skipped. Slots must be distinct (duplicates race).
    """
    _check(k, v, k_cache, v_cache, slot_mapping)
    check_device("write_kv", k, v, k_cache, v_cache, slot_mapping)
    for label, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(f"write_kv {label}", t)
    t, hkv, d = k.shape
    if t == 0:
        return
    block_d = next_pow2(d)
    # About 2K elements per program: all heads of a token for small models, a few for big ones.
    block_h = min(next_pow2(hkv), max(1, 2048 // block_d))
    grid = (t, triton.cdiv(hkv, block_h))
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        hkv,
        HEAD_DIM=d, PAGE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4,
    )  # fmt: skip


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain torch reference of :func:`write_kv` (same arguments, in place)."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    n, s, hkv, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(n * s, hkv, d)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(n * s, hkv, d)[slots] = v[keep].to(v_cache.dtype)
