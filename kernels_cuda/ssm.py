"""Decode-step kernels of state-space layers (Mamba, Mamba2), Triton, with torch references.

Both read and write a request's recurrent state IN PLACE in the slot cache (no gather/scatter
copies of the whole batch's state):

- `conv_state_update`: x [B, C] one new conv input per request; conv cache [S, C, K-1] float32,
  row slots[b]; y = sum_k w[:, k] * window[:, k] + bias with window = (state, x); the state shifts
  by one. keep[b] = 0 starts request b from a zero state (a fresh request's first token).
- `ssm_state_update`: h [Hs, P, N] of slot slots[b] <- exp(dt * A) * h + dt * x (x) B;
  y = h . C + D * x. A [Hs, N] (Mamba2: one value per head, broadcast over N), B / C [B, G, N]
  with head h reading group h // (Hs / G). All math in float32; y is float32 [B, Hs, P].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, next_pow2


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, b_ptr, cache_ptr, slot_ptr, keep_ptr, y_ptr,
    C, stride_xb, stride_cs, stride_cc,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    cb = tl.program_id(1)
    offs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = offs < C
    slot = tl.load(slot_ptr + b)
    keep = tl.load(keep_ptr + b)
    base = cache_ptr + slot * stride_cs + offs * stride_cc
    x = tl.load(x_ptr + b * stride_xb + offs, mask=mask, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + offs * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(K - 1):
        s = tl.load(base + k, mask=mask, other=0.0) * keep
        acc += s * tl.load(w_ptr + offs * K + k, mask=mask, other=0.0).to(tl.float32)
        if k > 0:
            tl.store(base + (k - 1), s, mask=mask)  # shift left by one
    tl.store(base + (K - 2), x, mask=mask)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + b * C + offs, acc, mask=mask)


def conv_state_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cache: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
) -> torch.Tensor:
    """x [B, C], weight [C, K], bias [C] | None, cache [S, C, K-1] float32 (updated in place),
    slots [B] int, keep [B] float32 -> y [B, C] float32 (before the activation)."""
    check_device("conv_state_update", x, weight, cache, slots, keep)
    bsz, c = x.shape
    k = weight.shape[1]
    if cache.dtype != torch.float32 or cache.stride(2) != 1 or k < 2:
        raise ValueError("conv_state_update: cache must be float32 [S, C, K-1], K >= 2")
    y = torch.empty((bsz, c), dtype=torch.float32, device=x.device)
    block = min(next_pow2(c), 256)
    w = weight.contiguous()
    _conv_update_kernel[(bsz, triton.cdiv(c, block))](
        x, w, bias if bias is not None else w, cache, slots, keep, y,
        c, x.stride(0), cache.stride(0), cache.stride(1),
        K=k, HAS_BIAS=bias is not None, BLOCK_C=block,
    )  # fmt: skip
    return y


def conv_state_update_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cache: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
) -> torch.Tensor:
    """The torch reference of `conv_state_update` (same in-place contract)."""
    st = cache[slots] * keep[:, None, None]
    full = torch.cat([st, x.float()[:, :, None]], dim=2)
    y = (full * weight.float()[None]).sum(-1)
    if bias is not None:
        y = y + bias.float()
    cache[slots] = full[:, :, 1:]
    return y


@triton.jit
def _ssm_update_kernel(
    h_ptr, slot_ptr, keep_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, y_ptr,
    Hs, P, N, G, stride_hs, stride_hh, stride_hp, stride_xb, stride_xh,
    stride_bb, stride_bg, HAS_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = h // (Hs // G)
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm, nm = p < P, n < N
    m2 = pm[:, None] & nm[None, :]
    slot = tl.load(slot_ptr + b)
    keep = tl.load(keep_ptr + b)
    hp = h_ptr + slot * stride_hs + h * stride_hh + p[:, None] * stride_hp + n[None, :]
    st = tl.load(hp, mask=m2, other=0.0) * keep
    x = tl.load(x_ptr + b * stride_xb + h * stride_xh + p, mask=pm, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + b * Hs + h).to(tl.float32)
    a = tl.load(a_ptr + h * N + n, mask=nm, other=0.0)
    bv = tl.load(b_ptr + b * stride_bb + g * stride_bg + n, mask=nm, other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + b * stride_bb + g * stride_bg + n, mask=nm, other=0.0).to(tl.float32)
    st = tl.exp(dt * a)[None, :] * st + (dt * x)[:, None] * bv[None, :]
    tl.store(hp, st, mask=m2)
    y = tl.sum(st * cv[None, :], axis=1)
    if HAS_D:
        y += tl.load(d_ptr + h).to(tl.float32) * x
    tl.store(y_ptr + (b * Hs + h) * P + p, y, mask=pm)


def ssm_state_update(
    cache: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
) -> torch.Tensor:
    """cache [S, Hs, P, N] float32 (updated in place), slots [B], keep [B] float32,
    x [B, Hs, P], dt [B, Hs] float32 (softplus'd), A [Hs, N] float32, B / C [B, G, N],
    D [Hs] | None -> y [B, Hs, P] float32."""
    check_device("ssm_state_update", cache, slots, keep, x, dt, A, B, C)
    bsz, hs, p = x.shape
    n, g = cache.shape[-1], B.shape[1]
    if cache.dtype != torch.float32 or cache.stride(3) != 1 or hs % g:
        raise ValueError("ssm_state_update: float32 cache [S, Hs, P, N]; G must divide Hs")
    B, C = B.contiguous(), C.contiguous()
    dt, A = dt.float().contiguous(), A.float().contiguous()
    y = torch.empty((bsz, hs, p), dtype=torch.float32, device=x.device)
    _ssm_update_kernel[(bsz, hs)](
        cache, slots, keep, x, dt, A, B, C, D if D is not None else A, y,
        hs, p, n, g, cache.stride(0), cache.stride(1), cache.stride(2), x.stride(0), x.stride(1),
        B.stride(0), B.stride(1), HAS_D=D is not None, BLOCK_P=next_pow2(p), BLOCK_N=next_pow2(n),
    )  # fmt: skip
    return y


def ssm_state_update_ref(
    cache: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
) -> torch.Tensor:
    """The torch reference of `ssm_state_update` (same in-place contract)."""
    hs, g = x.shape[1], B.shape[1]
    Bh = B.float().repeat_interleave(hs // g, dim=1)  # [B, Hs, N]
    Ch = C.float().repeat_interleave(hs // g, dim=1)
    h = cache[slots] * keep[:, None, None, None]
    d = dt.float()[:, :, None, None]
    h = torch.exp(d * A.float()[None, :, None, :]) * h + (d * x.float()[..., None]) * Bh[:, :, None]
    cache[slots] = h
    y = (h * Ch[:, :, None, :]).sum(-1)
    if D is not None:
        y = y + D.float()[None, :, None] * x.float()
    return y
