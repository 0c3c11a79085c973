"""int8 weight-only GEMM on Hopper through CUTLASS 3's mixed-input mainloop (`csrc/
w8a16_gemm_sm90.cu`): y [M, N] bf16 = (x [M, K] bf16 @ W [N, K] int8 ^T) * scales [N] (+ bias).

Why CUTLASS: Triton's int8 weight-only tl.dot kernel converts the weight tile in registers and,
on Hopper, stores it back to shared memory for wgmma's B operand (its sm_90 PTX); it runs at
~0.42x / 0.61x of bf16 cuBLAS at M = 256 / 4096 (H200, bench/RESULTS.md twenty-second session),
and the warp-level mma.sync form was slower still. CUTLASS makes the int8 weight wgmma's A
operand, converted in registers and consumed from there (the "RS" wgmma), with TMA loads and
warp-specialized producer / consumer warps.

The kernel is a plain shared library (no torch C++ ABI), built once per machine by nvcc with the
headers of the `nvidia-cutlass` wheel (or XLASERVE_CUTLASS_DIR) into the user cache
(XLASERVE_CACHE_DIR or ~/.cache/xlaserve), keyed by a hash of the source, the flags and the
compiler's version; it is called through ctypes on the caller's current CUDA stream, so a
CUDA-graph capture records it like any other launch. `available()` says whether this machine
can build and run it (sm_90 GPU, nvcc, headers); callers fall back to the Triton kernel.

Not timed on a GPU yet: `KernelConfig.int8_gemm` = "triton" stays the default until the A/B
(quant_bench row ``int8_cutlass``, tools/device/next_lease.sh part 3) has run.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "w8a16_gemm_sm90.cu"
# Configs compiled into the library, by the C entry's `tile` index: (weight rows, tokens) of a
# tile (x 64 of K) and the tile scheduler (stream-K splits the K loop of some tiles across SMs
# when the tile count leaves SMs idle: `down` at 256 tokens has 64 tiles of 128 x 128).
TILES: tuple[tuple[int, int, str], ...] = (
    (128, 128, "persistent"),
    (128, 64, "persistent"),
    (128, 128, "stream-K"),
    (128, 64, "stream-K"),
)
# (max M, tile index): the first row with M <= max M wins. Untimed guesses (stream-K, 64-token
# tiles up to 64 tokens) until quant_gemm_sweep's CUTLASS rows have run on an H100 / H200.
TILE_BY_M: tuple[tuple[int, int], ...] = ((64, 3), (1 << 62, 2))
# The layer route (KernelConfig.int8_gemm = "cutlass") leaves M below this to the Triton kernels
# (the GEMV, and the tl.dot table's 16-row bucket at 1.06x bf16 on the H200): a 64-token tile is
# mostly padding there.
MIN_M = 17
NVCC_FLAGS: tuple[str, ...] = (
    "-std=c++17", "-O3", "-arch=sm_90a", "--expt-relaxed-constexpr", "-DNDEBUG",
    "-Xcompiler", "-fPIC", "-shared",
)  # fmt: skip
BUILD_TIMEOUT_S = 900


class CutlassUnavailable(RuntimeError):
    """This machine cannot build or run the CUTLASS kernel (the reason is the message)."""


def cutlass_include_dirs() -> list[Path]:
    """CUTLASS's include folders: XLASERVE_CUTLASS_DIR (a CUTLASS checkout: include/ and
    tools/util/include/) or the `nvidia-cutlass` wheel's copy (cutlass_library/source/...)."""
    root_env = os.environ.get("XLASERVE_CUTLASS_DIR")
    if root_env:
        root = Path(root_env)
    else:
        import importlib.util

        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or not spec.submodule_search_locations:
            raise CutlassUnavailable(
                "CUTLASS headers not found: install the nvidia-cutlass wheel (pip install "
                "--no-deps nvidia-cutlass) or set XLASERVE_CUTLASS_DIR to a CUTLASS checkout"
            )
        root = Path(next(iter(spec.submodule_search_locations))) / "source"
    dirs = [root / "include", root / "tools" / "util" / "include"]
    if not (dirs[0] / "cutlass" / "cutlass.h").is_file():
        raise CutlassUnavailable(f"no cutlass/cutlass.h under {dirs[0]}")
    return dirs


def nvcc_path() -> str:
    """The CUDA compiler: $CUDA_HOME/bin/nvcc or the first nvcc on PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cand = Path(home) / "bin" / "nvcc" if home else None
    path = str(cand) if cand is not None and cand.is_file() else shutil.which("nvcc")
    if not path:
        raise CutlassUnavailable("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    return path


def _cache_dir() -> Path:
    base = os.environ.get("XLASERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "xlaserve"
    )
    return Path(base) / "cutlass"


def build_command(out: str, ptx: bool = False) -> list[str]:
    """The nvcc command that builds the library to `out` (ptx: the PTX text instead)."""
    cmd = [nvcc_path(), *NVCC_FLAGS]
    if ptx:
        cmd = [c for c in cmd if c not in ("-shared", "-Xcompiler", "-fPIC")] + ["-ptx"]
    for d in cutlass_include_dirs():
        cmd.append(f"-I{d}")
    return [*cmd, "-o", out, str(SOURCE)]


def build(out_dir: str | os.PathLike | None = None, ptx: bool = False) -> Path:
    """Compile the library (or its PTX) unless a build of this source, these flags, this
    compiler and these CUTLASS headers is already there; returns its path. Builds into a
    temporary name and renames, so concurrent builders never load a partial file.
    CutlassUnavailable when it cannot build."""
    nvcc = nvcc_path()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    headers = cutlass_include_dirs()
    cutlass_version = (headers[0] / "cutlass" / "version.h").read_bytes()  # which CUTLASS
    key = hashlib.sha256(
        SOURCE.read_bytes()
        + " ".join((*NVCC_FLAGS, str(ptx), *map(str, headers))).encode()
        + version.encode()
        + cutlass_version
    ).hexdigest()[:16]
    folder = Path(out_dir) if out_dir is not None else _cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"w8a16_gemm_sm90_{key}.{'ptx' if ptx else 'so'}"
    if target.is_file():
        return target
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=target.suffix)
    os.close(fd)
    try:
        proc = subprocess.run(
            build_command(tmp, ptx), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
        if proc.returncode:
            raise CutlassUnavailable(f"nvcc failed ({proc.returncode}): {proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    logger.info("loading the CUTLASS w8a16 GEMM (built once per machine: a minute or more)")
    lib = ctypes.CDLL(str(build()))
    lib.xlaserve_w8a16_gemm.restype = ctypes.c_int
    lib.xlaserve_w8a16_gemm.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 5 + [
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
    ]  # fmt: skip
    lib.xlaserve_w8a16_workspace.restype = ctypes.c_size_t
    lib.xlaserve_w8a16_workspace.argtypes = [ctypes.c_int] * 4
    return lib


@functools.lru_cache(maxsize=8)
def available(device_index: int = 0) -> bool:
    """Whether the CUTLASS kernel can run here: an sm_90 GPU (Hopper), nvcc and the headers,
    and a library that builds and loads (built on the first call; False with a logged reason,
    never an error)."""
    try:
        if not torch.cuda.is_available():
            return False
        if torch.cuda.get_device_capability(device_index) != (9, 0):  # sm_90a code only
            return False
        _library()
        return True
    except (CutlassUnavailable, OSError, subprocess.TimeoutExpired) as e:
        # Said once per device (cached): the opt-in falls back to the Triton kernel.
        logger.warning("the CUTLASS int8 GEMM cannot run here (Triton instead): %s", e)
        return False


def tile_for(m: int) -> int:
    """The TILES index for an M-token product (TILE_BY_M)."""
    return next(t for max_m, t in TILE_BY_M if m <= max_m)


def check_operands(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """ValueError unless the kernel takes these operands: x bf16 [M, K] and qweight int8 [N, K]
    contiguous on one CUDA device, scales float32 [N], bias bf16 [N] or None; K a multiple of
    16 and N of 8 (TMA's 16-byte rows)."""
    if x.dim() != 2 or qweight.dim() != 2 or x.shape[1] != qweight.shape[1]:
        raise ValueError(f"w8a16_gemm: x {tuple(x.shape)} and qweight {tuple(qweight.shape)}")
    n, k = qweight.shape
    if x.dtype != torch.bfloat16 or qweight.dtype != torch.int8 or scales.dtype != torch.float32:
        raise ValueError(
            f"w8a16_gemm: wants x bf16, qweight int8, scales float32; got {x.dtype}, "
            f"{qweight.dtype}, {scales.dtype}"
        )
    if scales.shape != (n,) or (bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype)):
        raise ValueError("w8a16_gemm: scales float32 [N] and bias bf16 [N] (or None)")
    if k % 16 or n % 8:
        raise ValueError(f"w8a16_gemm: K {k} must be a multiple of 16 and N {n} of 8")
    ts = [x, qweight, scales] + ([bias] if bias is not None else [])
    if not all(t.is_cuda and t.device == x.device and t.is_contiguous() for t in ts):
        raise ValueError("w8a16_gemm: operands must be contiguous on one CUDA device")
    if any(t.data_ptr() % 16 for t in ts):  # TMA descriptors want 16-byte aligned bases
        raise ValueError("w8a16_gemm: operands must start 16-byte aligned")


def w8a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """y [M, N] bf16 = (x @ qweight^T) * scales (+ bias) on the current CUDA stream; tile: an
    index into TILES (None: `tile_for(M)`). ValueError on bad operands (`check_operands`),
    CutlassUnavailable when the library cannot be built, RuntimeError when CUTLASS refuses."""
    check_operands(x, qweight, scales, bias)
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return y
    t = tile_for(m) if tile is None else tile
    if not 0 <= t < len(TILES):
        raise ValueError(f"w8a16_gemm: tile {t} not in 0..{len(TILES) - 1}")
    lib = _library()
    ws_bytes = lib.xlaserve_w8a16_workspace(t, n, m, k)
    ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    status = lib.xlaserve_w8a16_gemm(
        t, qweight.data_ptr(), x.data_ptr(), scales.data_ptr(),
        bias.data_ptr() if bias is not None else None, y.data_ptr(), n, m, k,
        ws.data_ptr(), stream,
    )  # fmt: skip
    if status:
        what = {1: "shape not implementable", 2: "initialize failed", 3: "launch failed",
                5: "found no GPU"}  # fmt: skip
        raise RuntimeError(f"w8a16_gemm: CUTLASS {what.get(status, status)} (n {n}, m {m}, k {k})")
    return y
