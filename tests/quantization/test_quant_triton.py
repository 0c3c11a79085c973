"""Triton int8/int4 dequant-matmuls vs their torch references (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from xlaserve.quantization import quantize_int4, quantize_int8  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Per-dtype tolerance, relative to max |y|: fp32 accumulation everywhere, output rounding only.
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a).to(DEV)


def test_int8_by_hand() -> None:
    from xlaserve.kernels_cuda.quant_matmul import int8_matmul

    q = torch.tensor([[1, -2, 3, 0] * 4, [127, 0, 0, -127] * 4], dtype=torch.int8, device=DEV)
    s = torch.tensor([0.5, 0.25], device=DEV)
    x = torch.zeros(1, 16, device=DEV)
    x[0, 2] = 2.0  # picks input channel 2: y = [3 * 0.5 * 2, 0]
    x[0, 3] = 1.0  # + channel 3: [0, -127 * 0.25]
    y = int8_matmul(x, q, s)
    assert y.tolist() == [[3.0, -31.75]]


def test_int4_by_hand() -> None:
    from xlaserve.kernels_cuda.quant_matmul import int4_matmul

    # One row, K = 32, group 16: channel k holds value k % 16 (half-split packing), zeros 8 / 0.
    from xlaserve.quantization import pack_int4

    q = (np.arange(32) % 16).astype(np.uint8)[None, :]
    packed = _t(pack_int4(q, 16))
    s = torch.tensor([[1.0, 0.5]], device=DEV)
    z = torch.tensor([[8, 0]], dtype=torch.uint8, device=DEV)
    x = torch.zeros(1, 32, device=DEV)
    x[0, 5] = 1.0  # group 0: (5 - 8) * 1.0 = -3
    x[0, 16 + 9] = 2.0  # group 1: (9 - 0) * 0.5 * 2 = 9
    assert int4_matmul(x, packed, s, z).tolist() == [[6.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 48, 128), (5, 64, 192), (20, 40, 64)])
def test_int8_sweep(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    from xlaserve.kernels_cuda.quant_matmul import int8_matmul, int8_matmul_ref

    rng = np.random.default_rng(m * n + k)
    q, s = quantize_int8(rng.normal(size=(n, k)).astype(np.float32))
    x = _t(rng.normal(size=(m, k)).astype(np.float32)).to(dtype)
    y = int8_matmul(x, _t(q), _t(s))
    ref = int8_matmul_ref(x, _t(q), _t(s))
    assert y.dtype == dtype and y.shape == (m, n)
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= RTOL[dtype] * ref.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,g", [(1, 48, 256, 128), (3, 64, 192, 64), (17, 32, 480, 32)])
def test_int4_sweep(dtype: torch.dtype, m: int, n: int, k: int, g: int) -> None:
    from xlaserve.kernels_cuda.quant_matmul import int4_matmul, int4_matmul_ref

    rng = np.random.default_rng(m * n + k)
    p, s, z = quantize_int4(rng.normal(size=(n, k)).astype(np.float32), 128)
    assert k // s.shape[1] == g
    x = _t(rng.normal(size=(m, k)).astype(np.float32)).to(dtype)
    y = int4_matmul(x, _t(p), _t(s), _t(z))
    ref = int4_matmul_ref(x, _t(p), _t(s), _t(z))
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= RTOL[dtype] * ref.float().abs().max().item()


def test_errors() -> None:
    from xlaserve.kernels_cuda.quant_matmul import int4_matmul, int8_matmul

    x = torch.zeros(2, 64, device=DEV)
    with pytest.raises(ValueError, match="qweight"):
        int8_matmul(x, torch.zeros(8, 32, dtype=torch.int8, device=DEV), torch.ones(8, device=DEV))
    with pytest.raises(ValueError, match="scales"):
        int4_matmul(
            x,
            torch.zeros(8, 32, dtype=torch.uint8, device=DEV),
            torch.ones(8, 3, device=DEV),
            torch.zeros(8, 3, dtype=torch.uint8, device=DEV),
        )


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_torch_quantizer_equals_numpy(method: str) -> None:
    """quantize_weight_torch (dummy weights are quantized on their device) gives the canonical
    numpy quantizer's tensors bit for bit, ties and all-zero rows included."""
    from xlaserve.backends_torch.layers.linear import quantize_weight_torch
    from xlaserve.quantization import quantize_weight
    from xlaserve.quantization.numpy_quant import int4_group_size

    g = np.random.default_rng(3)
    w = g.standard_normal((48, 256)).astype(np.float32)
    w[5] = 0.0  # scale 1 path
    w[7, :8] = [0.5, -0.5, 1.5, -2.5, 127.0, -127.0, 3.0, 0.0]  # exact halves after scaling
    group = int4_group_size(256, 128) if method == "int4" else 0
    ref = quantize_weight(method, w, 128)
    got = quantize_weight_torch(method, torch.from_numpy(w), group)
    assert sorted(got) == sorted(ref)
    for name, arr in ref.items():
        want = arr.view(np.uint8) if method == "fp8" and name == "qweight" else arr  # fp8 bits
        np.testing.assert_array_equal(got[name].numpy(), want, err_msg=f"{method} {name}")
