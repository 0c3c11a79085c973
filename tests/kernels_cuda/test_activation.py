"""silu_and_mul / gelu_tanh_and_mul / gelu_and_mul: hand cases, then a sweep vs references."""

from __future__ import annotations

import math

import pytest
import torch

from xlaserve.kernels_cuda.activation import (
    gelu_and_mul,
    gelu_and_mul_ref,
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_ref,
    silu_and_mul,
    silu_and_mul_ref,
)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_hand_values(device):
    # x = [gate | up]: silu(1) * 2 = 2 / (1 + e^-1); silu(0) * 5 = 0; huge negative gate -> 0.
    x = torch.tensor([[1.0, 0.0, -200.0, 2.0, 5.0, 7.0]], device=device)
    out = silu_and_mul(x).cpu()
    torch.testing.assert_close(out, torch.tensor([[2 / (1 + math.exp(-1)), 0.0, 0.0]]))
    # gelu_tanh(1) = 0.5 * (1 + tanh(sqrt(2/pi) * 1.044715)); gelu(large) = large.
    x = torch.tensor([[1.0, 300.0, 1.0, 1.0]], device=device)
    expected = 0.5 * (1 + math.tanh(math.sqrt(2 / math.pi) * 1.044715))
    torch.testing.assert_close(gelu_tanh_and_mul(x).cpu(), torch.tensor([[expected, 300.0]]))
    torch.testing.assert_close(gelu_and_mul(x).cpu()[0, 1], torch.tensor(300.0))


@pytest.mark.parametrize("t,inter", [(3, 64), (2, 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sweep_matches_reference(t, inter, dtype, device, tolerances):
    g = torch.Generator().manual_seed(inter)
    x = (3 * torch.randn(t, 2 * inter, generator=g)).to(dtype)
    atol, rtol = tolerances[dtype]
    for fn, ref in (
        (silu_and_mul, silu_and_mul_ref),
        (gelu_tanh_and_mul, gelu_tanh_and_mul_ref),
        (gelu_and_mul, gelu_and_mul_ref),
    ):
        torch.testing.assert_close(
            fn(x.to(device)).cpu().float(), ref(x).float(), atol=atol, rtol=rtol
        )


def test_out_argument_and_errors(device):
    x = torch.randn(2, 8, device=device)
    out = torch.empty(2, 4, device=device)
    assert silu_and_mul(x, out=out) is out
    torch.testing.assert_close(out.cpu(), silu_and_mul_ref(x.cpu()))
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_and_mul(torch.zeros(2, 7, device=device))
    with pytest.raises(ValueError, match="out must be"):
        silu_and_mul(x, out=torch.empty(2, 8, device=device))


@pytest.mark.gpu
@gpu
def test_gpu_real_shapes(tolerances):
    x = torch.randn(512, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    atol, rtol = tolerances[torch.bfloat16]
    torch.testing.assert_close(
        silu_and_mul(x).float(), silu_and_mul_ref(x).float(), atol=atol, rtol=rtol
    )
