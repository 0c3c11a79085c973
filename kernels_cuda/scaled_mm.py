"""W8A8 matmuls (int8 and fp8 weights AND activations) in Triton, with torch references.

The path of a w8a8 linear at serving batch sizes (large M), where the tensor cores' int8 / fp8
rate (about twice bf16 on an H200) pays:

1. `quant_rows`: dynamic per-token activation quantization, one Triton kernel (absmax of the
   row and the cast fused; no separate torch ops): x [M, K] float -> (xq [M, K] int8 or
   float8_e4m3fn, xs float32 [M, 1]) with xs = max(|x[m]|, 1e-12) / QMAX (127 or 448) and
   xq = round(x / xs) (int8: half away from zero, clamped to +-127; fp8: the e4m3 cast, RTNE).
2. A scaled GEMM: y [M, N] = (xq @ wq^T) * xs[m] * ws[n] (+ bias), accumulated in int32 (int8)
   or fp32 (fp8), scales and bias applied once in the epilogue. Variants (KernelConfig):
     int8 (`int8_w8a8_gemm`): "int_mm" = torch._int_mm (cuBLASLt int8) + a Triton epilogue
       kernel (`scale_epilogue`); "triton" = `scaled_mm` (tl.dot int8 tiles, scales in its
       epilogue); "auto" = `AUTO_LIBRARY`'s pick for the M bucket (int_mm only where its shape
       rules hold: M > 16, K and N multiples of 8).
     fp8 (`fp8_gemm`): "scaled_mm" = torch._scaled_mm with row-wise scales (scale_a [M, 1],
       scale_b [1, N]; cuBLASLt's outer-vector-scaled fp8 kernel on sm_90 with torch 2.11);
       "triton" = `scaled_mm`; "auto" = `AUTO_LIBRARY`'s pick. Block-wise fp8 weights
       (DeepSeek-V3 / Qwen3-FP8 checkpoints: one scale per [WB_N, WB_K] weight block) always run
       `scaled_mm`, the block scale applied to each K tile's partial product inside the loop.
Weights: wq [N, K] int8 or float8_e4m3fn (uint8 bits accepted), ws float32 [N] (per channel) or
[ceil(N / WB_N), ceil(K / WB_K)] (block-wise).

Tiles are data (`SCALED_MM_TILES`, per M bucket, per format) and `DotTiles` overrides, so the
winner of `bench/quant_bench.py --gemm` on the target GPU can be written back here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from xlaserve.config import KernelConfig, kernel_switch
from xlaserve.kernels_cuda._common import (
    FLOAT_DTYPES,
    auto_split_k,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    grouped_mm_tile,
    interpret_mode,
    next_pow2,
    split_k_range,
    split_k_slice,
    splitk_sum,
)
from xlaserve.kernels_cuda.quant_act import QuantAct

INT8_MAX = 127.0
FP8_MAX = 448.0
QUANT_FORMATS = ("int8", "fp8")


class DotTiles(NamedTuple):
    """One tl.dot launch config. block_*: powers of two >= 16; group_m: M tiles that share a
    sweep over N (grouped launch order, so weight tiles stay in L2 while several M tiles use
    them); num_warps / num_stages: Triton launch options (stages: the software pipeline depth of
    the K loop's loads); split_k: K slices per output tile, summed in fp32 by a second pass (1:
    none; 0: auto, `scaled_mm_split_k`)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 0


# (max M, tiles) per format, the first bucket with M <= max M wins. The scheduler's M ranges:
# decode 1-8, mixed 16-256, prefill / large batch 512-16384. Starting points (the usual Hopper
# int8 / fp8 tl.dot shapes: 128 bytes of K per stage), to be re-tuned from
# `bench/quant_bench.py --gemm` on the H200.
_BIG = 1 << 62
SCALED_MM_TILES: dict[str, tuple[tuple[int, DotTiles], ...]] = {
    "int8": (
        (16, DotTiles(16, 64, 128, 1, 4, 4)),
        (64, DotTiles(64, 64, 128, 8, 4, 4)),
        (256, DotTiles(64, 128, 128, 8, 4, 4)),
        (_BIG, DotTiles(128, 128, 128, 8, 8, 3)),
    ),
    "fp8": (
        (16, DotTiles(16, 64, 128, 1, 4, 4)),
        (64, DotTiles(64, 64, 128, 8, 4, 4)),
        (256, DotTiles(64, 128, 128, 8, 4, 4)),
        (_BIG, DotTiles(128, 128, 128, 8, 8, 3)),
    ),
}


# Auto split-K of `scaled_mm` (the rule of `_common.auto_split_k`): at M = 256 the table's 64 x
# 128 tiles give `down` (K 14,336) and `o` 128 programs of 4 warps, about one per SM, through
# the whole K loop; two slices fill the second slot of each SM. Off (SCALED_MM_SPLIT_ENABLED)
# until a GPU has timed it (the twenty-second session's lease paused first); explicit
# `DotTiles.split_k` values always apply.
SCALED_MM_SPLIT_ENABLED = False
SCALED_MM_SPLIT_PROGRAMS = 256
SCALED_MM_SPLIT_MIN_STEPS = 8
SCALED_MM_MAX_SPLIT = 8


def scaled_mm_split_k(t: DotTiles, m: int, n: int, k: int, block_k: int) -> int:
    """K slices of an [m, k] x [n, k]^T `scaled_mm` with tiles t and K step block_k (the
    tile's, or less under block scales): t.split_k when set, else the auto rule when
    SCALED_MM_SPLIT_ENABLED (1 = no split)."""
    if t.split_k:
        return t.split_k
    if not SCALED_MM_SPLIT_ENABLED:
        return 1
    programs = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    return auto_split_k(
        programs,
        triton.cdiv(k, block_k),
        SCALED_MM_SPLIT_PROGRAMS,
        SCALED_MM_SPLIT_MIN_STEPS,
        SCALED_MM_MAX_SPLIT,
    )


def scaled_mm_tiles(fmt: str, m: int) -> DotTiles:
    """The default tiles of format fmt ("int8" / "fp8") for an M-row product."""
    if fmt not in SCALED_MM_TILES:
        raise ValueError(f"scaled_mm_tiles: format {fmt!r} not in {sorted(SCALED_MM_TILES)}")
    return next(t for max_m, t in SCALED_MM_TILES[fmt] if m <= max_m)


def check_dot_tiles(name: str, tiles: DotTiles | tuple) -> DotTiles:
    """A user override as DotTiles (3 to 7 values); ValueError when it cannot launch."""
    if not isinstance(tiles, tuple) or not 3 <= len(tiles) <= 7:
        raise ValueError(
            f"{name}: tiles must be (block_m, block_n, block_k[, group_m, num_warps, "
            f"num_stages, split_k]), got {tiles!r}"
        )
    t = DotTiles(*tiles)
    pow2 = all(isinstance(v, int) and v & (v - 1) == 0 and 16 <= v <= 256 for v in t[:3])
    ok_split = isinstance(t.split_k, int) and 0 <= t.split_k <= 64
    if not (
        pow2
        and t.group_m >= 1
        and t.num_warps in (1, 2, 4, 8, 16)
        and t.num_stages >= 1
        and ok_split
    ):
        raise ValueError(
            f"{name}: bad tiles {t}: block sizes powers of two in 16..256, group_m >= 1, "
            "num_warps in (1, 2, 4, 8, 16), num_stages >= 1, split_k in 0..64"
        )
    return t


# ---- references ----------------------------------------------------------------------------------


def _qmax(fmt: str) -> float:
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"format must be one of {QUANT_FORMATS}, got {fmt!r}")
    return INT8_MAX if fmt == "int8" else FP8_MAX


def quant_rows_ref(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization in torch: x [M, K] float -> (xq [M, K] int8 / float8_e4m3fn,
    xs float32 [M, 1]); the same roundings as the `quant_rows` kernel (int8: half away from
    zero; fp8: the RTNE e4m3 cast)."""
    qmax = _qmax(fmt)
    xf = x.float()
    xs = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / qmax
    v = xf / xs
    if fmt == "int8":
        q = torch.trunc(v + 0.5 * torch.sign(v)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        q = v.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, xs


def block_scale_shape(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    """[ceil(N / block_n), ceil(K / block_k)]: the weight_scale_inv shape of a block-wise fp8
    weight [N, K]."""
    return (-(-n // block[0]), -(-k // block[1]))


def dequant_w8(
    wq: torch.Tensor, ws: torch.Tensor, block: tuple[int, int] | None = None
) -> torch.Tensor:
    """wq [N, K] (int8, float8_e4m3fn or its uint8 bits) and its scales -> W float32 [N, K].
    ws: [N] per channel, or the block scales of `block` = (block_n, block_k)."""
    w = (wq.view(torch.float8_e4m3fn) if wq.dtype == torch.uint8 else wq).float()
    n, k = w.shape
    if block is None:
        return w * ws.float().reshape(-1)[:, None]
    s = ws.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return w * s


def w8a8_matmul_ref(
    x: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    fmt: str,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    math: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The w8a8 math: x [M, K] quantized per token (`quant_rows_ref`), times wq [N, K] with
    scales ws (see `dequant_w8`) -> [M, N] x.dtype. math float64 (default): exact products and
    sums of the codes (the kernels' reference); float32: the CPU serving emulation of block
    fp8, the same operations as the XLA backend's `fp8_block_matmul`."""
    xq, xs = quant_rows_ref(x, fmt)
    if block is None:
        w = (wq.view(torch.float8_e4m3fn) if wq.dtype == torch.uint8 else wq).to(math)
        y = (xq.to(math) @ w.t()) * ws.to(math).reshape(-1)[None, :]
    else:
        y = xq.to(math) @ dequant_w8(wq, ws, block).to(math).t()
    y = y * xs.to(math)
    if bias is not None:
        y = y + bias.to(math)
    return y.to(x.dtype)


# ---- kernels -------------------------------------------------------------------------------------


@triton.jit
def _round_half_away(v):
    # trunc(v + 0.5 * sign(v)): the int8 rounding of quant_rows_ref
    return tl.where(v >= 0, v + 0.5, v - 0.5).to(tl.int32)


@triton.jit
def _to_fp8(v, q_dtype, RNE_FIX: tl.constexpr):
    # v f32 already clamped to +-448 -> e4m3. RNE_FIX (the CPU interpreter only: its f32 -> fp8
    # cast drops the carry of a round-up into the exponent, 124.3 -> 64): round the f32 to 3
    # mantissa bits first (round half to even on the bits), which the cast then keeps.
    if RNE_FIX:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576  # -1048576 = ~0xFFFFF
        v = b.to(tl.float32, bitcast=True)
    return v.to(q_dtype)


@triton.jit
def _quant_rows_kernel(
    x_ptr, q_ptr, s_ptr,
    K, stride_xm, stride_qm,
    QMAX: tl.constexpr, INT8: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
    RNE_FIX: tl.constexpr,
):  # fmt: skip
    # One program per row. ONE_TILE (K <= BLOCK_K): the row is read once, kept in registers for
    # the absmax and the cast; otherwise a max pass then a cast pass (the re-read hits L2).
    row = tl.program_id(0).to(tl.int64)
    xr = x_ptr + row * stride_xm
    qr = q_ptr + row * stride_qm
    rk = tl.arange(0, BLOCK_K)
    if ONE_TILE:
        x = tl.load(xr + rk, mask=rk < K, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
    else:
        run = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            v = tl.load(xr + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            run = tl.maximum(run, tl.abs(v))
        amax = tl.max(run, axis=0)
    s = tl.maximum(amax, 1e-12) / QMAX
    tl.store(s_ptr + row, s)
    if ONE_TILE:
        v = x / s
        if INT8:
            q = tl.minimum(tl.maximum(_round_half_away(v), -127), 127).to(tl.int8)
        else:
            q = _to_fp8(tl.minimum(tl.maximum(v, -QMAX), QMAX), q_ptr.dtype.element_ty, RNE_FIX)
        tl.store(qr + rk, q, mask=rk < K)
    else:
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            v = tl.load(xr + kk, mask=kk < K, other=0.0).to(tl.float32) / s
            if INT8:
                q = tl.minimum(tl.maximum(_round_half_away(v), -127), 127).to(tl.int8)
            else:
                q = _to_fp8(tl.minimum(tl.maximum(v, -QMAX), QMAX), q_ptr.dtype.element_ty, RNE_FIX)
            tl.store(qr + kk, q, mask=kk < K)


# Rows up to this K are quantized from registers in one read (ONE_TILE).
QUANT_ONE_TILE_MAX_K = 8192


def quant_rows(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton per-token quantization: x [M, K] float (last dim contiguous) -> (xq [M, K] int8
    or float8_e4m3fn, xs float32 [M, 1]); see `quant_rows_ref` for the math."""
    qmax = _qmax(fmt)
    check_device("quant_rows", x)
    check_dtype("quant_rows x", x, FLOAT_DTYPES)
    if x.dim() != 2:
        raise ValueError(f"quant_rows: x must be [M, K], got {tuple(x.shape)}")
    check_last_dim_contiguous("quant_rows x", x)
    m, k = x.shape
    qdt = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    xq = torch.empty((m, k), dtype=qdt, device=x.device)
    xs = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return xq, xs.fill_(1e-12 / qmax)
    one = k <= QUANT_ONE_TILE_MAX_K
    block = next_pow2(k) if one else 2048
    _quant_rows_kernel[(m,)](
        x, xq, xs, k, x.stride(0), xq.stride(0),
        QMAX=qmax, INT8=fmt == "int8", BLOCK_K=block, ONE_TILE=one, RNE_FIX=interpret_mode(),
        num_warps=8 if block >= 4096 else 4,
    )  # fmt: skip
    return xq, xs


@triton.jit
def _scaled_mm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, y_ptr,
    M, N, K, K_SPLIT,
    stride_am, stride_bn, stride_bsn, stride_ys, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INT_ACC: tl.constexpr, WB_N: tl.constexpr, WB_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    FP8_BITS: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr = False,
):  # fmt: skip
    # Split-K (SPLIT): program_id(1) owns K range [pid * K_SPLIT, +K_SPLIT) (a multiple of
    # BLOCK_K, so block scales still see whole tiles) and writes its scaled fp32 partial to that
    # plane of y (a workspace [SPLIT, M, N], planes stride_ys apart); slice 0 adds the bias.
    # y = (a @ b^T) * as[m] * bs (+ bias): a [M, K], b [N, K] (8-bit codes), as [M] f32.
    # WB_K == 0: bs [N] per channel, applied in the epilogue to an int32 (INT_ACC) or fp32
    # accumulator. WB_K > 0: bs [ceil(N / WB_N), ceil(K / WB_K)] block scales; BLOCK_K divides
    # WB_K, so each K tile lies in one weight block and its partial product is scaled before it
    # is added (the DeepSeek-V3 block-fp8 GEMM).
    rm, rn, m_ok, n_ok, a_ptrs, b_ptrs = grouped_mm_tile(
        a_ptr, b_ptr, M, N, stride_am, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M
    )
    rk = tl.arange(0, BLOCK_K)
    if INT_ACC:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo, k_end, a_ptrs, b_ptrs, y_ptr = split_k_slice(
        a_ptrs, b_ptrs, y_ptr, K, K_SPLIT, stride_ys, SPLIT
    )
    for k0 in range(k_lo, k_end, BLOCK_K):
        k_ok = k0 + rk < K
        # (0.0: a constant the loads' element type takes, fp8 included; +0.0 is the 0 code.)
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8_BITS:  # the interpreter's fp8 arrives as uint8 bits (numpy has no fp8)
            a = a.to(tl.float8e4nv, bitcast=True)
            b = b.to(tl.float8e4nv, bitcast=True)
        if UPCAST:  # the CPU interpreter (numpy) has no int8 / fp8 dot
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if WB_K > 0:
            bsk = tl.load(bs_ptr + (rn // WB_N) * stride_bsn + k0 // WB_K, mask=n_ok, other=0.0)
            acc += tl.dot(a, b, out_dtype=tl.float32) * bsk[None, :]
        elif INT_ACC:
            acc += tl.dot(a, b, out_dtype=tl.int32)
        else:
            acc += tl.dot(a, b, out_dtype=tl.float32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out = acc.to(tl.float32) * tl.load(as_ptr + rm, mask=m_ok, other=0.0)[:, None]
    if WB_K == 0:
        out = out * tl.load(bs_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        if SPLIT:  # slice 0 adds it
            bias = tl.where(tl.program_id(1) == 0, bias, 0.0)
        out += bias[None, :]
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def kernel_operands(
    xq: torch.Tensor, wq: torch.Tensor, interp: bool
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """`_scaled_mm_kernel`'s a / b operands and its FP8_BITS flag. On a GPU fp8 goes in typed: a
    uint8 load bitcast to fp8 in the loop made Triton copy each tile shared memory -> registers
    -> shared memory before wgmma (sm_90 PTX, tests/kernels_cuda/test_quant_gemm_sm90_build.py);
    typed, the loop is int8's. The interpreter (numpy has no fp8) takes the uint8 bits."""
    if xq.dtype == torch.int8 or not interp:
        return xq, wq, False
    return xq.view(torch.uint8), wq.view(torch.uint8), True


@triton.jit
def _scale_epilogue_kernel(
    acc_ptr, as_ptr, bs_ptr, bias_ptr, y_ptr,
    M, N, stride_am, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    # y = acc * as[m] * bs[n] (+ bias[n]): the epilogue of torch._int_mm's int32 result.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    ok = m_ok[:, None] & n_ok[None, :]
    acc = tl.load(acc_ptr + rm.to(tl.int64)[:, None] * stride_am + rn[None, :], mask=ok, other=0)
    out = acc.to(tl.float32) * tl.load(as_ptr + rm, mask=m_ok, other=0.0)[:, None]
    out = out * tl.load(bs_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
             out.to(y_ptr.dtype.element_ty), mask=ok)  # fmt: skip


# ---- wrappers ------------------------------------------------------------------------------------


def _check_w8(
    name: str, xq: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, block: tuple[int, int] | None
) -> None:
    if xq.dim() != 2 or wq.dim() != 2 or xq.shape[1] != wq.shape[1]:
        raise ValueError(
            f"{name}: x {tuple(xq.shape)} and w {tuple(wq.shape)} must be [M, K], [N, K]"
        )
    check_last_dim_contiguous(f"{name} x", xq)
    check_last_dim_contiguous(f"{name} w", wq)
    n, k = wq.shape
    want = (n,) if block is None else block_scale_shape(n, k, block)
    if tuple(ws.reshape(-1).shape if block is None else ws.shape) != want:
        raise ValueError(f"{name}: weight scales must be {list(want)}, got {tuple(ws.shape)}")


def scale_epilogue(
    acc: torch.Tensor,
    xs: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """acc int32 [M, N] (torch._int_mm's result) -> acc * xs[m] * ws[n] (+ bias) in out_dtype.
    out: where to write (out_dtype); may be acc itself (each element is read and written by
    one program), as quant_gemm_sweep's tensor-wise fp8 row does with a bf16 acc."""
    m, n = acc.shape
    y = torch.empty((m, n), dtype=out_dtype, device=acc.device) if out is None else out
    if m == 0 or n == 0:
        return y
    grid = (triton.cdiv(m, 32), triton.cdiv(n, 128))
    _scale_epilogue_kernel[grid](
        acc, xs, ws, bias if bias is not None else ws, y, m, n, acc.stride(0), y.stride(0),
        BLOCK_M=32, BLOCK_N=128, HAS_BIAS=bias is not None,
    )  # fmt: skip
    return y


def scaled_mm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    tiles: DotTiles | tuple | None = None,
) -> torch.Tensor:
    """The Triton scaled GEMM: xq [M, K] int8 / float8_e4m3fn with per-token xs [M, 1] float32,
    wq [N, K] of the same kind (fp8 may come as uint8 bits), ws float32 [N] or block scales
    (`block` = (WB_N, WB_K)) -> y [M, N] out_dtype. tiles: a `DotTiles` override."""
    check_device("scaled_mm", xq, xs, wq, ws)
    int8 = xq.dtype == torch.int8
    if wq.dtype == torch.uint8:
        wq = wq.view(torch.float8_e4m3fn)
    if xq.dtype not in (torch.int8, torch.float8_e4m3fn) or wq.dtype != xq.dtype:
        raise ValueError(f"scaled_mm: x {xq.dtype} and w {wq.dtype} must both be int8 or fp8")
    _check_w8("scaled_mm", xq, wq, ws, block)
    if block is not None and int8:
        raise ValueError("scaled_mm: block scales are an fp8 format")
    m, k = xq.shape
    n = wq.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return y
    fmt = "int8" if int8 else "fp8"
    t = check_dot_tiles("scaled_mm", tiles) if tiles is not None else scaled_mm_tiles(fmt, m)
    wb_n = wb_k = 0
    bk = t.block_k
    if block is not None:
        wb_n, wb_k = block
        while bk > 16 and wb_k % bk:
            bk //= 2
        if wb_k % bk:
            raise ValueError(f"scaled_mm: weight block K {wb_k} has no power-of-two divisor >= 16")
    k_split, split = split_k_range(k, scaled_mm_split_k(t, m, n, k, bk), bk)
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=y.device)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), split)
    interp = interpret_mode()
    xq, wq, fp8_bits = kernel_operands(xq, wq, interp)
    _scaled_mm_kernel[grid](
        xq, wq, xs, ws, bias if bias is not None else ws, out, m, n, k, k_split,
        xq.stride(0), wq.stride(0), ws.stride(0) if block is not None else 0,
        0 if split == 1 else m * n, n,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=bk, GROUP_M=t.group_m,
        INT_ACC=int8 and not interp, WB_N=wb_n, WB_K=wb_k, HAS_BIAS=bias is not None,
        FP8_BITS=fp8_bits, UPCAST=interp, SPLIT=split > 1,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    if split > 1:
        splitk_sum(out, y)
    return y


def _choice(name: str, kernels: KernelConfig | None, allowed: tuple[str, ...]) -> str:
    v = kernel_switch(name, kernels)
    if v not in allowed:
        raise ValueError(f"KernelConfig.{name} must be one of {allowed}, got {v!r}")
    return v


def _quant(x: torch.Tensor | QuantAct, fmt: str, kernels: KernelConfig | None) -> tuple:
    """Per-token quantization: the Triton kernel unless KernelConfig.act_quant is "torch"; a
    `QuantAct` is taken as is (its format must be fmt)."""
    if isinstance(x, QuantAct):
        if x.fmt != fmt or x.q.dim() != 2 or x.scale.shape != (x.q.shape[0], 1):
            raise ValueError(
                f"expected a {fmt} QuantAct with q [M, K] and scale [M, 1], got {x.fmt} "
                f"q {tuple(x.q.shape)} scale {tuple(x.scale.shape)}"
            )
        return x.q, x.scale
    if _choice("act_quant", kernels, ("auto", "triton", "torch")) == "torch":
        return quant_rows_ref(x, fmt)
    return quant_rows(x, fmt)


# KernelConfig int8_w8a8_gemm / fp8_gemm "auto": per M bucket (max M, True = the library GEMM
# (cuBLASLt: torch._int_mm + `scale_epilogue` / torch._scaled_mm), False = the Triton
# `scaled_mm`), the first bucket with M <= max M wins. Picked from
# `bench/gpu_probes/quant_gemm_sweep.py --ms 16 256 4096` (H100, 2026-12-05, eighteenth session;
# time summed over the four Llama-3.1-8B linears, x bf16 cuBLAS): int8 Triton 1.133x / 1.370x
# at M = 256 / 4096 against cuBLASLt's 0.849x / 0.928x (its int32 output is one more [M, N]
# write and read, which the Triton GEMM's fused epilogue does not pay; M <= 16 cannot take
# `_int_mm`); fp8 Triton 1.288x against `_scaled_mm`'s 1.176x at M = 16, `_scaled_mm` 1.378x /
# 1.388x against Triton's 0.758x / 0.761x at M = 256 / 4096. Re-swept with the fp8 operands
# typed (`kernel_operands`; `quant_gemm_sweep.py --families fp8 --ms 16 256 4096`, H100,
# 2026-12-05, nineteenth session): Triton 1.301x / 1.039x / 1.001x against `_scaled_mm`'s
# 1.193x / 1.357x / 1.511x at M = 16 / 256 / 4096, so the fp8 buckets stay.
AUTO_LIBRARY: dict[str, tuple[tuple[int, bool], ...]] = {
    "int8": ((_BIG, False),),
    "fp8": ((16, False), (_BIG, True)),
}


def auto_library(fmt: str, m: int) -> bool:
    """Whether "auto" runs an M-row product of format fmt through the library GEMM."""
    return next(lib for max_m, lib in AUTO_LIBRARY[fmt] if m <= max_m)


def int_mm_ok(m: int, n: int, k: int) -> bool:
    """torch._int_mm's (cuBLASLt int8) shape rules on CUDA: M > 16, K and N multiples of 8."""
    return m > 16 and k % 8 == 0 and n % 8 == 0


def int8_w8a8_matmul(
    x: torch.Tensor | QuantAct,
    wq: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    kernels: KernelConfig | None = None,
    tiles: DotTiles | tuple | None = None,
) -> torch.Tensor:
    """int8 w8a8 on CUDA (or the interpreter): x [M, K] float -> y [M, N] x.dtype, per-token
    int8 activations (`quant_rows`), wq int8 [N, K], ws float32 [N]. The GEMM is
    KernelConfig.int8_w8a8_gemm (module docstring); tiles forces the Triton GEMM. x may be an
    int8 `QuantAct` (already quantized by its producer)."""
    check_dtype("int8_w8a8_matmul w", wq, (torch.int8,))
    xq, xs = _quant(x, "int8", kernels)  # x.dtype below: a QuantAct carries its float dtype
    m, k = xq.shape
    n = wq.shape[0]
    how = _choice("int8_w8a8_gemm", kernels, ("auto", "int_mm", "triton"))
    lib = how == "int_mm" or (how == "auto" and auto_library("int8", m))
    if tiles is None and lib and xq.is_cuda and int_mm_ok(m, n, k):
        _check_w8("int8_w8a8_matmul", xq, wq, ws, None)
        acc = torch._int_mm(xq, wq.t())
        return scale_epilogue(acc, xs, ws.reshape(-1), bias, x.dtype)
    return scaled_mm(xq, xs, wq, ws.reshape(-1), x.dtype, bias, None, tiles)


def fp8_w8a8_matmul(
    x: torch.Tensor | QuantAct,
    wq: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block: tuple[int, int] | None = None,
    kernels: KernelConfig | None = None,
    tiles: DotTiles | tuple | None = None,
) -> torch.Tensor:
    """fp8 w8a8 on CUDA cc >= 8.9 (or the interpreter): x [M, K] float -> y [M, N] x.dtype with
    per-token fp8 activations (`quant_rows`), wq float8_e4m3fn [N, K] (or its uint8 bits), ws
    float32 [N] or block scales (`block`). The GEMM is KernelConfig.fp8_gemm (module
    docstring); block scales and a tiles override take the Triton GEMM. x may be a fp8
    `QuantAct` (already quantized by its producer)."""
    xq, xs = _quant(x, "fp8", kernels)
    m, k = xq.shape
    n = wq.shape[0]
    how = _choice("fp8_gemm", kernels, ("auto", "scaled_mm", "triton"))
    lib = how == "scaled_mm" or (how == "auto" and auto_library("fp8", m))
    if block is None and tiles is None and lib and xq.is_cuda:
        w8 = wq.view(torch.float8_e4m3fn) if wq.dtype == torch.uint8 else wq
        _check_w8("fp8_w8a8_matmul", xq, w8, ws, None)
        if k % 16 == 0 and n % 16 == 0:
            pad = (-m) % 16  # cuBLASLt fp8 wants every dim a multiple of 16
            if pad:
                xq = torch.nn.functional.pad(xq.view(torch.uint8), (0, 0, 0, pad))
                xq = xq.view(torch.float8_e4m3fn)
                xs = torch.nn.functional.pad(xs, (0, 0, 0, pad), value=1.0)
            y = torch._scaled_mm(
                xq, w8.t(), scale_a=xs, scale_b=ws.float().reshape(1, -1), bias=None,
                out_dtype=torch.bfloat16,  # row-wise scaling: bf16 output only (cuBLASLt)
            )  # fmt: skip
            y = y[:m]
            if bias is not None:
                y = y + bias.to(y.dtype)
            return y.to(x.dtype)
    return scaled_mm(xq, xs, wq, ws if block is not None else ws.reshape(-1), x.dtype, bias,
                     block, tiles)  # fmt: skip
