"""Triton int8/int4 dequant-matmuls vs their torch references (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
from optional_deps import import_or_skip

torch = import_or_skip("torch")
import_or_skip("triton")

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


# ---- GEMV path (M <= GEMV_MAX_M) ----------------------------------------------------------------

GEMV_M = [1, 2, 3, 5, 8]


def _gemv_err(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype and y.shape == ref.shape
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= RTOL[dtype] * ref.float().abs().max().item(), err


def _fp8_weight(rng: np.random.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from xlaserve.quantization import quantize_weight

    d = quantize_weight("fp8", rng.normal(size=(n, k)).astype(np.float32), 128)
    return _t(d["qweight"].view(np.uint8)), _t(d["scales"])


def test_gemv_defaults_cover_small_m() -> None:
    from xlaserve.kernels_cuda import quant_matmul as qm

    # Default dispatch (measured on the H200): GEMV at M == 1 for all, up to M == 4 for int4.
    assert [qm.use_gemv("int8", m) for m in (1, 2)] == [True, False]
    assert [qm.use_gemv("int4", m) for m in (4, 5)] == [True, False]
    assert qm.use_gemv("fp8", 2, tiles=(8, 256, 1, 4)) and not qm.use_gemv("fp8", 2, (16, 64, 64))
    assert not qm.use_gemv("int8", qm.GEMV_MAX_M + 1, tiles=(8, 256, 1, 4))

    for fmt in ("int8", "int4", "fp8"):
        for m in range(1, qm.GEMV_MAX_M + 1):
            t = qm.gemv_tiles(fmt, m, 4096, 14336)
            assert t.split_k >= 1 and t.block_k >= 16
    with pytest.raises(ValueError, match="GEMV range"):
        qm.gemv_tiles("int8", qm.GEMV_MAX_M + 1, 64, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", GEMV_M)
def test_int8_gemv(dtype: torch.dtype, m: int) -> None:
    from xlaserve.kernels_cuda.quant_matmul import gemv_tiles, int8_matmul, int8_matmul_ref

    n, k = 40, 200  # neither a multiple of the blocks: ragged N and K tails are masked
    rng = np.random.default_rng(10 + m)
    q, s = quantize_int8(rng.normal(size=(n, k)).astype(np.float32))
    x = _t(rng.normal(size=(m, k)).astype(np.float32)).to(dtype)
    t = gemv_tiles("int8", m, n, k)  # the GEMV at every M (the default takes it at M == 1)
    _gemv_err(int8_matmul(x, _t(q), _t(s), tiles=t), int8_matmul_ref(x, _t(q), _t(s)), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", GEMV_M)
def test_int4_gemv(dtype: torch.dtype, group: int, m: int) -> None:
    from xlaserve.kernels_cuda.quant_matmul import gemv_tiles, int4_matmul, int4_matmul_ref

    n, k = 40, 384  # K: 3 groups of 128, not a multiple of the 1024 / 512 default block_k
    rng = np.random.default_rng(group + m)
    p, s, z = quantize_int4(rng.normal(size=(n, k)).astype(np.float32), group)
    assert k // s.shape[1] == group
    x = _t(rng.normal(size=(m, k)).astype(np.float32)).to(dtype)
    ref = int4_matmul_ref(x, _t(p), _t(s), _t(z))
    t = gemv_tiles("int4", m, n, k)
    _gemv_err(int4_matmul(x, _t(p), _t(s), _t(z), tiles=t), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", GEMV_M)
def test_fp8_gemv(dtype: torch.dtype, m: int) -> None:
    from xlaserve.kernels_cuda.quant_matmul import fp8_matmul_ref, fp8_weight_matmul, gemv_tiles

    n, k = 40, 200
    rng = np.random.default_rng(20 + m)
    q, s = _fp8_weight(rng, n, k)
    x = _t(rng.normal(size=(m, k)).astype(np.float32)).to(dtype)
    t = gemv_tiles("fp8", m, n, k)
    _gemv_err(fp8_weight_matmul(x, q, s, tiles=t), fp8_matmul_ref(x, q, s), dtype)
    # A float8_e4m3fn tensor is read as its bits.
    q8 = q.view(torch.float8_e4m3fn)
    _gemv_err(fp8_weight_matmul(x, q8, s, tiles=t), fp8_matmul_ref(x, q, s), dtype)


def test_fp8_gemv_by_hand() -> None:
    from xlaserve.kernels_cuda.quant_matmul import fp8_weight_matmul

    # e4m3 bits: 0x38 = 1.0, 0xC0 = -2.0, 0x01 = 2^-9 (smallest subnormal), 0x7E = 448.
    q = torch.tensor([[0x38, 0xC0, 0x00, 0x00], [0x01, 0x00, 0x7E, 0x00]], dtype=torch.uint8)
    q = q.repeat(1, 4).to(DEV)  # K = 16
    s = torch.tensor([0.5, 2.0], device=DEV)
    x = torch.zeros(1, 16, device=DEV)
    x[0, 0], x[0, 1], x[0, 2] = 512.0, 1.0, 0.25
    # row 0: (512 * 1 + 1 * -2) * 0.5 = 255; row 1: (512 * 2^-9 + 0.25 * 448) * 2 = 226
    assert fp8_weight_matmul(x, q, s).tolist() == [[255.0, 226.0]]


def test_fp8_large_m_falls_back_to_torch() -> None:
    from xlaserve.kernels_cuda.quant_matmul import GEMV_MAX_M, fp8_matmul_ref, fp8_weight_matmul

    rng = np.random.default_rng(5)
    q, s = _fp8_weight(rng, 24, 64)
    x = _t(rng.normal(size=(GEMV_MAX_M + 3, 64)).astype(np.float32))
    _gemv_err(fp8_weight_matmul(x, q, s), fp8_matmul_ref(x, q, s), torch.float32)
    with pytest.raises(ValueError, match="GEMV only"):
        fp8_weight_matmul(x, q, s, tiles=(16, 64, 1, 4))


# (block_n, block_k, split_k, num_warps[, bit_cvt]): split_k 3 leaves ragged slices, split_k 4
# on K = 200 with block_k 128 leaves two slices empty (they must write zero partials).
TILE_OVERRIDES = [(8, 32, 1, 2), (16, 64, 2, 4), (8, 32, 3, 4, False), (16, 128, 4, 4)]


@pytest.mark.parametrize("tiles", TILE_OVERRIDES)
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_tiles_override(tiles: tuple, m: int) -> None:
    from xlaserve.kernels_cuda import quant_matmul as qm

    rng = np.random.default_rng(7)
    dtype = torch.bfloat16
    n, k = 40, 200
    x = _t(rng.normal(size=(m, k)).astype(np.float32)).to(dtype)
    q, s = (_t(a) for a in quantize_int8(rng.normal(size=(n, k)).astype(np.float32)))
    _gemv_err(qm.int8_matmul(x, q, s, tiles=tiles), qm.int8_matmul_ref(x, q, s), dtype)
    if qm.fp8_gemv_supported(DEV):  # CUDA cc >= 8.9 or the interpreter
        q8, s8 = _fp8_weight(rng, n, k)
        ref8 = qm.fp8_matmul_ref(x, q8, s8)
        _gemv_err(qm.fp8_weight_matmul(x, q8, s8, tiles=tiles), ref8, dtype)
    k4 = 256  # int4 needs K a multiple of the group (64 here)
    x4 = _t(rng.normal(size=(m, k4)).astype(np.float32)).to(dtype)
    p, s4, z = (_t(a) for a in quantize_int4(rng.normal(size=(n, k4)).astype(np.float32), 64))
    ref = qm.int4_matmul_ref(x4, p, s4, z)
    _gemv_err(qm.int4_matmul(x4, p, s4, z, tiles=tiles), ref, dtype)


def test_gemv_tiles_override_errors() -> None:
    from xlaserve.kernels_cuda import quant_matmul as qm

    x = torch.zeros(1, 64, device=DEV)
    q = torch.zeros(8, 64, dtype=torch.int8, device=DEV)
    s = torch.ones(8, device=DEV)
    for bad in [(16, 100, 1, 4), (12, 64, 1, 4), (16, 64, 1, 3), (16, 8, 1, 4), (16, 64)]:
        with pytest.raises(ValueError, match="tiles"):
            qm.int8_matmul(x, q, s, tiles=bad)
    x_big = torch.zeros(qm.GEMV_MAX_M + 1, 64, device=DEV)
    with pytest.raises(ValueError, match="tl.dot tiles"):
        qm.int8_matmul(x_big, q, s, tiles=(16, 64, 1, 4))  # a GEMV config where tl.dot runs


def test_int4_gemv_odd_groups() -> None:
    """The GEMV takes any even group: 48 (HALF 24: 8-byte chunks) and 6 (HALF 3: 1-byte ones),
    where the tl.dot path needs a power-of-two divisor >= 16."""
    from xlaserve.kernels_cuda.quant_matmul import int4_matmul, int4_matmul_ref

    rng = np.random.default_rng(11)
    for group, k in ((48, 144), (6, 36)):
        p, s, z = quantize_int4(rng.normal(size=(24, k)).astype(np.float32), group)
        assert k // s.shape[1] == group
        x = _t(rng.normal(size=(2, k)).astype(np.float32))
        ref = int4_matmul_ref(x, _t(p), _t(s), _t(z))
        _gemv_err(int4_matmul(x, _t(p), _t(s), _t(z)), ref, torch.float32)


def test_gemv_errors() -> None:
    from xlaserve.kernels_cuda.quant_matmul import fp8_weight_matmul, int4_matmul

    x = torch.zeros(1, 64, device=DEV)
    s8 = torch.ones(8, device=DEV)
    with pytest.raises(ValueError, match="qweight"):
        fp8_weight_matmul(x, torch.zeros(8, 32, dtype=torch.uint8, device=DEV), s8)
    with pytest.raises(ValueError, match="scales"):
        fp8_weight_matmul(x, torch.zeros(8, 64, dtype=torch.uint8, device=DEV), s8[:4])
    with pytest.raises(ValueError, match="dtype"):
        fp8_weight_matmul(x, torch.zeros(8, 64, dtype=torch.int8, device=DEV), s8)
    with pytest.raises(ValueError, match="even"):  # K = 126 in 2 groups of 63
        int4_matmul(
            torch.zeros(1, 126, device=DEV),
            torch.zeros(8, 63, dtype=torch.uint8, device=DEV),
            torch.ones(8, 2, device=DEV),
            torch.zeros(8, 2, dtype=torch.uint8, device=DEV),
        )
    with pytest.raises(ValueError, match="zeros"):
        int4_matmul(
            x,
            torch.zeros(8, 32, dtype=torch.uint8, device=DEV),
            torch.ones(8, 2, device=DEV),
            torch.zeros(8, 2, dtype=torch.int32, device=DEV),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 24])
def test_quant_linear_fp8_cuda_paths(m: int) -> None:
    """QuantLinear fp8 on CUDA: weight-only GEMV at M == 1, per-token _scaled_mm above."""
    from xlaserve.backends_torch.layers.linear import (
        Linear,
        QuantLinear,
        fp8_linear_ref,
        fp8_supported,
    )
    from xlaserve.kernels_cuda.quant_matmul import fp8_matmul_ref, use_gemv
    from xlaserve.quantization import QuantScheme

    if not fp8_supported("cuda"):
        pytest.skip("fp8 needs CUDA compute capability >= 8.9")
    lin = Linear(256, 48, dtype=torch.bfloat16, device="cuda")
    torch.nn.init.normal_(lin.weight, std=0.05)
    q = QuantLinear.from_float(lin, QuantScheme("fp8"))
    x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
    w8 = q.qweight.view(torch.float8_e4m3fn)
    ref = (
        fp8_matmul_ref(x, q.qweight, q.scales)
        if use_gemv("fp8", m)
        else fp8_linear_ref(x, w8, q.scales)
    )
    _gemv_err(q(x), ref, torch.bfloat16)
