"""Decode-step kernels of state-space layers (Mamba, Mamba2), Triton, with torch references.

Both read and write a request's recurrent state IN PLACE in the slot cache (no gather/scatter
copies of the whole batch's state):

- `conv_state_update`: x [B, C] one new conv input per request; conv cache [S, C, K-1] float32,
  row slots[b]; y = sum_k w[:, k] * window[:, k] + bias with window = (state, x); the state shifts
  by one. keep[b] = 0 starts request b from a zero state (a fresh request's first token).
- `ssm_state_update`: h [Hs, P, N] of slot slots[b] <- exp(dt * A) * h + dt * x (x) B;
  y = h . C + D * x. A [Hs, N] (Mamba2: one value per head, broadcast over N), B / C [B, G, N]
  with head h reading group h // (Hs / G). All math in float32; y is float32 [B, Hs, P].
- `mamba2_state_update`: Mamba2's decode after the conv in one launch (SiLU of the conv output,
  softplus'd dt, A from A_log, the update above, D): at batch 1 a decode step is launch-bound,
  and the unfused path ran ~12 small ops per layer around the update.
- `gated_rms_norm`: Mamba2's output norm (y * silu(z), RMS over each group, times weight), one
  launch instead of ~8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, next_pow2, row_num_warps


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
def _state_step(hp, m2, keep, decay, dtx, bv, cv):
    """One recurrent step of a [P, N] state tile at hp (in place): h = decay * (h * keep) +
    dtx[:, None] * bv[None, :]; returns the read-out y [P] = h @ cv. decay: [1, N] or a scalar
    (broadcast); keep 0 starts a fresh sequence from a zero state."""
    st = tl.load(hp, mask=m2, other=0.0) * keep
    st = decay * st + dtx[:, None] * bv[None, :]
    tl.store(hp, st, mask=m2)
    return tl.sum(st * cv[None, :], axis=1)


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
    x = tl.load(x_ptr + b * stride_xb + h * stride_xh + p, mask=pm, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + b * Hs + h).to(tl.float32)
    a = tl.load(a_ptr + h * N + n, mask=nm, other=0.0)
    bv = tl.load(b_ptr + b * stride_bb + g * stride_bg + n, mask=nm, other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + b * stride_bb + g * stride_bg + n, mask=nm, other=0.0).to(tl.float32)
    y = _state_step(hp, m2, keep, tl.exp(dt * a)[None, :], dt * x, bv, cv)
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


@triton.jit
def _mamba2_update_kernel(
    h_ptr, slot_ptr, keep_ptr, xc_ptr, dtr_ptr, dtb_ptr, alog_ptr, d_ptr, y_ptr,
    Hs, P, N, G, DI, dt_lo, dt_hi, stride_hs, stride_hh, stride_hp, stride_xc, stride_dt,
    HAS_D: tl.constexpr, CLAMP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    g = h // (Hs // G)
    pm, nm = p < P, n < N
    m2 = pm[:, None] & nm[None, :]
    slot = tl.load(slot_ptr + b)
    keep = tl.load(keep_ptr + b)
    hp = h_ptr + slot * stride_hs + h * stride_hh + p[:, None] * stride_hp + n[None, :]
    # The conv output row is (x [I], B [G*N], C [G*N]); SiLU is applied here, on load.
    row = xc_ptr + b * stride_xc
    x = tl.load(row + h * P + p, mask=pm, other=0.0).to(tl.float32)
    bv = tl.load(row + DI + g * N + n, mask=nm, other=0.0).to(tl.float32)
    cv = tl.load(row + DI + G * N + g * N + n, mask=nm, other=0.0).to(tl.float32)
    x = x * tl.sigmoid(x)
    bv = bv * tl.sigmoid(bv)
    cv = cv * tl.sigmoid(cv)
    # dt = softplus(dt_raw + dt_bias) (torch's threshold 20), clamped to dt_limit; A = -exp(A_log).
    dt = tl.load(dtr_ptr + b * stride_dt + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
    dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
    if CLAMP:
        dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
    a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    y = _state_step(hp, m2, keep, tl.exp(dt * a), dt * x, bv, cv)
    if HAS_D:
        y += tl.load(d_ptr + h).to(tl.float32) * x
    tl.store(y_ptr + (b * Hs + h) * P + p, y, mask=pm)


def mamba2_state_update(
    cache: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    xc: torch.Tensor,
    dt_raw: torch.Tensor,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor | None,
    groups: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """Mamba2's whole decode step after the conv, in one launch: SiLU of the conv output, the
    softplus'd and clamped dt, A = -exp(A_log), the state update and the D skip.

    cache [S, Hs, P, N] float32 (updated in place), slots [B], keep [B] float32,
    xc [B, I + 2 G N] the conv output BEFORE its SiLU (rows (x, B, C)), dt_raw [B, Hs] (a
    strided view is fine), dt_bias / A_log / D [Hs] -> y [B, Hs, P] float32. Equal to
    `ssm_state_update` on the unfused inputs (`mamba2_state_update_ref`)."""
    check_device("mamba2_state_update", cache, slots, keep, xc, dt_raw, dt_bias, A_log)
    bsz = xc.shape[0]
    hs, p, n = cache.shape[1:]
    i = xc.shape[1] - 2 * groups * n
    if cache.dtype != torch.float32 or cache.stride(3) != 1 or hs % groups or i != hs * p:
        raise ValueError(
            "mamba2_state_update: float32 cache [S, Hs, P, N], G | Hs, xc [B, Hs*P + 2*G*N]"
        )
    if xc.stride(1) != 1 or dt_raw.stride(1) != 1:
        raise ValueError("mamba2_state_update: xc and dt_raw need a contiguous last dim")
    y = torch.empty((bsz, hs, p), dtype=torch.float32, device=xc.device)
    block_p = next_pow2(p)
    # Batch 1 has only Hs programs: split P so that the launch covers the SMs.
    while bsz * hs * triton.cdiv(p, block_p) < 256 and block_p > 16:
        block_p //= 2
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    clamp = lo > 0.0 or hi != float("inf")
    _mamba2_update_kernel[(bsz, hs, triton.cdiv(p, block_p))](
        cache, slots, keep, xc, dt_raw, dt_bias, A_log, D if D is not None else A_log, y,
        hs, p, n, groups, i, lo, hi if clamp else 0.0, cache.stride(0), cache.stride(1),
        cache.stride(2), xc.stride(0), dt_raw.stride(0),
        HAS_D=D is not None, CLAMP=clamp, BLOCK_P=block_p, BLOCK_N=next_pow2(n),
    )  # fmt: skip
    return y


def mamba2_state_update_ref(
    cache: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    xc: torch.Tensor,
    dt_raw: torch.Tensor,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor | None,
    groups: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """The torch reference of `mamba2_state_update`: the unfused ops, then
    `ssm_state_update_ref` (same in-place contract)."""
    hs, p, n = cache.shape[1:]
    i = hs * p
    act = torch.nn.functional.silu(xc.float())
    x, B, C = act.split([i, groups * n, groups * n], dim=-1)
    dt = torch.nn.functional.softplus(dt_raw.float() + dt_bias.float())
    if dt_limit[0] > 0.0 or dt_limit[1] != float("inf"):
        dt = dt.clamp(dt_limit[0], dt_limit[1])
    a = (-torch.exp(A_log.float()))[:, None].expand(hs, n)
    bsz = xc.shape[0]
    return ssm_state_update_ref(
        cache, slots, keep, x.reshape(bsz, hs, p), dt, a,
        B.reshape(bsz, groups, n), C.reshape(bsz, groups, n), D,
    )  # fmt: skip


@triton.jit
def _gated_norm_kernel(
    y_ptr, z_ptr, w_ptr, out_ptr, S, stride_y, stride_z, stride_o, eps, BLOCK: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * S + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < S
    y = tl.load(y_ptr + r * stride_y + cols, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + r * stride_z + cols, mask=m, other=0.0).to(tl.float32)
    v = y * z * tl.sigmoid(z)
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, 0) / S + eps)
    # HF rounds the normed value to the weight dtype, then multiplies in that dtype.
    nv = (v * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * stride_o + cols, (nv * w).to(out_ptr.dtype.element_ty), mask=m)


def gated_rms_norm(
    y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int, eps: float
) -> torch.Tensor:
    """Mamba2's output norm in one launch: y [R, I] (float32), gate [R, I] (a strided view is
    fine), weight [I] -> [R, I] in weight's dtype = RMS-normalised (y * silu(gate)) over each of
    `groups` equal slices of I, times weight (layers/ssm_ops.gated_rms_norm is the reference)."""
    check_device("gated_rms_norm", y, gate, weight)
    r, i = y.shape
    if i % groups or gate.shape != y.shape or y.stride(1) != 1 or gate.stride(1) != 1:
        raise ValueError("gated_rms_norm: y / gate [R, I] with a contiguous last dim, G | I")
    s = i // groups
    block = next_pow2(s)
    if block > 16384:
        raise ValueError(f"gated_rms_norm: group size {s} > 16384")
    out = torch.empty((r, i), dtype=weight.dtype, device=y.device)
    num_warps = row_num_warps(block)
    _gated_norm_kernel[(r, groups)](
        y, gate, weight, out, s, y.stride(0), gate.stride(0), out.stride(0), float(eps),
        BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return out
