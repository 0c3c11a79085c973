"""The varlen (whole-step) state-space prefill kernels of kernels_cuda/ssm_prefill.py against a
loop of the single-request torch references: ragged lengths (1, shorter than K-1, across chunk
boundaries), slots out of order, fresh requests (keep 0: a NaN left in their slot never leaks in)
and carried ones, the slot cache left untouched (new states come back in request order)."""

from __future__ import annotations

import pytest
import torch

from xlaserve.kernels_cuda.ssm_prefill import (
    causal_conv1d_prefill_ref,
    causal_conv1d_varlen,
    ssd_chunked_prefill_ref,
    ssd_varlen,
)

LENS = [5, 1, 2, 70, 17]  # 2 < K-1 = 3; 70 crosses the 64-token chunk
SLOTS = [3, 0, 6, 1, 4]
KEEP = [1.0, 0.0, 1.0, 0.0, 1.0]
S = 7


def _cu(device: torch.device) -> torch.Tensor:
    cu = [0]
    for n in LENS:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _poison_fresh(states: torch.Tensor) -> None:
    for slot, keep in zip(SLOTS, KEEP, strict=True):
        if keep == 0.0:
            states[slot] = float("nan")


@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_varlen_matches_per_request_reference(with_bias: bool, device) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(0)
    c, k = 24, 4
    t = sum(LENS)
    x = torch.randn(t, c, generator=g).to(device)
    w = torch.randn(c, k, generator=g).to(device)
    b = torch.randn(c, generator=g).to(device) if with_bias else None
    states = torch.randn(S, c, k - 1, generator=g).to(device)
    _poison_fresh(states)
    before = states.clone()
    cu = _cu(device)
    slots = torch.tensor(SLOTS, device=device)
    y, new = causal_conv1d_varlen(x, w, b, states, cu, slots, torch.tensor(KEEP, device=device))
    assert torch.equal(states.nan_to_num(), before.nan_to_num())  # read only
    for i, (slot, keep) in enumerate(zip(SLOTS, KEEP, strict=True)):
        lo, hi = int(cu[i]), int(cu[i + 1])
        st = states[slot] if keep else torch.zeros_like(states[slot])
        want_y, want_new = causal_conv1d_prefill_ref(x[lo:hi], w, b, st)
        torch.testing.assert_close(y[lo:hi], want_y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new[i], want_new, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("groups", "views", "precision"),
    [(1, False, "tf32x3"), (2, False, "tf32x3"), (2, True, "tf32x3"), (1, True, "bf16")],
)
def test_ssd_varlen_matches_per_request_reference(
    groups: int,
    views: bool,
    precision: str,
    device,  # noqa: ANN001
) -> None:
    """views: x / B / C are slices of one [T, Hs*P + 2*G*N] row, as the model passes them (read
    through their token stride, not copied)."""
    g = torch.Generator().manual_seed(1)
    hs, p, n = 4, 16, 16
    t = sum(LENS)
    if views:
        row = torch.randn(t, hs * p + 2 * groups * n, generator=g).to(device)
        x = row[:, : hs * p].view(t, hs, p)
        B = row[:, hs * p : hs * p + groups * n].view(t, groups, n)
        C = row[:, hs * p + groups * n :].view(t, groups, n)
    else:
        x = torch.randn(t, hs, p, generator=g).to(device)
        B = torch.randn(t, groups, n, generator=g).to(device)
        C = torch.randn(t, groups, n, generator=g).to(device)
    dt = torch.nn.functional.softplus(torch.randn(t, hs, generator=g) - 2).to(device)
    a = -torch.exp(torch.randn(hs, generator=g)).to(device)
    D = torch.randn(hs, generator=g).to(device)
    states = torch.randn(S, hs, p, n, generator=g).to(device)
    _poison_fresh(states)
    cu = _cu(device)
    keep = torch.tensor(KEEP, device=device)
    slots = torch.tensor(SLOTS, device=device)
    y, h = ssd_varlen(x, dt, a, B, C, D, states, cu, slots, keep, precision=precision)
    # bf16 operands (8-bit mantissas) against the float32 reference; else ~fp32 accuracy.
    tol = 6e-2 if precision == "bf16" else 2e-4
    for i, (slot, kp) in enumerate(zip(SLOTS, KEEP, strict=True)):
        lo, hi = int(cu[i]), int(cu[i + 1])
        h0 = states[slot] if kp else torch.zeros_like(states[slot])
        want_y, want_h = ssd_chunked_prefill_ref(x[lo:hi], dt[lo:hi], a, B[lo:hi], C[lo:hi], D, h0)
        torch.testing.assert_close(y[lo:hi], want_y, atol=tol, rtol=tol)
        torch.testing.assert_close(h[i], want_h, atol=tol, rtol=tol)
