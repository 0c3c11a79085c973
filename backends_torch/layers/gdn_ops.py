"""Plain torch reference ops of the gated delta rule (Qwen3-Next Gated DeltaNet layers): the
sequential recurrence (the definition), its chunked (WY) form for prefill and the single-step
update for decode. All state math in float32.

Shapes: T tokens of one request, H value heads (q / k already repeated from the k heads),
dk key head dim, dv value head dim.

Rules (q, k already l2-normalised, q scaled by dk^-0.5; g = log decay <= 0; beta in (0, 1)):
    h_t = exp(g_t) h_{t-1};  h_t += k_t (x) beta_t (v_t - h_t^T k_t);  y_t = h_t^T q_t
with the state h [H, dk, dv] (zeros for a fresh request). Splitting a request's tokens into
chunks and carrying h between them gives the same outputs as one call (chunked prefill).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (FLA / transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequential reference: q / k [T, H, dk], v [T, H, dv], g / beta [T, H], h [H, dk, dv]
    -> (y [T, H, dv] float32, h_T float32)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    h = h.float().clone()
    ys = []
    for t in range(q.shape[0]):
        h = h * torch.exp(g[t])[:, None, None]
        kv = torch.einsum("hk,hkv->hv", k[t], h)
        delta = (v[t] - kv) * beta[t][:, None]
        h = h + k[t][:, :, None] * delta[:, None, :]
        ys.append(torch.einsum("hk,hkv->hv", q[t], h))
    y = torch.stack(ys) if ys else v.new_zeros(v.shape)
    return y, h


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (WY) form: within a chunk of L tokens, with G = cumsum(g) and
    D[i, j] = exp(G_i - G_j) (j <= i), M = I + strict_lower((k beta) k^T * D):
        u = M^-1 (v beta),  w = M^-1 (k beta exp(G)),  v' = u - w h0,
        y = (q exp(G)) h0 + lower_incl(q k^T * D) v',
        h = exp(G_L) h0 + (k exp(G_L - G))^T v'.
    Same contract and result as `gated_delta_rule` (to float32 rounding)."""
    q, k, v, g, beta = (t.float().transpose(0, 1) for t in (q, k, v, g, beta))  # head-major
    h = h.float().clone()
    n_t = q.shape[1]
    ys = []
    for s in range(0, n_t, chunk):
        qc, kc, vc = q[:, s : s + chunk], k[:, s : s + chunk], v[:, s : s + chunk]
        gc, bc = g[:, s : s + chunk].cumsum(-1), beta[:, s : s + chunk]  # [H, L]
        n = qc.shape[1]
        lower = torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device))
        decay = torch.where(lower, torch.exp((gc[:, :, None] - gc[:, None, :]).clamp(max=0)), 0.0)
        kb = kc * bc[..., None]
        m = (kb @ kc.transpose(-1, -2)) * decay
        m = torch.tril(m, -1) + torch.eye(n, device=q.device)
        u = torch.linalg.solve_triangular(m, vc * bc[..., None], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(m, kb * torch.exp(gc)[..., None], upper=False,
                                          unitriangular=True)  # fmt: skip
        vn = u - w @ h  # [H, L, dv]
        y = (qc * torch.exp(gc)[..., None]) @ h + ((qc @ kc.transpose(-1, -2)) * decay) @ vn
        kd = kc * torch.exp(gc[:, -1:] - gc)[..., None]
        h = torch.exp(gc[:, -1])[:, None, None] * h + kd.transpose(-1, -2) @ vn
        ys.append(y)
    y = torch.cat(ys, dim=1) if ys else v.new_zeros(v.shape)
    return y.transpose(0, 1), h


def gated_delta_rule_step(
    h: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for B requests: h [B, H, dk, dv], q / k [B, H, dk], v [B, H, dv],
    g / beta [B, H] -> (y [B, H, dv] float32, new h float32)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    h = h.float() * torch.exp(g)[..., None, None]
    kv = torch.einsum("bhk,bhkv->bhv", k, h)
    h = h + k[..., None] * ((v - kv) * beta[..., None])[:, :, None, :]
    return torch.einsum("bhk,bhkv->bhv", q, h), h


def gdn_qkv(
    xc: torch.Tensor, n_k_heads: int, n_heads: int, dk: int, dv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activated conv output xc [R, 2 Hk dk + Hv dv] (q | k | v) -> q / k [R, Hv, dk]
    (l2-normalised, q scaled by dk^-0.5, each k head repeated for its Hv / Hk value heads),
    v [R, Hv, dv]; float32."""
    r = xc.shape[0]
    q, k, v = xc.float().split([n_k_heads * dk, n_k_heads * dk, n_heads * dv], dim=-1)
    rep = n_heads // n_k_heads
    q = l2norm(q.reshape(r, n_k_heads, dk)) * dk**-0.5
    k = l2norm(k.reshape(r, n_k_heads, dk))
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    return q, k, v.reshape(r, n_heads, dv)


def gdn_gates(
    b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """b / a [R, H] -> (g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)), float32."""
    g = -torch.exp(a_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def gdn_gated_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Qwen3-Next's output norm: RMS over each head's dv of y [R, H, dv] (float32), times weight
    [dv] (in `dtype`), times silu(z [R, H, dv]) in float32; returned in `dtype`."""
    yn = y.float() * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + eps)
    yn = weight * yn.to(dtype)
    return (yn * F.silu(z.float())).to(dtype)
