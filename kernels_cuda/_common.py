"""Shared helpers for the Triton kernels: launch checks and interpret-mode detection.

Imported only by the kernel modules (which import torch and triton), never by the lazy package
``__init__``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from xlaserve.config import KernelConfig, kernel_switch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpret_mode() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(name: str, *tensors: torch.Tensor) -> None:
    """Raise ValueError unless all tensors share one device that can run the Triton kernels.

    CUDA tensors run compiled kernels; CPU tensors run only under ``TRITON_INTERPRET=1``.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(
            f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}"
        )
    dev = next(iter(devices))
    if dev.type == "cpu" and not interpret_mode():
        raise ValueError(
            f"{name}: CPU tensors need TRITON_INTERPRET=1 (set before triton is imported); "
            "use the *_ref torch reference on CPU otherwise"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: unsupported device {dev}")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name}: dtype {t.dtype} not in {allowed}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name}: last dim must be contiguous (stride 1), got strides {t.stride()}"
        )


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def row_num_warps(block: int) -> int:
    """Warps of a one-row-per-program reduction kernel (RMSNorm and its kin) over `block` lanes."""
    return 4 if block <= 2048 else (8 if block <= 4096 else 16)


def upcast_dot(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands must be cast to fp32 first.

    Triton's CPU interpreter computes bf16 ``tl.dot`` wrongly (numpy has no bf16; measured here:
    garbage of order 1e10 on triton 3.9), while bf16 loads, stores and casts are right. So under
    the interpreter bf16 tiles are upcast before the dot; on GPU they stay bf16 (tensor cores).
    """
    return interpret_mode() and dtype == torch.bfloat16


# ---- programmatic dependent launch (PDL, Hopper+) ------------------------------------------------
# A kernel launched with PDL may start while the previous kernel in the stream still runs: its
# programs are scheduled as soon as every program of the previous kernel has signalled
# (`gdc_launch_dependents`), then wait in `gdc_wait` until that kernel has finished and its writes
# are visible. Both are the first thing every xlaserve kernel does (`pdl_prologue`), so nothing is
# read or written early; what overlaps is the launch and block scheduling of the next kernel with
# the tail of the current one. Measured on the H200 (bench/RESULTS.md): ~0.65 us per kernel
# boundary of a batch-1 decode graph. KernelConfig.pdl off (XLASERVE_PDL=0) turns it off.
ENV_PDL = KernelConfig.env_name("pdl")


@functools.lru_cache(maxsize=16)
def _pdl_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def use_pdl(t: torch.Tensor, kernels: KernelConfig | None = None) -> bool:
    """Whether kernels on t's device launch with PDL: CUDA, compute capability >= 9.0, not under
    the interpreter, and KernelConfig.pdl on (kernels None: its default and environment
    override)."""
    if t.device.type != "cuda" or not kernel_switch("pdl", kernels):
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _pdl_capable(index)


def pdl_kwargs(on: bool) -> dict[str, bool]:
    """Extra launch options for a kernel launched with USE_PDL=on (none when off: the
    interpreter does not know the option)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """First statement of every kernel: let the next kernel launch, then wait for the previous
    one (a no-op when USE_PDL is False or the kernel was launched without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def grouped_mm_tile(
    a_ptr, b_ptr, M, N, stride_am, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """This program's output tile of y = a @ b^T (a [M, K], b [N, K], K contiguous) on a 1-D
    grid in grouped order: GROUP_M consecutive M tiles sweep N together, so each weight tile is
    read from HBM about once per group (then from L2). Returns rows rm [BLOCK_M], columns rn
    [BLOCK_N], their masks, and the first K tile's pointers: a [BLOCK_M, BLOCK_K] and b
    [BLOCK_K, BLOCK_N] (advance both by BLOCK_K per K step)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + rn.to(tl.int64)[None, :] * stride_bn + rk[:, None]
    return rm, rn, rm < M, rn < N, a_ptrs, b_ptrs


@triton.jit
def _splitk_sum_kernel(
    ws_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl_prologue(USE_PDL)
    # y[i] = sum_s ws[s, i] over the fp32 partials [SPLIT, M * N]; fixed order: deterministic.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(ws_ptr + offs, mask=ok, other=0.0)
    for sp in tl.static_range(1, SPLIT):
        acc += tl.load(ws_ptr + sp * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


_SPLITK_SUM_BLOCK = 1024


def splitk_sum(ws: torch.Tensor, y: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """y (contiguous, any float dtype) = the sum over ws's leading axis of fp32 split-K partials
    ws [SPLIT, *y.shape], added in a fixed order (deterministic, no atomics). pdl: launch with
    programmatic dependent launch (`use_pdl`)."""
    mn = y.numel()
    _splitk_sum_kernel[(triton.cdiv(mn, _SPLITK_SUM_BLOCK),)](
        ws, y, mn, SPLIT=ws.shape[0], BLOCK=_SPLITK_SUM_BLOCK, USE_PDL=pdl, **pdl_kwargs(pdl)
    )
    return y


def auto_split_k(
    programs: int, steps: int, max_programs: int, min_steps: int, max_split: int
) -> int:
    """K slices for a tiled GEMM of `programs` output tiles and `steps` K steps: double (up to
    max_split) while the grid stays within max_programs and every slice keeps >= min_steps K
    steps (the pipeline's depth and the partial-sum pass both want long slices)."""
    split = 1
    while (
        split < max_split
        and programs * split * 2 <= max_programs
        and steps >= 2 * split * min_steps
    ):
        split *= 2
    return split


@triton.jit
def split_k_slice(
    a_ptrs, b_ptrs, y_ptr, K, K_SPLIT, stride_ys, SPLIT: tl.constexpr,
):  # fmt: skip
    """Split-K in a tiled GEMM (program_id(1) = the slice): this program's first k and end of K,
    its A / B tile pointers advanced to the first k, and y moved to its fp32 workspace plane
    (planes stride_ys elements apart). SPLIT False (constexpr): the whole K and the arguments
    unchanged, so an unsplit launch compiles as if there were no split-K."""
    if not SPLIT:
        return 0, K, a_ptrs, b_ptrs, y_ptr
    pid = tl.program_id(1)
    k_lo = pid * K_SPLIT
    k_end = tl.minimum(K, k_lo + K_SPLIT)
    return k_lo, k_end, a_ptrs + k_lo, b_ptrs + k_lo, y_ptr + pid.to(tl.int64) * stride_ys


def split_k_range(k: int, split: int, block_k: int) -> tuple[int, int]:
    """(K per slice, a multiple of block_k; slices) for split requested slices over K: fewer
    when rounding leaves a trailing slice empty."""
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return k_split, triton.cdiv(k, k_split)
