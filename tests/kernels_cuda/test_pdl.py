"""Programmatic dependent launch (kernels_cuda._common): the switch, and on a GPU a chain of
dependent kernels replayed from a CUDA graph gives the same bits with PDL on and off."""

from __future__ import annotations

import pytest
import torch

from xlaserve.kernels_cuda import _common

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def test_pdl_off_on_cpu_and_by_env(monkeypatch) -> None:
    assert not _common.use_pdl(torch.zeros(1))  # CPU (interpreter): never
    assert _common.pdl_kwargs(False) == {}  # the interpreter gets no launch_pdl option
    assert _common.pdl_kwargs(True) == {"launch_pdl": True}
    if torch.cuda.is_available():
        x = torch.zeros(1, device="cuda")
        monkeypatch.setenv(_common.ENV_PDL, "0")
        assert not _common.use_pdl(x)
        monkeypatch.setenv(_common.ENV_PDL, "1")
        cc = torch.cuda.get_device_capability()
        assert _common.use_pdl(x) == (cc >= (9, 0))


def _chain(x, res, w_norm, w1, w2, w3):  # noqa: ANN001, ANN202
    """norm -> GEMV -> act-and-mul -> GEMV -> norm -> GEMV: each kernel reads the last one's
    output, so a missing wait shows up as a different result."""
    from xlaserve.kernels_cuda import fused_add_rms_norm, silu_and_mul
    from xlaserve.kernels_cuda.dense_gemv import dense_gemv

    h, r = fused_add_rms_norm(x, res, w_norm, 1e-6)
    g = dense_gemv(h, w1)
    a = silu_and_mul(g)
    y = dense_gemv(a, w2)
    h2, _ = fused_add_rms_norm(y, r, w_norm, 1e-6)
    return dense_gemv(h2, w3)


@pytest.mark.gpu
@needs_gpu
def test_pdl_chain_in_graph_matches_without(monkeypatch) -> None:
    torch.manual_seed(0)
    dev, dt, hid, inter = "cuda", torch.bfloat16, 4096, 14336
    x = torch.randn(1, hid, device=dev, dtype=dt)
    res = torch.randn(1, hid, device=dev, dtype=dt)
    w_norm = torch.rand(hid, device=dev, dtype=dt) + 0.5
    w1 = torch.randn(2 * inter, hid, device=dev, dtype=dt) * 0.02
    w2 = torch.randn(hid, inter, device=dev, dtype=dt) * 0.02
    w3 = torch.randn(6144, hid, device=dev, dtype=dt) * 0.02
    outs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv(_common.ENV_PDL, pdl)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            _chain(x, res, w_norm, w1, w2, w3)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = _chain(x, res, w_norm, w1, w2, w3)
        runs = []
        for _ in range(20):
            g.replay()
            runs.append(out.clone())
        torch.cuda.synchronize()
        assert all(torch.equal(r, runs[0]) for r in runs)
        outs[pdl] = runs[0]
    assert torch.equal(outs["0"], outs["1"])
