"""The CUTLASS int8 weight-only GEMM (kernels_cuda/cutlass_w8a16.py). On any host with nvcc and
the nvidia-cutlass headers (the Makefile installs the wheel): the library builds for sm_90a,
loads through ctypes and exports its entry points, and its PTX is the form it exists for (the
int8 weight converted in registers and fed to wgmma as the register A operand, TMA loads, no
shared-memory store in the main loop). On an sm_90 GPU (`pytest -m gpu`): the product against
the reference, through the layer's KernelConfig.int8_gemm route and inside a CUDA graph."""

from __future__ import annotations

import ctypes
import re
import shutil

import pytest
from optional_deps import import_or_skip

torch = import_or_skip("torch")
from xlaserve.kernels_cuda import cutlass_w8a16 as cw  # noqa: E402


def _toolchain() -> str | None:
    """Why this host cannot build the library (None: it can)."""
    try:
        cw.nvcc_path()
        cw.cutlass_include_dirs()
    except cw.CutlassUnavailable as e:
        return str(e)
    return None


_NO_TOOLCHAIN = _toolchain()
needs_toolchain = pytest.mark.skipif(
    _NO_TOOLCHAIN is not None, reason=f"cannot build CUTLASS here: {_NO_TOOLCHAIN}"
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("cutlass")
    return {"so": cw.build(out), "ptx": cw.build(out, ptx=True), "dir": out}


@needs_toolchain
def test_library_builds_loads_and_caches(built: dict) -> None:
    lib = ctypes.CDLL(str(built["so"]))
    assert hasattr(lib, "xlaserve_w8a16_gemm") and hasattr(lib, "xlaserve_w8a16_workspace")
    lib.xlaserve_w8a16_workspace.restype = ctypes.c_size_t
    assert lib.xlaserve_w8a16_workspace(0, 4096, 256, 14336) >= 0
    lib.xlaserve_w8a16_gemm.restype = ctypes.c_int
    assert lib.xlaserve_w8a16_gemm(7, *([None] * 5), 8, 8, 16, None, None) == 4  # bad tile
    if not torch.cuda.is_available():  # no GPU answers: an error code, not a crash
        for tile in range(len(cw.TILES)):
            assert lib.xlaserve_w8a16_workspace(tile, 4096, 256, 14336) == 0
            assert lib.xlaserve_w8a16_gemm(tile, *([None] * 5), 8, 8, 16, None, None) == 5
    mtime = built["so"].stat().st_mtime_ns
    assert cw.build(built["dir"]) == built["so"] and built["so"].stat().st_mtime_ns == mtime
    assert not list(built["dir"].glob("tmp*")), "a temporary build file was left behind"


@needs_toolchain
def test_ptx_feeds_wgmma_from_registers(built: dict) -> None:
    """Hopper's register-sourced wgmma: its A operand (the converted weight) is a register list
    where the smem-sourced form has a descriptor; the weight arrives by TMA, is read from shared
    memory into registers and converted there (int -> float -> bf16x2), and nothing is stored
    back to shared memory (the epilogue writes through stmatrix)."""
    ptx = built["ptx"].read_text()
    mma = re.findall(
        r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16\s*\{[^}]*\},\s*(\S)", ptx
    )
    assert mma and all(a == "{" for a in mma), mma[:4]
    assert "cp.async.bulk.tensor" in ptx  # TMA
    assert re.search(r"^\s*ld\.shared", ptx, re.M)
    assert re.search(r"^\s*cvt\.rn\.f32\.s32", ptx, re.M)
    assert re.search(r"^\s*cvt\.rn\.bf16x2\.f32", ptx, re.M)
    assert not re.search(r"^\s*st\.shared", ptx, re.M)


def test_operand_checks_and_availability() -> None:
    n, k = 64, 128
    w = torch.zeros(n, k, dtype=torch.int8)
    s = torch.ones(n)
    x = torch.zeros(4, k, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16"):
        cw.check_operands(x.float(), w, s, None)
    with pytest.raises(ValueError, match="qweight"):
        cw.check_operands(x[:, :64], w, s, None)
    with pytest.raises(ValueError, match=r"scales float32 \[N\]"):
        cw.check_operands(x, w, s[:8], None)
    with pytest.raises(ValueError, match="multiple of 16"):
        cw.check_operands(x[:, :120].contiguous(), w[:, :120].contiguous(), s, None)
    with pytest.raises(ValueError, match="CUDA"):
        cw.check_operands(x, w, s, None)
    assert [cw.TILES[cw.tile_for(m)][1] for m in (17, 64, 65, 4096)] == [64, 64, 128, 128]
    if not torch.cuda.is_available():
        assert cw.available() is False  # never raises


def test_missing_headers_are_a_clear_error(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv("XLASERVE_CUTLASS_DIR", str(tmp_path))
    with pytest.raises(cw.CutlassUnavailable, match="cutlass.h"):
        cw.cutlass_include_dirs()
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    assert shutil.which("nvcc") is None
    with pytest.raises(cw.CutlassUnavailable, match="nvcc"):
        cw.nvcc_path()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 (Hopper) GPU",
)
def test_gpu_w8a16_gemm_matches_reference() -> None:
    from xlaserve.backends_torch.layers.linear import Linear, QuantLinear
    from xlaserve.config import KernelConfig
    from xlaserve.kernels_cuda import quant_matmul as qm
    from xlaserve.quantization import QuantScheme

    assert cw.available(), "nvcc / nvidia-cutlass missing on this GPU machine"
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((6144, 4096), (4096, 14336)):
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=g)
        s = torch.rand(n, device="cuda", generator=g) * 0.01
        bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
        for m in (16, 64, 200, 256, 4096):
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            ref = qm.int8_matmul_ref(x, w, s).float()
            for tile in range(len(cw.TILES)):
                y = cw.w8a16_gemm(x, w, s, tile=tile).float()
                err = (y - ref).abs().max() / ref.abs().max()
                assert err < 1e-2, (n, k, m, tile, float(err))
            yb = cw.w8a16_gemm(x, w, s, bias).float()
            assert ((yb - ref - bias.float()).abs().max() / ref.abs().max()) < 1e-2
    # Inside a CUDA graph (the engine captures decode steps): replays recompute it.
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randint(-127, 128, (4096, 4096), dtype=torch.int8, device="cuda")
    s = torch.full((4096,), 0.01, device="cuda")
    cw.w8a16_gemm(x, w, s)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cw.w8a16_gemm(x, w, s)
    x.copy_(torch.randn_like(x))
    graph.replay()
    ref = qm.int8_matmul_ref(x, w, s).float()
    assert (y.float() - ref).abs().max() / ref.abs().max() < 1e-2
    # The layer route: KernelConfig(int8_gemm="cutlass") against the Triton kernel's output.
    lin = Linear(4096, 6144, False, torch.bfloat16, "cuda")
    torch.nn.init.normal_(lin.weight, std=0.02)
    tri = QuantLinear.from_float(lin, QuantScheme("int8"))
    cut = QuantLinear.from_float(lin, QuantScheme("int8"))
    cut.kernels = KernelConfig(int8_gemm="cutlass")
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    a, b = tri(x).float(), cut(x).float()
    assert (a - b).abs().max() / a.abs().max() < 1e-2
