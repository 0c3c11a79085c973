"""Rotary position embedding (Triton), in place on q and k.

cos/sin cache layout: ``cos_sin_cache`` [P, rotary_dim], row p = ``[cos(p * inv_freq) | sin(p *
inv_freq)]`` (rotary_dim / 2 columns each); build it with :func:`compute_cos_sin_cache` from any
rope-scaling variant's ``inv_freq``. Only the first ``rotary_dim`` dims of each head rotate
(partial rotary); the rest pass through.

Pairing: neox style (``is_neox=True``, HF ``rotate_half``) pairs dim j with j + rotary_dim/2;
GPT-J style pairs 2j with 2j + 1. Math in fp32, one rounding to the tensor dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device, check_dtype, check_last_dim_contiguous, next_pow2


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
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < half
    cos = tl.load(cache_ptr + pos * stride_cache + j, mask=jm, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + half + j, mask=jm, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, tok * stride_qt, stride_qh, num_q_heads, cos, sin, half,
                  IS_NEOX, BLOCK_H, BLOCK_HALF)  # fmt: skip
    _rotate_heads(k_ptr, tok * stride_kt, stride_kh, num_k_heads, cos, sin, half,
                  IS_NEOX, BLOCK_H, BLOCK_HALF)  # fmt: skip


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
    )  # fmt: skip


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
