"""Dense Triton GEMV (M == 1) vs the fp32 torch reference and F.linear; the Linear dispatch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from xlaserve.kernels_cuda import dense_gemv as dg
from xlaserve.kernels_cuda.dense_gemv import GemvTiles, dense_gemv, dense_gemv_ref

# (atol, rtol) vs the fp32 reference: one output rounding (summation order differs).
_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 1e-2)}


def _operands(n: int, k: int, dtype: torch.dtype, bias: bool, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed + n + k)
    x = torch.randn(1, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x.to(device), w.to(device), None if b is None else b.to(device)


@pytest.mark.parametrize(
    "n,k,dtype,tiles,bias",
    [
        (37, 200, torch.float32, GemvTiles(4, 64, 1, 1), False),  # ragged N and K
        (70, 96, torch.bfloat16, GemvTiles(8, 32, 1, 1), True),  # x as a broadcast tile
        (33, 300, torch.float16, GemvTiles(4, 64, 3, 1), True),  # split-K, bias on slice 0
        (16, 130, torch.bfloat16, GemvTiles(2, 16, 4, 1), False),  # split-K, empty last slice
        (24, 64, torch.float16, GemvTiles(8, 256, 1, 1), False),  # one ragged step, x vector
        (20, 512, torch.bfloat16, GemvTiles(4, 64, 0, 1), False),  # auto split
    ],
)
@pytest.mark.parametrize("prefetch", ["1", "0"])
def test_matches_reference(n, k, dtype, tiles, bias, prefetch, device, monkeypatch):
    # Both loop forms: the double-buffered weight prefetch (default) and the plain loop.
    monkeypatch.setenv(dg.ENV_GEMV_PREFETCH, prefetch)
    assert dg.gemv_prefetch_enabled() == (prefetch == "1")
    x, w, b = _operands(n, k, dtype, bias, device)
    got = dense_gemv(x, w, b, tiles=tiles)
    assert got.shape == (1, n) and got.dtype == dtype
    ref = dense_gemv_ref(x.cpu(), w.cpu(), None if b is None else b.cpu())
    atol, rtol = _TOL[dtype]
    torch.testing.assert_close(got.cpu().float(), ref.float(), atol=atol, rtol=rtol)
    lin = F.linear(x.cpu().float(), w.cpu().float(), None if b is None else b.cpu().float())
    torch.testing.assert_close(got.cpu().float(), lin, atol=atol, rtol=rtol)


def test_split_k_is_deterministic_and_close_to_unsplit(device):
    x, w, _ = _operands(24, 384, torch.float32, False, device)
    one = dense_gemv(x, w, tiles=GemvTiles(8, 64, 1, 1))
    split = dense_gemv(x, w, tiles=GemvTiles(8, 64, 4, 1))
    torch.testing.assert_close(split, one, atol=1e-5, rtol=1e-5)
    assert torch.equal(dense_gemv(x, w, tiles=GemvTiles(8, 64, 4, 1)), split)


def test_strided_weight_rows(device):
    # A row slice of a wider weight: rows stride K + 8, last dim contiguous.
    x, w, _ = _operands(12, 72, torch.float32, False, device)
    wide = torch.zeros(12, 80, device=device)
    wide[:, :72] = w
    got = dense_gemv(x, wide[:, :72], tiles=GemvTiles(4, 32, 1, 1))
    torch.testing.assert_close(got.cpu(), dense_gemv_ref(x.cpu(), w.cpu()), atol=1e-4, rtol=1e-4)


def test_rejects_bad_inputs(device):
    x, w, _ = _operands(8, 32, torch.float32, False, device)
    with pytest.raises(ValueError, match=r"\[1, K\]"):
        dense_gemv(torch.cat([x, x]), w)
    with pytest.raises(ValueError, match="one dtype"):
        dense_gemv(x, w.half())
    with pytest.raises(ValueError, match="bias"):
        dense_gemv(x, w, torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="bad GEMV tiles"):
        dense_gemv(x, w, tiles=(3, 64, 1, 1))


def test_tiles_table_and_auto_split(monkeypatch):
    monkeypatch.setattr(dg, "DENSE_GEMV_TILES", {(64, 128): GemvTiles(16, 32, 2, 1)})
    assert dg.dense_gemv_tiles(64, 128) == GemvTiles(16, 32, 2, 1)
    t = dg.dense_gemv_tiles(4096, 14336)
    assert t.split_k >= 1 and (t.block_n, t.block_k) == dg.DENSE_GEMV_DEFAULT_TILES[:2]


def test_use_dense_gemv_table_and_env(monkeypatch):
    monkeypatch.delenv(dg.ENV_DENSE_GEMV, raising=False)
    cuda = torch.device("cuda")
    assert dg.DENSE_GEMV_SHAPES is None  # default: every shape on CUDA (measured faster)
    assert dg.use_dense_gemv(1, 64, 128, torch.bfloat16, cuda)
    assert not dg.use_dense_gemv(2, 64, 128, torch.bfloat16, cuda)  # M > 1: cuBLAS
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter only when asked for
    assert not dg.use_dense_gemv(1, 64, 128, torch.bfloat16, torch.device("cpu"))
    monkeypatch.setattr(dg, "DENSE_GEMV_SHAPES", frozenset({(64, 128)}))
    assert dg.use_dense_gemv(1, 64, 128, torch.bfloat16, torch.device("cpu"))
    assert dg.use_dense_gemv(1, 64, 128, torch.bfloat16, cuda)
    assert not dg.use_dense_gemv(1, 64, 256, torch.bfloat16, cuda)  # other shape
    assert not dg.use_dense_gemv(2, 64, 128, torch.bfloat16, cuda)  # M > 1
    assert not dg.use_dense_gemv(1, 64, 128, torch.float32, cuda)  # fp32: cuBLAS
    monkeypatch.setenv(dg.ENV_DENSE_GEMV, "0")
    assert not dg.use_dense_gemv(1, 64, 128, torch.bfloat16, cuda)
    monkeypatch.setenv(dg.ENV_DENSE_GEMV, "1")
    assert dg.use_dense_gemv(1, 32, 32, torch.float16, cuda)


@pytest.mark.parametrize("mode", ["table", "env"])
def test_linear_dispatch_picks_the_kernel(mode, device, monkeypatch):
    """Linear.forward at M == 1 bf16 calls dense_gemv exactly when the table / env says so and
    matches F.linear; M > 1 and other shapes stay on F.linear."""
    from xlaserve.backends_torch.layers.linear import Linear, VocabEmbedding

    monkeypatch.delenv(dg.ENV_DENSE_GEMV, raising=False)
    calls: list[tuple[int, int]] = []
    real = dg.dense_gemv

    def spy(x, w, b=None, **kw):
        calls.append(tuple(w.shape))
        return real(x, w, b, **kw)

    monkeypatch.setattr(dg, "dense_gemv", spy)
    monkeypatch.setattr(dg, "DENSE_GEMV_SHAPES", frozenset())  # off, then on by table / env
    lin = Linear(96, 40, bias=True, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96) / 10)
        lin.bias.copy_(torch.randn(40))
    x = torch.randn(1, 1, 96).to(torch.bfloat16).to(device)  # [..., K] with one row
    ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    lin(x)
    assert calls == []  # off
    if mode == "table":
        monkeypatch.setattr(dg, "DENSE_GEMV_SHAPES", frozenset({(40, 96)}))
    else:
        monkeypatch.setenv(dg.ENV_DENSE_GEMV, "1")
    got = lin(x)
    assert calls == [(40, 96)] and got.shape == (1, 1, 40)
    torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=2e-2)
    lin(torch.randn(2, 96).to(torch.bfloat16).to(device))  # M = 2: cuBLAS
    assert len(calls) == 1
    emb = VocabEmbedding(40, 96, dtype=torch.bfloat16, device=device)  # tied lm head
    with torch.no_grad():
        emb.weight.copy_(lin.weight)
    emb.as_lm_head(x[0])
    assert calls[-1] == (40, 96) and len(calls) == 2


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,n,k",
    [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
     ("down", 4096, 14336), ("lm_head", 128256, 4096)],
)  # fmt: skip
def test_gpu_llama8b_shapes(shape, n, k):
    dev = torch.device("cuda")
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    w = (0.02 * torch.randn(n, k, device=dev)).to(torch.bfloat16)
    ref = dense_gemv_ref(x, w).float()
    tol = 1e-2 * ref.abs().max().item()
    for prefetch in ("1", "0"):
        os.environ[dg.ENV_GEMV_PREFETCH] = prefetch
        try:
            for tiles in (None, GemvTiles(4, 1024, 2, 4), GemvTiles(8, 512, 1, 4)):
                got = dense_gemv(x, w, tiles=tiles).float()
                torch.testing.assert_close(got, ref, atol=tol, rtol=0)
        finally:
            del os.environ[dg.ENV_GEMV_PREFETCH]
    torch.testing.assert_close(dense_gemv(x, w).float(), F.linear(x, w).float(), atol=tol, rtol=0)


# ---- act-and-mul epilogue (dense_gemv_gate_act) -----------------------------------------------


def _act_mul_ref(x2: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up in fp32, rounded to x2's dtype (what the act-and-mul kernel stores)."""
    from xlaserve.backends_torch.layers.activation import get_activation

    g, u = x2.float().chunk(2, dim=-1)
    return (get_activation(act)(g) * u).to(x2.dtype)


@pytest.mark.parametrize(
    "n,k,dtype,tiles,act,bias,prefetch",
    [
        (37, 200, torch.float32, GemvTiles(4, 64, 1, 1), "silu", False, "0"),  # ragged N, K
        (70, 96, torch.bfloat16, GemvTiles(8, 32, 1, 1), "gelu_tanh", True, "1"),  # x as tile
        (33, 300, torch.float16, GemvTiles(2, 64, 1, 1), "gelu", True, "0"),  # bias: both halves
        (24, 64, torch.bfloat16, GemvTiles(8, 256, 1, 1), "silu", False, "1"),  # one ragged step
        (20, 512, torch.float16, None, "relu", False, "0"),  # default tiles (one row each)
        (9, 130, torch.bfloat16, None, "silu", True, "1"),
    ],
)
def test_gate_act_matches_unfused_and_reference(
    n, k, dtype, tiles, act, bias, prefetch, device, monkeypatch
):
    from xlaserve import kernels_cuda
    from xlaserve.kernels_cuda.dense_gemv import DENSE_GEMV_GATE_ACT_TILES, dense_gemv_gate_act

    monkeypatch.setenv(dg.ENV_GEMV_PREFETCH, prefetch)
    x, w, b = _operands(2 * n, k, dtype, bias, device)  # w = [gate; up], [2N, K]
    got = dense_gemv_gate_act(x, w, b, act, tiles=tiles)
    assert got.shape == (1, n) and got.dtype == dtype
    # Same tiles, unfused: the GEMV, then the act-and-mul kernel (relu has none: its rounding
    # in torch): bit-identical (gate and up are rounded to x's dtype in both).
    gu = dense_gemv(x, w, b, tiles=tiles or DENSE_GEMV_GATE_ACT_TILES)
    if act == "relu":
        a = _act_mul_ref(gu.cpu(), act).to(device)
    else:
        a = getattr(kernels_cuda, f"{act}_and_mul")(gu)
    assert torch.equal(got, a)
    ref = _act_mul_ref(dense_gemv_ref(x.cpu(), w.cpu(), None if b is None else b.cpu()), act)
    atol, rtol = _TOL[dtype]
    torch.testing.assert_close(got.cpu().float(), ref.float(), atol=atol, rtol=rtol)


def test_gate_act_rejects_bad_inputs(device):
    from xlaserve.kernels_cuda.dense_gemv import dense_gemv_gate_act

    x = torch.randn(1, 64, device=device)
    w = torch.randn(8, 64, device=device)
    with pytest.raises(ValueError, match="even row count"):
        dense_gemv_gate_act(x, w[:7])
    with pytest.raises(ValueError, match="act must be one of"):
        dense_gemv_gate_act(x, w, act="tanh")
    with pytest.raises(ValueError, match="split_k must be 1"):
        dense_gemv_gate_act(x, w, tiles=GemvTiles(2, 16, 2, 1))
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        dense_gemv_gate_act(x, w, torch.randn(4, device=device))


@pytest.mark.parametrize("fused", ["1", "0"])
def test_mlp_batch1_uses_the_gate_act_gemv(fused, device, monkeypatch):
    """A gated MLP on the Triton ops at one row: act-and-mul goes into the gate_up GEMV's
    epilogue (when the dense GEMV serves the shape and the switch is on) with the same bits as
    the GEMV and the act-and-mul kernel."""
    from xlaserve.backends_torch.layers.activation import MLP
    from xlaserve.kernels_cuda import dense_gemv as dgm

    monkeypatch.setenv(dg.ENV_DENSE_GEMV, "1")
    monkeypatch.setenv(dg.ENV_GATE_ACT_GEMV, fused)
    calls: list[str] = []
    real = dgm.dense_gemv_gate_act
    monkeypatch.setattr(
        dgm, "dense_gemv_gate_act", lambda *a, **k: calls.append("x") or real(*a, **k)
    )
    torch.manual_seed(0)
    mlp = MLP(64, 96, "silu", dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p) / 8)
    mlp.use_triton_ops = True
    x = torch.randn(1, 64).to(torch.bfloat16).to(device)
    got = mlp(x)
    assert calls == (["x"] if fused == "1" else [])
    monkeypatch.setenv(dg.ENV_GATE_ACT_GEMV, "0")
    assert torch.equal(got, mlp(x))  # same bits as GEMV + act-and-mul kernel
    assert len(calls) == (1 if fused == "1" else 0)
    monkeypatch.setenv(dg.ENV_GATE_ACT_GEMV, fused)
    mlp(torch.randn(3, 64).to(torch.bfloat16).to(device))  # M > 1: never fused
    assert len(calls) == (1 if fused == "1" else 0)


@pytest.mark.gpu
def test_gpu_gate_act_llama8b_gate_up() -> None:
    from xlaserve import kernels_cuda
    from xlaserve.kernels_cuda.dense_gemv import dense_gemv_gate_act

    dev = torch.device("cuda")
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    w = (0.02 * torch.randn(2 * 14336, 4096, device=dev)).to(torch.bfloat16)
    for prefetch in ("1", "0"):
        os.environ[dg.ENV_GEMV_PREFETCH] = prefetch
        try:
            for tiles in (None, GemvTiles(2, 1024, 1, 4), GemvTiles(4, 512, 1, 4)):
                got = dense_gemv_gate_act(x, w, tiles=tiles)
                gu = dense_gemv(x, w, tiles=tiles or dg.DENSE_GEMV_GATE_ACT_TILES)
                assert torch.equal(got, kernels_cuda.silu_and_mul(gu))
        finally:
            del os.environ[dg.ENV_GEMV_PREFETCH]
