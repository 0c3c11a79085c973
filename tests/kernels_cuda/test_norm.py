"""rms_norm / fused_add_rms_norm: hand cases, then a sweep against the torch references."""

from __future__ import annotations

import math

import pytest
import torch

from xlaserve.kernels_cuda.norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_hand_rms_norm(device):
    # [3, 4]: mean square 12.5 -> [3, 4] / sqrt(12.5); weight [1, 2] doubles the second entry.
    x = torch.tensor([[3.0, 4.0]], device=device)
    w = torch.tensor([1.0, 2.0], device=device)
    r = math.sqrt(12.5)
    torch.testing.assert_close(rms_norm(x, w, 0.0).cpu(), torch.tensor([[3 / r, 8 / r]]))
    # Gemma-style (1 + w) with w = 0 equals plain normalisation.
    torch.testing.assert_close(
        rms_norm(x, torch.zeros(2, device=device), 0.0, weight_offset=1.0).cpu(),
        torch.tensor([[3 / r, 4 / r]]),
    )


def test_hand_fused_add(device):
    # x + residual = [3, 4]; the norm is of the SUM.
    x = torch.tensor([[1.0, 1.0]], device=device)
    res = torch.tensor([[2.0, 3.0]], device=device)
    normed, new_res = fused_add_rms_norm(x, res, torch.ones(2, device=device), 0.0)
    r = math.sqrt(12.5)
    torch.testing.assert_close(new_res.cpu(), torch.tensor([[3.0, 4.0]]))
    torch.testing.assert_close(normed.cpu(), torch.tensor([[3 / r, 4 / r]]))
    assert torch.equal(x.cpu(), torch.tensor([[1.0, 1.0]]))  # not in place by default


@pytest.mark.parametrize(
    "t,h,dtype,offset",
    [
        (3, 64, torch.float32, 0.0),
        (4, 96, torch.float16, 0.0),  # non power of two
        (2, 128, torch.bfloat16, 1.0),
        (1, 9000, torch.float32, 0.0),  # > 8192: two chunks per row
    ],
)
def test_sweep_matches_reference(t, h, dtype, offset, device, tolerances, equal_or_ulp):
    g = torch.Generator().manual_seed(h)
    x = torch.randn(t, h, generator=g).to(dtype)
    res = torch.randn(t, h, generator=g).to(dtype)
    w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    atol, rtol = tolerances[dtype]
    eps = 1e-6
    ref = rms_norm_ref(x, w, eps, offset)
    out = rms_norm(x.to(device), w.to(device), eps, offset)
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=atol, rtol=rtol)
    ref_n, ref_r = fused_add_rms_norm_ref(x, res, w, eps, offset)
    n, r = fused_add_rms_norm(x.to(device), res.to(device), w.to(device), eps, offset)
    equal_or_ulp(r.cpu(), ref_r)  # one rounding of an fp32 sum: bit-exact on GPU
    torch.testing.assert_close(n.cpu().float(), ref_n.float(), atol=atol, rtol=rtol)


def test_inplace_writes_inputs(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=g)
    res = torch.randn(3, 64, generator=g)
    w = torch.randn(64, generator=g)
    ref_n, ref_r = fused_add_rms_norm_ref(x, res, w, 1e-5)
    xd, rd = x.to(device), res.to(device)
    n, r = fused_add_rms_norm(xd, rd, w.to(device), 1e-5, inplace=True)
    assert n.data_ptr() == xd.data_ptr() and r.data_ptr() == rd.data_ptr()
    torch.testing.assert_close(xd.cpu(), ref_n, atol=2e-5, rtol=1e-5)
    assert torch.equal(rd.cpu(), ref_r)


def test_bad_arguments_raise(device):
    x = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match=r"weight must be \[H=8\]"):
        rms_norm(x, torch.ones(4, device=device), 1e-6)
    with pytest.raises(ValueError, match="x must be"):
        rms_norm(torch.zeros(8, device=device), torch.ones(8, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual dtype"):
        fused_add_rms_norm(x, x.half(), torch.ones(8, device=device), 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x.long(), torch.ones(8, device=device), 1e-6)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_real_shapes(dtype, tolerances):
    dev = torch.device("cuda")
    x = torch.randn(512, 4096, device=dev, dtype=dtype)
    res = torch.randn_like(x)
    w = torch.rand(4096, device=dev, dtype=dtype) + 0.5
    ref_n, ref_r = fused_add_rms_norm_ref(x, res, w, 1e-5)
    n, r = fused_add_rms_norm(x, res, w, 1e-5)
    atol, rtol = tolerances[dtype]
    assert torch.equal(r, ref_r)
    torch.testing.assert_close(n.float(), ref_n.float(), atol=atol, rtol=rtol)
