"""Gated delta rule kernels (Qwen3-Next Gated DeltaNet layers), Triton, with torch references
(backends_torch/layers/gdn_ops.py holds the plain recurrence they are tested against).

- `gdn_decode_update`: one token per request; the recurrent state h [H, dk, dv] of slot slots[b]
  is read and written IN PLACE in the slot cache [S, H, dk, dv] float32 (keep[b] = 0: start from
  zeros): h = exp(g) h; h += k (x) beta (v - h^T k); y = h^T q. One program per (request, head).
- `gdn_chunked_prefill`: one request's T tokens from state h0, in chunks of BT tokens (the WY
  form of gdn_ops.gated_delta_rule_chunked: a unit-lower-triangular inverse by forward
  substitution inside the chunk, then matmuls); the state is carried across chunks in registers.
  One program per head. Returns (y [T, H, dv], h_T [H, dk, dv]) float32.
q / k are already l2-normalised (q scaled by dk^-0.5) and repeated to H value heads; g is the
log decay, beta the write strength; all math in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, next_pow2


@triton.jit
def _gdn_decode_kernel(
    h_ptr, slot_ptr, keep_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, y_ptr,
    H, DK, DV, stride_hs, stride_hh, stride_hk, stride_qb, stride_qh, stride_vb, stride_vh,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hd = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # this program's dv columns
    km, vm = kk < DK, vv < DV
    m2 = km[:, None] & vm[None, :]
    slot = tl.load(slot_ptr + b)
    keep = tl.load(keep_ptr + b)
    hp = h_ptr + slot * stride_hs + hd * stride_hh + kk[:, None] * stride_hk + vv[None, :]
    st = tl.load(hp, mask=m2, other=0.0) * keep
    q = tl.load(q_ptr + b * stride_qb + hd * stride_qh + kk, mask=km, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_qb + hd * stride_qh + kk, mask=km, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * stride_vb + hd * stride_vh + vv, mask=vm, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * H + hd).to(tl.float32)
    beta = tl.load(beta_ptr + b * H + hd).to(tl.float32)
    st = st * tl.exp(g)
    kv = tl.sum(st * k[:, None], axis=0)  # [BV]
    st = st + k[:, None] * ((v - kv) * beta)[None, :]
    tl.store(hp, st, mask=m2)
    y = tl.sum(st * q[:, None], axis=0)
    tl.store(y_ptr + (b * H + hd) * DV + vv, y, mask=vm)


def gdn_decode_update(
    cache: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    block_v: int = 64,
) -> torch.Tensor:
    """cache [S, H, dk, dv] float32 (updated in place), slots [B] int, keep [B] float32,
    q / k [B, H, dk], v [B, H, dv], g / beta [B, H] -> y [B, H, dv] float32. Each program owns
    `block_v` of the dv columns (the columns of h update independently)."""
    check_device("gdn_decode_update", cache, slots, keep, q, k, v, g, beta)
    bsz, h, dk = q.shape
    dv = v.shape[-1]
    if cache.dtype != torch.float32 or cache.stride(3) != 1 or cache.shape[1:] != (h, dk, dv):
        raise ValueError("gdn_decode_update: cache must be float32 [S, H, dk, dv]")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    y = torch.empty((bsz, h, dv), dtype=torch.float32, device=q.device)
    bv = min(next_pow2(dv), block_v)
    _gdn_decode_kernel[(bsz, h, triton.cdiv(dv, bv))](
        cache, slots, keep, q, k, v, g, beta, y,
        h, dk, dv, cache.stride(0), cache.stride(1), cache.stride(2),
        q.stride(0), q.stride(1), v.stride(0), v.stride(1),
        BLOCK_K=next_pow2(dk), BLOCK_V=bv,
    )  # fmt: skip
    return y


def gdn_decode_update_ref(
    cache: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """The torch reference of `gdn_decode_update` (same in-place contract)."""
    from xlaserve.backends_torch.layers.gdn_ops import gated_delta_rule_step

    h = cache[slots] * keep[:, None, None, None]
    y, h = gated_delta_rule_step(h, q, k, v, g, beta)
    cache[slots] = h
    return y


@triton.jit
def _gdn_chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, y_ptr, ht_ptr,
    T, H, DK, DV, stride_qt, stride_qh, stride_vt, stride_vh,
    BT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    hd = tl.program_id(0)
    rows = tl.arange(0, BT)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)  # this program's dv columns
    km, vm = kk < DK, vv < DV
    hoff = hd * DK * DV + kk[:, None] * DV + vv[None, :]
    st = tl.load(h0_ptr + hoff, mask=km[:, None] & vm[None, :], other=0.0)
    lower = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for c in range(0, tl.cdiv(T, BT)):
        t = c * BT + rows
        tm = t < T
        qo = t[:, None] * stride_qt + hd * stride_qh + kk[None, :]
        vo = t[:, None] * stride_vt + hd * stride_vh + vv[None, :]
        mq = tm[:, None] & km[None, :]
        mv = tm[:, None] & vm[None, :]
        q = tl.load(q_ptr + qo, mask=mq, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qo, mask=mq, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + vo, mask=mv, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * H + hd, mask=tm, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * H + hd, mask=tm, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, axis=0)  # padding rows add 0: their gc is the last real row's
        diff = gc[:, None] - gc[None, :]
        decay = tl.where(lower, tl.exp(tl.minimum(diff, 0.0)), 0.0)
        kb = k * beta[:, None]
        kkt = tl.dot(kb, tl.trans(k), input_precision="ieee")
        # Xo = strict part of (I + L)^-1, L = strict(kb k^T * decay): Xo_i = N_i + sum_j N_ij Xo_j
        # with N = -L, row by row (forward substitution).
        a = tl.where(strict, -kkt * decay, 0.0)
        for i in range(1, BT):
            row = tl.sum(tl.where(rows[:, None] == i, a, 0.0), axis=0)  # [BT]
            row = row + tl.sum(row[:, None] * a, axis=0)
            a = tl.where(rows[:, None] == i, row[None, :], a)
        tinv = a + eye
        u = tl.dot(tinv, v * beta[:, None], input_precision="ieee")  # [BT, BV]
        w = tl.dot(tinv, kb * tl.exp(gc)[:, None], input_precision="ieee")  # [BT, BK]
        vn = u - tl.dot(w, st, input_precision="ieee")
        qkt = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
        y = tl.dot(q * tl.exp(gc)[:, None], st, input_precision="ieee")
        y += tl.dot(qkt, vn, input_precision="ieee")
        tl.store(y_ptr + t[:, None] * (H * DV) + hd * DV + vv[None, :], y, mask=mv)
        g_last = tl.sum(tl.where(rows == BT - 1, gc, 0.0), axis=0)
        kd = k * tl.exp(g_last - gc)[:, None]
        st = tl.exp(g_last) * st + tl.dot(tl.trans(kd), vn, input_precision="ieee")
    tl.store(ht_ptr + hoff, st, mask=km[:, None] & vm[None, :])


def gdn_chunked_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor,
    chunk: int = 16,
    block_v: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q / k [T, H, dk], v [T, H, dv], g / beta [T, H], h0 [H, dk, dv] -> (y [T, H, dv],
    h_T [H, dk, dv]) float32; `chunk` (BT) a power of two >= 16. One program per (head, `block_v`
    dv columns): the in-chunk inverse depends on k / beta / g only, so each recomputes it."""
    check_device("gdn_chunked_prefill", q, k, v, g, beta, h0)
    t, h, dk = q.shape
    dv = v.shape[-1]
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError("gdn_chunked_prefill: chunk must be a power of two >= 16")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    h0 = h0.float().contiguous()
    y = torch.empty((t, h, dv), dtype=torch.float32, device=q.device)
    ht = torch.empty((h, dk, dv), dtype=torch.float32, device=q.device)
    if t == 0:
        ht.copy_(h0)
        return y, ht
    bv = max(16, min(next_pow2(dv), block_v))
    _gdn_chunk_kernel[(h, triton.cdiv(dv, bv))](
        q, k, v, g, beta, h0, y, ht,
        t, h, dk, dv, q.stride(0), q.stride(1), v.stride(0), v.stride(1),
        BT=chunk, BLOCK_K=max(16, next_pow2(dk)), BLOCK_V=bv,
    )  # fmt: skip
    return y, ht
