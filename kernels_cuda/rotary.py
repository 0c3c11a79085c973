"""Rotary position embedding (Triton), in place on q and k.

cos/sin cache layout: ``cos_sin_cache`` [P, rotary_dim], row p = ``[cos(p * inv_freq) | sin(p *
inv_freq)]`` (rotary_dim / 2 columns each); build it with :func:`compute_cos_sin_cache` from any
rope-scaling variant's ``inv_freq``. Only the first ``rotary_dim`` dims of each head rotate
(partial rotary); the rest pass through.

Pairing: neox style (``is_neox=True``, HF ``rotate_half``) pairs dim j with j + rotary_dim/2;
GPT-J style pairs 2j with 2j + 1. Math in fp32, one rounding to the tensor dtype.

:func:`rotary_embedding_write_kv` fuses the rotation with the paged KV-cache write of
kv_write.py (float caches): one launch per layer instead of two at decode.
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
from .kv_write import _check as _check_write_kv
from .kv_write import write_kv_ref


@triton.jit
def _rotate_heads(
    x_ptr, row_off, stride_h, num_heads, cos, sin, half,
    IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    j = tl.arange(0, BLOCK_HALF)
    if IS_NEOX:
        i1 = j
        i2 = j + half
    else:
        i1 = 2 * j
        i2 = 2 * j + 1
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h < num_heads)[:, None] & (j < half)[None, :]
        base = x_ptr + row_off + h[:, None] * stride_h
        x1 = tl.load(base + i1[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + i2[None, :], mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(base + i1[None, :], o1.to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(base + i2[None, :], o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cos_sin(pos_ptr, cache_ptr, tok, stride_cache, half, BLOCK_HALF: tl.constexpr):
    """cos, sin [BLOCK_HALF] (fp32, masked lanes 0) of token tok's position."""
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < half
    cos = tl.load(cache_ptr + pos * stride_cache + j, mask=jm, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + half + j, mask=jm, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    num_q_heads,
    num_k_heads,
    half,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, cache_ptr, tok, stride_cache, half, BLOCK_HALF)
    _rotate_heads(q_ptr, tok * stride_qt, stride_qh, num_q_heads, cos, sin, half,
                  IS_NEOX, BLOCK_H, BLOCK_HALF)  # fmt: skip
    _rotate_heads(k_ptr, tok * stride_kt, stride_kh, num_k_heads, cos, sin, half,
                  IS_NEOX, BLOCK_H, BLOCK_HALF)  # fmt: skip


@triton.jit
def _rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cache_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
    stride_kcn, stride_kcs, stride_kch, stride_vcn, stride_vcs, stride_vch,
    num_q_heads, num_kv_heads, half,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_REST: tl.constexpr, HAS_REST: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(USE_PDL)
    # One program per token: q rotated in place (as _rotary_kernel); k rotated in registers and
    # stored both in place and to the cache slot, v copied to the cache slot. Every element is
    # stored by the thread that loaded it (pairs x1 / x2 share a layout), so in-place stores
    # cannot race with another thread's loads.
    tok = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, cache_ptr, tok, stride_cache, half, BLOCK_HALF)
    _rotate_heads(q_ptr, tok * stride_qt, stride_qh, num_q_heads, cos, sin, half,
                  IS_NEOX, BLOCK_H, BLOCK_HALF)  # fmt: skip

    j = tl.arange(0, BLOCK_HALF)
    jm = j < half
    slot_in = tl.load(slot_ptr + tok).to(tl.int64)  # < 0 (padding): rotate k, write nothing
    slot = tl.maximum(slot_in, 0)
    blk = slot // PAGE
    off = slot % PAGE
    if IS_NEOX:
        i1 = j
        i2 = j + half
    else:
        i1 = 2 * j
        i2 = 2 * j + 1
    kc_tok = kc_ptr + blk * stride_kcn + off * stride_kcs
    vc_tok = vc_ptr + blk * stride_vcn + off * stride_vcs
    d = tl.arange(0, BLOCK_D)
    rest = 2 * half + tl.arange(0, BLOCK_REST)  # partial rotary: dims past rotary_dim
    for h0 in range(0, num_kv_heads, BLOCK_HKV):
        h = h0 + tl.arange(0, BLOCK_HKV)
        h_ok = h < num_kv_heads
        keep = (h_ok & (h * 0 + slot_in >= 0))[:, None]  # tensor masks (interpreter: no scalars)
        pm = h_ok[:, None] & jm[None, :]
        k_row = k_ptr + tok * stride_kt + h[:, None] * stride_kh
        kc_row = kc_tok + h[:, None] * stride_kch
        x1 = tl.load(k_row + i1[None, :], mask=pm, other=0.0).to(tl.float32)
        x2 = tl.load(k_row + i2[None, :], mask=pm, other=0.0).to(tl.float32)
        o1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(k_ptr.dtype.element_ty)
        o2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(k_ptr.dtype.element_ty)
        tl.store(k_row + i1[None, :], o1, mask=pm)
        tl.store(k_row + i2[None, :], o2, mask=pm)
        tl.store(kc_row + i1[None, :], o1.to(kc_ptr.dtype.element_ty), mask=pm & keep)
        tl.store(kc_row + i2[None, :], o2.to(kc_ptr.dtype.element_ty), mask=pm & keep)
        if HAS_REST:
            rm = h_ok[:, None] & (rest < HEAD_DIM)[None, :]
            kr = tl.load(k_row + rest[None, :], mask=rm, other=0.0)
            tl.store(kc_row + rest[None, :], kr.to(kc_ptr.dtype.element_ty), mask=rm & keep)
        vm = h_ok[:, None] & (d < HEAD_DIM)[None, :]
        vv = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=vm)
        tl.store(vc_tok + h[:, None] * stride_vch + d[None, :], vv.to(vc_ptr.dtype.element_ty),
                 mask=vm & keep)  # fmt: skip


def _check(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> int:
    name = "rotary_embedding"
    if q.ndim != 3 or k.ndim != 3:
        raise ValueError(
            f"{name}: q must be [T, Hq, D] and k [T, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"{name}: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on T or D")
    if positions.ndim != 1 or positions.shape[0] != q.shape[0]:
        raise ValueError(
            f"{name}: positions must be [T={q.shape[0]}], got {tuple(positions.shape)}"
        )
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: positions must be int32/int64, got {positions.dtype}")
    if cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] % 2 != 0:
        raise ValueError(
            f"{name}: cos_sin_cache must be [P, rotary_dim] (rotary_dim even), got "
            f"{tuple(cos_sin_cache.shape)}"
        )
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim > q.shape[2]:
        raise ValueError(f"{name}: rotary_dim {rotary_dim} > head_dim {q.shape[2]}")
    check_dtype(f"{name} q", q, FLOAT_DTYPES)
    check_dtype(f"{name} cos_sin_cache", cos_sin_cache, FLOAT_DTYPES)
    if k.dtype != q.dtype:
        raise ValueError(f"{name}: k dtype {k.dtype} != q dtype {q.dtype}")
    return rotary_dim


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    *,
    kernels: KernelConfig | None = None,
) -> None:
    """Rotate q and k in place.

    Args:
        q: [T, Hq, D], k: [T, Hkv, D] (same dtype; last dim contiguous; may be strided views of
            a fused qkv projection).
        positions: int32/int64 [T], each < P.
        cos_sin_cache: [P, rotary_dim] = [cos | sin] per position (fp32 recommended).
        is_neox: neox/HF rotate_half pairing (True) or GPT-J interleaved pairing (False).
    """
    rotary_dim = _check(q, k, positions, cos_sin_cache)
    check_device("rotary_embedding", q, k, positions, cos_sin_cache)
    for label, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(f"rotary_embedding {label}", t)
    t = q.shape[0]
    if t == 0:
        return
    half = rotary_dim // 2
    block_half = next_pow2(half)
    block_h = max(1, min(next_pow2(max(q.shape[1], k.shape[1])), 4096 // block_half))
    _rotary_kernel[(t,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        q.shape[1], k.shape[1], half,
        IS_NEOX=is_neox, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4,
        USE_PDL=(pdl := use_pdl(q, kernels)), **pdl_kwargs(pdl),
    )  # fmt: skip


def rotary_embedding_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_neox: bool = True,
    *,
    kernels: KernelConfig | None = None,
) -> None:
    """`rotary_embedding(q, k, ...)` then `write_kv(k, v, k_cache, v_cache, slot_mapping)` in
    one launch: q and k are rotated in place, and the rotated k and v go to the cache.

    Args:
        q: [T, Hq, D], k, v: [T, Hkv, D] (one float dtype; last dim contiguous; may be strided
            views of a fused qkv projection).
        positions: int32/int64 [T], each < P. cos_sin_cache: [P, rotary_dim] = [cos | sin].
        k_cache, v_cache: float [N, S, Hkv, D] (last dim contiguous); values cast to their dtype.
            Quantized caches are not handled here: use the two kernels.
        slot_mapping: int32/int64 [T]; token t goes to block slot // S, offset slot % S; slots < 0
            are skipped (k is still rotated). Slots must be distinct.
        is_neox: neox/HF rotate_half pairing (True) or GPT-J interleaved pairing (False).
    """
    rotary_dim = _check_rope_write_kv(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping
    )
    check_device(
        "rotary_embedding_write_kv", q, k, v, positions, cos_sin_cache, k_cache, v_cache,
        slot_mapping,
    )  # fmt: skip
    for label, t in (("q", q), ("k", k), ("v", v), ("cos_sin_cache", cos_sin_cache),
                     ("k_cache", k_cache), ("v_cache", v_cache)):  # fmt: skip
        check_last_dim_contiguous(f"rotary_embedding_write_kv {label}", t)
    t, hkv, d = k.shape
    if t == 0:
        return
    half = rotary_dim // 2
    block_half = next_pow2(half)
    block_h = max(1, min(next_pow2(q.shape[1]), 4096 // block_half))
    block_d = next_pow2(d)
    _rope_write_kv_kernel[(t,)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        q.shape[1], hkv, half,
        HEAD_DIM=d, PAGE=k_cache.shape[1], IS_NEOX=is_neox, BLOCK_H=block_h,
        BLOCK_HALF=block_half, BLOCK_HKV=max(1, min(next_pow2(hkv), 2048 // block_d)),
        BLOCK_D=block_d, BLOCK_REST=next_pow2(max(d - rotary_dim, 1)),
        HAS_REST=rotary_dim < d, num_warps=4,
        USE_PDL=(pdl := use_pdl(q, kernels)), **pdl_kwargs(pdl),
    )  # fmt: skip


def _check_rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> int:
    """Both kernels' checks (float caches only; slot_mapping int32 or int64); rotary_dim."""
    rotary_dim = _check(q, k, positions, cos_sin_cache)
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"rotary_embedding_write_kv: slot_mapping must be int32/int64, got {slot_mapping.dtype}"
        )
    # write_kv's checks want int32 slots; a meta stand-in checks the shape with no device work.
    slots32 = slot_mapping.to("meta", torch.int32)
    _check_write_kv(k, v, k_cache, v_cache, slots32)
    return rotary_dim


def rotary_embedding_write_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Torch reference of :func:`rotary_embedding_write_kv`: the two references in sequence."""
    _check_rope_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    rotary_embedding_ref(q, k, positions, cos_sin_cache, is_neox)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping.to(torch.int32))


def compute_cos_sin_cache(
    inv_freq: torch.Tensor, max_position: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """inv_freq [rotary_dim/2] -> cos_sin_cache [max_position, rotary_dim] = [cos | sin]."""
    t = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def _rotate_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    # x: [T, H, D]; cos/sin: [T, half]
    rd = 2 * cos.shape[-1]
    xf = x.float()
    rot, rest = xf[..., :rd], xf[..., rd:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    rot = torch.cat([o1, o2], -1) if is_neox else torch.stack([o1, o2], -1).flatten(-2)
    return torch.cat([rot, rest], dim=-1).to(x.dtype)


def rotary_embedding_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Torch reference of :func:`rotary_embedding` (same arguments, in place, fp32 math)."""
    _check(q, k, positions, cos_sin_cache)
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs.chunk(2, dim=-1)
    q.copy_(_rotate_ref(q, cos, sin, is_neox))
    k.copy_(_rotate_ref(k, cos, sin, is_neox))
