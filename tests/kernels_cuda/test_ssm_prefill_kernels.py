"""State-space prefill kernels (kernels_cuda/ssm_prefill.py) against the model's torch ops
(backends_torch/layers/ssm_ops.py), in the Triton interpreter on the CPU (compiled on a GPU):
causal conv1d with state (T < K-1, T = 1, bias None, non-power-of-two C) and the Mamba2 SSD scan
(T not a multiple of the chunk, T = 1, G = 1 and G > 1, with and without D, nonzero h0), each
also checked for the chunked-prefill rule: two calls carrying the state == one call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xlaserve.backends_torch.layers import ssm_ops
from xlaserve.kernels_cuda import ssm_prefill


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _conv_inputs(t: int, c: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = _g(seed)
    return (
        torch.randn(t, c, generator=g),
        torch.randn(c, k, generator=g),
        torch.randn(c, generator=g),
        torch.randn(c, k - 1, generator=g),
    )


@pytest.mark.parametrize(
    ("t", "c", "k", "use_bias"),
    [(37, 24, 4, True), (1, 24, 4, True), (2, 37, 4, False), (70, 37, 3, False), (5, 8, 2, True)],
)
def test_causal_conv1d_prefill_matches_reference(
    t: int, c: int, k: int, use_bias: bool, device: torch.device
) -> None:
    x, w, b, st = _conv_inputs(t, c, k, t + c + k)
    b = b if use_bias else None
    want_y, want_s = ssm_ops.causal_conv1d(x, w, b, st)
    dev = [v.to(device) if v is not None else None for v in (x, w, b, st)]
    got_y, got_s = ssm_prefill.causal_conv1d_prefill(*dev)
    assert got_y.dtype == torch.float32 and got_s.shape == (c, k - 1)
    torch.testing.assert_close(got_y.cpu(), want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_s.cpu(), want_s)  # a copy of inputs: exact


@pytest.mark.parametrize("split", [1, 2, 9])  # first chunk shorter than K-1, = 2, longer
def test_causal_conv1d_prefill_chunks_carry_state(split: int, device: torch.device) -> None:
    x, w, b, st = (v.to(device) for v in _conv_inputs(20, 16, 4, split))
    y_all, s_all = ssm_prefill.causal_conv1d_prefill(x, w, b, st)
    y1, s1 = ssm_prefill.causal_conv1d_prefill(x[:split], w, b, st)
    y2, s2 = ssm_prefill.causal_conv1d_prefill(x[split:], w, b, s1)
    torch.testing.assert_close(torch.cat([y1, y2]), y_all, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, s_all)


def _ssd_inputs(t: int, hs: int, p: int, n: int, grp: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = _g(seed)
    x = torch.randn(t, hs, p, generator=g)
    dt = F.softplus(torch.randn(t, hs, generator=g) - 1.0)
    A = -torch.exp(torch.randn(hs, generator=g))
    B, C = torch.randn(t, grp, n, generator=g), torch.randn(t, grp, n, generator=g)
    D = torch.randn(hs, generator=g)
    h0 = torch.randn(hs, p, n, generator=g)
    return x, dt, A, B, C, D, h0


def _heads(m: torch.Tensor, hs: int) -> torch.Tensor:
    """Groups [T, G, N] -> per head [T, Hs, N] (head h reads group h // (Hs / G))."""
    return m.repeat_interleave(hs // m.shape[1], dim=1)


@pytest.mark.parametrize(
    ("t", "hs", "p", "n", "grp", "use_d", "chunk"),
    [
        (37, 4, 8, 16, 2, True, 16),  # T not a multiple of the chunk, G > 1
        (1, 4, 8, 16, 1, True, 16),  # T = 1
        (40, 3, 5, 12, 1, False, 16),  # non-power-of-two P, N; no D
        (20, 6, 16, 8, 3, True, 64),  # one partial chunk, G = 3
        (33, 2, 70, 16, 2, False, 32),  # P > the P block: two P blocks
    ],
)
def test_ssd_chunked_prefill_matches_references(
    t: int, hs: int, p: int, n: int, grp: int, use_d: bool, chunk: int, device: torch.device
) -> None:
    x, dt, A, B, C, D, h0 = _ssd_inputs(t, hs, p, n, grp, t + hs + p + n)
    D = D if use_d else None
    a3 = A.reshape(hs, 1, 1)
    seq_y, seq_h = ssm_ops.selective_scan(x, dt, a3, _heads(B, hs), _heads(C, hs), D, h0)
    chk_y, chk_h = ssm_ops.ssd_chunked(x, dt, a3, _heads(B, hs), _heads(C, hs), D, h0, chunk)
    dev = [v.to(device) if v is not None else None for v in (x, dt, A, B, C, D, h0)]
    got_y, got_h = ssm_prefill.ssd_chunked_prefill(*dev, chunk=chunk)
    assert got_y.dtype == torch.float32 and got_y.shape == (t, hs, p)
    assert got_h.shape == (hs, p, n)
    for want_y, want_h in ((seq_y, seq_h), (chk_y, chk_h)):
        torch.testing.assert_close(got_y.cpu(), want_y, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_h.cpu(), want_h, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("split", [1, 16, 21])  # T = 1 chunk, a chunk boundary, mid-chunk
def test_ssd_chunked_prefill_chunks_carry_state(split: int, device: torch.device) -> None:
    x, dt, A, B, C, D, h0 = (v.to(device) for v in _ssd_inputs(45, 4, 8, 16, 2, split))
    y_all, h_all = ssm_prefill.ssd_chunked_prefill(x, dt, A, B, C, D, h0, chunk=16)
    y1, h1 = ssm_prefill.ssd_chunked_prefill(
        x[:split], dt[:split], A, B[:split], C[:split], D, h0, chunk=16
    )
    y2, h2 = ssm_prefill.ssd_chunked_prefill(
        x[split:], dt[split:], A, B[split:], C[split:], D, h1, chunk=16
    )
    torch.testing.assert_close(torch.cat([y1, y2]), y_all, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h2, h_all, rtol=1e-4, atol=1e-4)


def test_bad_shapes_raise_clear_errors(device: torch.device) -> None:
    x, w, b, st = (v.to(device) for v in _conv_inputs(4, 8, 4, 0))
    with pytest.raises(ValueError, match="state"):
        ssm_prefill.causal_conv1d_prefill(x, w, b, st[:, :2])
    x, dt, A, B, C, D, h0 = (v.to(device) for v in _ssd_inputs(4, 4, 8, 16, 3, 0)[:7])
    with pytest.raises(ValueError, match="G must divide Hs"):
        ssm_prefill.ssd_chunked_prefill(x, dt, A, B, C, D, h0)
    x, dt, A, B, C, D, h0 = (v.to(device) for v in _ssd_inputs(4, 4, 8, 16, 2, 0))
    with pytest.raises(ValueError, match="chunk"):
        ssm_prefill.ssd_chunked_prefill(x, dt, A, B, C, D, h0, chunk=24)
