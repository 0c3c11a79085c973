"""Gated delta rule kernels (kernels_cuda/gdn.py) against the plain sequential recurrence of
backends_torch/layers/gdn_ops.py, in the Triton interpreter on the CPU (compiled on a GPU):
the decode step in place in the slot cache (fresh and continuing requests, untouched slots), and
the chunked prefill (several chunks + a partial one, non-power-of-two head dims) including a
prefill split into pieces that carry the state across calls exactly."""

from __future__ import annotations

import pytest
import torch

from xlaserve.backends_torch.layers import gdn_ops
from xlaserve.kernels_cuda import gdn

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(
    t: int, h: int, dk: int, dv: int, seed: int, hard: bool = False
) -> tuple[torch.Tensor, ...]:
    """hard: slow decay, strong writes, correlated keys (every term of the in-chunk inverse
    matters)."""
    g = torch.Generator().manual_seed(seed)
    q = gdn_ops.l2norm(torch.randn(t, h, dk, generator=g)) * dk**-0.5
    kr = torch.randn(t, h, dk, generator=g)
    if hard:
        kr = kr + 3.0 * torch.randn(1, h, dk, generator=g)
    k = gdn_ops.l2norm(kr)
    v = torch.randn(t, h, dv, generator=g)
    gate = -torch.nn.functional.softplus(torch.randn(t, h, generator=g))
    beta = torch.sigmoid(torch.randn(t, h, generator=g))
    if hard:
        gate, beta = 0.02 * gate, 0.5 + 0.5 * beta
    h0 = torch.randn(h, dk, dv, generator=g)
    return q, k, v, gate, beta, h0


def _dev(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEV) for t in ts]


@pytest.mark.parametrize(("h", "dk", "dv", "block_v"), [(2, 16, 8, 64), (3, 12, 20, 8)])
def test_decode_update_matches_recurrence(h: int, dk: int, dv: int, block_v: int) -> None:
    """block_v 8 with dv 20: three programs per head share one state (a partial last block)."""
    S, B = 5, 3
    q, k, v, gate, beta, _ = _inputs(B, h, dk, dv, seed=dk)
    cache = torch.randn(S, h, dk, dv, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([4, 0, 2])
    keep = torch.tensor([1.0, 0.0, 1.0])
    got_cache = cache.clone().to(DEV)
    got = gdn.gdn_decode_update(got_cache, *_dev(slots, keep, q, k, v, gate, beta), block_v=block_v)
    for b in range(B):  # the definition, one request at a time
        h0 = cache[slots[b]] * keep[b]
        y, hT = gdn_ops.gated_delta_rule(q[b : b + 1], k[b : b + 1], v[b : b + 1],
                                         gate[b : b + 1], beta[b : b + 1], h0)  # fmt: skip
        torch.testing.assert_close(got[b].cpu(), y[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_cache[slots[b]].cpu(), hT, rtol=1e-5, atol=1e-5)
    for s in (1, 3):  # slots of no request: untouched
        torch.testing.assert_close(got_cache[s].cpu(), cache[s])
    ref_cache = cache.clone()
    want = gdn.gdn_decode_update_ref(ref_cache, slots, keep, q, k, v, gate, beta)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("t", "h", "dk", "dv", "hard"),
    [(37, 2, 16, 8, False), (16, 1, 12, 40, False), (5, 2, 8, 8, False), (35, 2, 8, 8, True)],
)
def test_chunked_prefill_matches_recurrence(t: int, h: int, dk: int, dv: int, hard: bool) -> None:
    """dv 40 runs in three 16-column programs per head."""
    q, k, v, gate, beta, h0 = _inputs(t, h, dk, dv, seed=t, hard=hard)
    want_y, want_h = gdn_ops.gated_delta_rule(q, k, v, gate, beta, h0)
    y, hT = gdn.gdn_chunked_prefill(*_dev(q, k, v, gate, beta, h0), chunk=16, block_v=16)
    torch.testing.assert_close(y.cpu(), want_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hT.cpu(), want_h, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_carries_state_across_calls() -> None:
    """A 40-token prefill in pieces 0:7, 7:8, 8:40 (a chunked prefill of the engine) = one call."""
    q, k, v, gate, beta, h0 = _inputs(40, 2, 16, 16, seed=7)
    want_y, want_h = gdn_ops.gated_delta_rule(q, k, v, gate, beta, h0)
    ys, hs = [], h0.to(DEV)
    for lo, hi in [(0, 7), (7, 8), (8, 40)]:
        y, hs = gdn.gdn_chunked_prefill(
            *_dev(q[lo:hi], k[lo:hi], v[lo:hi], gate[lo:hi], beta[lo:hi]), hs
        )
        ys.append(y.cpu())
    torch.testing.assert_close(torch.cat(ys), want_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hs.cpu(), want_h, rtol=1e-4, atol=1e-4)
