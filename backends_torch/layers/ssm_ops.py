"""Plain torch reference ops of state-space layers (Mamba, Mamba2): causal conv1d with state, the
selective scan (prefill: sequential reference and the chunked SSD form) and the single-step state
update (decode). All state math in float32.

Shapes: T tokens of one request, C conv channels, K conv width, Hs state heads (Mamba2: heads;
Mamba: channels), P head dim (Mamba: 1), N state size, G groups of B/C.

Rules:
- conv state [C, K - 1]: the last K - 1 conv INPUTS (pre-activation), oldest first; zeros for a
  fresh request. The conv output at t sees inputs t-K+1 .. t (state first).
- ssm state h [Hs, P, N]: h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t (x) B_t;
  y_t = h_t . C_t + D * x_t. A is [Hs, 1, 1] (Mamba2, one scalar per head) or [Hs, 1, N] (Mamba).
- Splitting a request's tokens into chunks and carrying (conv state, h) between them gives the
  same outputs as one call (the chunked-prefill rule); the tests check it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C], weight [C, K], bias [C] | None, state [C, K-1] -> (y [T, C] float32 before the
    activation, new state [C, K-1] float32)."""
    k = weight.shape[1]
    full = torch.cat([state.float(), x.float().t()], dim=1)  # [C, K-1+T]
    y = F.conv1d(full[None], weight.float()[:, None, :], groups=weight.shape[0])[0]  # [C, T]
    if bias is not None:
        y = y + bias.float()[:, None]
    return y.t(), full[:, full.shape[1] - (k - 1) :].clone()


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request (decode): x [B, C], state [B, C, K-1] -> (y [B, C] float32,
    new state [B, C, K-1] float32)."""
    full = torch.cat([state.float(), x.float()[:, :, None]], dim=2)  # [B, C, K]
    y = (full * weight.float()[None]).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y, full[:, :, 1:].clone()


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    h: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequential reference: x [T, Hs, P], dt [T, Hs] (already softplus'd), A [Hs, 1, 1|N],
    B / C [T, Hs|1, N], D [Hs] | None, h [Hs, P, N] -> (y [T, Hs, P] float32, h_T float32)."""
    x, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    h = h.float().clone()
    ys = []
    for t in range(x.shape[0]):
        dtt = dt[t][:, None, None]  # [Hs, 1, 1]
        h = torch.exp(dtt * A) * h + (dtt * x[t][:, :, None]) * B[t][:, None, :]
        ys.append((h * C[t][:, None, :]).sum(-1))
    y = torch.stack(ys) if ys else x.new_zeros(x.shape)
    if D is not None:
        y = y + D.float()[None, :, None] * x
    return y, h


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    h: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2 SSD in chunks (scalar A per head: A [Hs, 1, 1]): within a chunk the output is a
    masked (decay-weighted) attention-like matmul, between chunks the state is carried. Same
    contract and result as `selective_scan` (to float32 rounding)."""
    x, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    T, Hs, P = x.shape
    a = A.reshape(Hs).float()
    h = h.float().clone()
    B = B.expand(T, Hs, B.shape[-1])
    C = C.expand(T, Hs, C.shape[-1])
    ys = []
    for s in range(0, T, chunk):
        xs, dts, Bs, Cs = x[s : s + chunk], dt[s : s + chunk], B[s : s + chunk], C[s : s + chunk]
        L = xs.shape[0]
        la = torch.cumsum(dts * a[None], dim=0)  # [L, Hs] log decay from chunk start (incl.)
        # decay[i, j] = exp(la_i - la_j) for j <= i (the factor from step j to step i).
        diff = la[:, None, :] - la[None, :, :]  # [L, L, Hs]
        mask = torch.tril(torch.ones(L, L, dtype=torch.bool, device=x.device))
        decay = torch.where(mask[:, :, None], torch.exp(diff.clamp(max=0)), 0.0)
        cb = torch.einsum("ihn,jhn->ijh", Cs, Bs)  # [L, L, Hs]
        w = cb * decay * dts[None, :, :]  # weight of x_j (scaled by dt_j) in y_i
        y = torch.einsum("ijh,jhp->ihp", w, xs)
        # Carried state: y_i += exp(la_i) * (h0 . C_i).
        y = y + torch.exp(la)[:, :, None] * torch.einsum("hpn,ihn->ihp", h, Cs)
        # State at chunk end: h = exp(la_L) h0 + sum_j exp(la_L - la_j) dt_j x_j (x) B_j.
        wend = torch.exp(la[-1][None, :] - la) * dts  # [L, Hs]
        h = torch.exp(la[-1])[:, None, None] * h + torch.einsum("jh,jhp,jhn->hpn", wend, xs, Bs)
        ys.append(y)
    y = torch.cat(ys) if ys else x.new_zeros(x.shape)
    if D is not None:
        y = y + D.float()[None, :, None] * x
    return y, h


def selective_state_update(
    h: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for B requests: h [B, Hs, P, N], x [B, Hs, P], dt [B, Hs],
    B / C [B, Hs|1, N] -> (y [B, Hs, P] float32, new h float32)."""
    dtt = dt.float()[:, :, None, None]
    h = torch.exp(dtt * A[None]) * h.float() + (dtt * x.float()[..., None]) * B.float()[:, :, None]
    y = (h * C.float()[:, :, None, :]).sum(-1)
    if D is not None:
        y = y + D.float()[None, :, None] * x.float()
    return y, h


def gated_rms_norm(
    y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int, eps: float
) -> torch.Tensor:
    """Mamba2's norm: y * silu(gate), RMS-normalised over each of `groups` equal slices of the
    last dim, times weight; computed in float32, returned in weight's dtype."""
    z = y.float() * F.silu(gate.float())
    shp = z.shape
    zg = z.reshape(*shp[:-1], groups, shp[-1] // groups)
    zg = zg * torch.rsqrt(zg.pow(2).mean(-1, keepdim=True) + eps)
    return weight * zg.reshape(shp).to(weight.dtype)
