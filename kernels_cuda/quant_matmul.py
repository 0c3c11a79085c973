"""Weight-only quantized matmuls (int8 per-channel, int4 group-wise) in Triton, with torch
references. The weight is dequantized tile by tile in registers, so HBM traffic is the packed
weight: the bound that matters for decode (small M).

Layouts are the canonical ones of `xlaserve.quantization.numpy_quant`:
    int8: qweight int8 [N, K], scales [N]                 y = (x @ q^T) * s
    int4: qweight uint8 [N, K/2] (group half-split), scales [N, G], zeros uint8 [N, G]
          y[m, n] = sum_t s[n, t] * sum_{k in group t} x[m, k] * (q[n, k] - z[n, t])
    fp8:  qweight uint8 [N, K] (float8_e4m3fn bits), scales [N]   y = (x @ fp8(q)^T) * s
x: [M, K] float16/bfloat16/float32 -> y: [M, N] x.dtype (fp32 accumulation).

Two kernel families:
  * GEMV (small M, decode; `use_gemv`): no tl.dot. Each program owns BLOCK_N output channels and one
    of SPLIT_K slices of K; it streams wide contiguous rows of the packed weight (BLOCK_K k's per
    step), multiply-accumulates elementwise in fp32 and reduces over K once at the end (M == 1)
    or once per step (M > 1, one reduction per row of x, sharing the dequantized tile; int4:
    per group chunk, then scaled). Many small programs keep enough loads in flight to run at
    HBM bandwidth. SPLIT_K > 1 writes fp32 partials to a workspace that a second small kernel
    sums (deterministic, no atomics).
  * tl.dot tiles (larger M, prefill): int8 / int4 only; fp8 there goes through torch.
Tile parameters are data (GEMV_TILES, TILES) so they can be re-tuned from GPU measurements
(`python -m xlaserve.bench.kernels.cuda_kernels --only qgemv`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from xlaserve.config import KernelConfig
from xlaserve.kernels_cuda._common import (
    FLOAT_DTYPES,
    auto_split_k,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    grouped_mm_tile,
    interpret_mode,
    next_pow2,
    pdl_kwargs,
    pdl_prologue,
    split_k_range,
    split_k_slice,
    splitk_sum,
    upcast_dot,
    use_pdl,
)

# Tile sizes as data: (BLOCK_M, BLOCK_N, BLOCK_K) by M bucket. Decode (M <= 16) wants tall N
# tiles; prefill wants square ones. BLOCK_K of int4 is further capped by the group size.
TILES: dict[str, tuple[int, int, int]] = {
    "decode": (16, 64, 64),
    "prefill": (64, 64, 64),
}


def _tiles(m: int) -> tuple[int, int, int]:
    return TILES["decode"] if m <= 16 else TILES["prefill"]


# int8 weight-only tl.dot (M above the GEMV): `Int8DotTiles` per M bucket (the scheduler's 16-256
# mixed steps and 512-16384 prefill / large-batch steps), the first with M <= max M wins. The
# int8 -> bf16 weight conversion sits in the K loop. swap_ab computes y^T = W x^T
# (`_int8_mm_kernel`'s SWAP_AB): on Hopper wgmma then takes the converted weight from registers,
# where the plain order stores it back to shared memory first (its sm_90 PTX: st.shared and
# ldmatrix in the K loop, both operands as smem descriptors), and the tokens sit on the dot's N
# side, so M = 16 fills an m64n16 instruction instead of a quarter of an m64 one. Big tiles
# (many rows of x per converted weight tile), a grouped launch order (weight tiles reused from
# L2) and a pipelined K loop (num_stages) decide large-M speed; the old (64, 64, 64) tile with 4
# warps and no grouping measured 0.44x bf16 offline (H200). `quant_gemm_sweep.py --ms 16 256 4096`
# (H100, 2026-12-05, eighteenth session; summed over the four 8B linears): M = 256 takes
# (128, 128, 64, 8 warps), 1.25x the old (64, 128, 128) pick's speed (0.488x vs 0.390x bf16;
# swapped 0.486x); at M = 4096 swap_ab with 256-row tiles ties the plain table (0.590x vs
# 0.587x), so the plain order stays; M = 16 keeps its tile (1.276x bf16, swapped 1.129x).
# Converting in the K loop costs ~40% at large M against bf16 either way. The warp-level
# mma.sync (Triton's DISABLE_MMA_V3 at compile time; the weight is then converted in registers
# and never stored back) was slower still on the H200 (2026-12-05, twenty-second session, same
# sweep; tried and removed): 0.36x bf16 at M = 256 and 0.43x at 4096 with its best tiles,
# against this table's 0.42x and 0.61x.
class Int8DotTiles(NamedTuple):
    """One launch of the int8 weight-only tl.dot kernel. block_m: rows of x (tokens), block_n:
    weight rows, block_k: the K step (powers of two >= 16); group_m: tiles that share a sweep
    (grouped launch order); swap_ab: y^T = W x^T (see above); split_k: K slices per output
    tile, summed in fp32 by a second pass (1: none; 0: auto, `dot_split_k`)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    split_k: int = 0


INT8_DOT_TILES: tuple[tuple[int, Int8DotTiles], ...] = (
    (16, Int8DotTiles(16, 64, 128, 1, 4, 4)),
    (64, Int8DotTiles(64, 64, 128, 8, 4, 4)),
    (256, Int8DotTiles(128, 128, 64, 8, 8, 4)),
    (1 << 62, Int8DotTiles(128, 128, 64, 8, 8, 4)),
)


def int8_dot_tiles(m: int) -> Int8DotTiles:
    """The default tiles of the int8 weight-only tl.dot kernel for an M-row product."""
    return next(t for max_m, t in INT8_DOT_TILES if m <= max_m)


# Auto split-K of the tl.dot kernel: double the K slices (up to DOT_MAX_SPLIT) while the grid
# stays within DOT_SPLIT_PROGRAMS (two 8-warp programs per SM on a 132-SM H100 / H200) and every
# slice keeps >= DOT_SPLIT_MIN_STEPS K steps for the pipeline. Why: at M = 256 the table's 128 x
# 128 tiles give `down` (N 4096, K 14,336) and `o` 64 programs, half the SMs idle through a long
# K loop: 0.26x / 0.36x of bf16 against 0.64x for `gate_up` (448 programs; H200 sweep, bench/
# RESULTS.md twenty-second session). The fp32 partials cost M * N * 4 bytes per slice, twice.
# Off (DOT_SPLIT_ENABLED) until a GPU has timed it: the device lease paused before its A/B
# (tools/device/next_lease.sh part 4); explicit `Int8DotTiles.split_k` values always apply.
DOT_SPLIT_ENABLED = False
DOT_SPLIT_PROGRAMS = 256
DOT_SPLIT_MIN_STEPS = 8
DOT_MAX_SPLIT = 8


def dot_split_k(t: Int8DotTiles, m: int, n: int, k: int) -> int:
    """K slices of an [m, k] x [n, k]^T product with tiles t: t.split_k when set, else the
    auto rule above when DOT_SPLIT_ENABLED (1 = no split)."""
    if t.split_k:
        return t.split_k
    if not DOT_SPLIT_ENABLED:
        return 1
    programs = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    steps = triton.cdiv(k, t.block_k)
    return auto_split_k(programs, steps, DOT_SPLIT_PROGRAMS, DOT_SPLIT_MIN_STEPS, DOT_MAX_SPLIT)


# GEMV path (decode): possible for 1 <= M <= GEMV_MAX_M. Larger M has enough rows per weight tile
# for tl.dot to pay off (and an [M, BLOCK_N] accumulator per program stops being small).
GEMV_MAX_M = 8


class GemvTiles(NamedTuple):
    """One GEMV launch config (a plain 4- or 5-tuple in this order works too).

    block_n: output channels per program (power of two). block_k: k's per step (power of two,
    >= 16; int4 reads block_k / 2 bytes per row per step). split_k: programs along K (>= 1; 0 =
    pick from the shape, see `gemv_tiles`). num_warps: 1, 2, 4, 8 or 16. bit_cvt: int8 / int4
    codes become floats by exponent-bit tricks (integer ops + one fadd, exact) instead of
    int->float cvt instructions, which issue at a fraction of the FMA rate; fp8 ignores it (it
    uses the hardware fp8 conversion).
    """

    block_n: int
    block_k: int
    split_k: int = 0
    num_warps: int = 4
    bit_cvt: bool = True


# Per format: (max M, tiles) buckets, the first with M <= max M wins. Starting points from the
# sm_90 SASS (no shared-memory round trips or barriers in the K loop, no spills), to be re-tuned
# from `cuda_kernels --only qgemv` on the target GPU. M == 1: BLOCK_K (int4: BLOCK_K / 2 bytes)
# >= 8 * 32 * num_warps puts all warps along K, x loads once per thread and rows are register
# repeats. M > 1: one warp-row of 256 k's (int8 / fp8) keeps each step's reduction in a warp.
# Measured on the H200 (2026-12-03, bench/RESULTS.md): M == 1 fp8 takes (4, 1024) (best on all
# four Llama-8B shapes), int4 M 2..4 (8, 1024) (best on three of four).
GEMV_TILES: dict[str, tuple[tuple[int, GemvTiles], ...]] = {
    "int8": ((1, GemvTiles(8, 1024)), (GEMV_MAX_M, GemvTiles(8, 256))),
    "int4": ((1, GemvTiles(8, 2048)), (4, GemvTiles(8, 1024)), (GEMV_MAX_M, GemvTiles(4, 512))),
    "fp8": ((1, GemvTiles(4, 1024)), (GEMV_MAX_M, GemvTiles(8, 256))),
}
# Largest M whose default path is the GEMV (a `GemvTiles` override forces it up to GEMV_MAX_M).
# Measured on the H200, summed over the four Llama-8B linears of a layer with the default tiles:
# at M = 4 the int8 / fp8 GEMVs take 243 / 233 us against 202 / 214 us for the tl.dot kernel /
# _scaled_mm (they lose on gate_up, the largest), the int4 GEMV 216 against 294 us; at M = 1
# every GEMV wins on every shape (1.3-5.2x over the previous paths).
GEMV_DEFAULT_MAX_M: dict[str, int] = {"int8": 1, "int4": 4, "fp8": 1}


def use_gemv(fmt: str, m: int, tiles: GemvTiles | tuple | None = None) -> bool:
    """Whether an M-row matmul of format fmt takes the GEMV: the default up to
    GEMV_DEFAULT_MAX_M[fmt]; with a tiles override, iff it is a GEMV config (4 or 5 values, not
    an `Int8DotTiles`) and M <= GEMV_MAX_M."""
    if not 1 <= m <= GEMV_MAX_M:
        return False
    if tiles is not None:
        return len(tiles) >= 4 and not isinstance(tiles, Int8DotTiles)
    return m <= GEMV_DEFAULT_MAX_M[fmt]


# Auto split_k: double it (up to GEMV_MAX_SPLIT) while there are fewer than GEMV_MIN_PROGRAMS
# programs (2 per SM on an H200: fewer leave too few loads in flight to saturate HBM) and every
# K slice keeps at least GEMV_MIN_SPLIT_STEPS steps (the partial-sum pass costs a launch).
GEMV_MIN_PROGRAMS = 264
GEMV_MIN_SPLIT_STEPS = 4
GEMV_MAX_SPLIT = 8


def _resolve_split(tiles: GemvTiles, n: int, k: int) -> GemvTiles:
    """tiles with split_k 0 (auto) replaced by a count picked from the shape."""
    if tiles.split_k:
        return tiles
    programs = triton.cdiv(n, tiles.block_n)
    steps = triton.cdiv(k, tiles.block_k)
    split = 1
    while (
        split < GEMV_MAX_SPLIT
        and programs * split < GEMV_MIN_PROGRAMS
        and steps >= 2 * split * GEMV_MIN_SPLIT_STEPS
    ):
        split *= 2
    return tiles._replace(split_k=split)


def gemv_tiles(fmt: str, m: int, n: int, k: int) -> GemvTiles:
    """The default GEMV config of format fmt ("int8" / "int4" / "fp8") for x [m, k] and a
    weight of n output channels (1 <= m <= GEMV_MAX_M), split_k resolved (>= 1)."""
    if fmt not in GEMV_TILES:
        raise ValueError(f"gemv_tiles: format {fmt!r} not in {sorted(GEMV_TILES)}")
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"gemv_tiles: M={m} outside the GEMV range 1..{GEMV_MAX_M}")
    tiles = next(t for max_m, t in GEMV_TILES[fmt] if m <= max_m)
    return _resolve_split(tiles, n, k)


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _check_gemv_tiles(name: str, tiles: GemvTiles | tuple) -> GemvTiles:
    """A user tiles override as GemvTiles; ValueError when it cannot launch."""
    if not isinstance(tiles, tuple) or len(tiles) not in (4, 5):
        raise ValueError(
            f"{name}: GEMV tiles must be (block_n, block_k, split_k, num_warps[, bit_cvt]), "
            f"got {tiles!r}"
        )
    t = GemvTiles(*tiles)
    ok = (
        _is_pow2(t.block_n)
        and t.block_n <= 256
        and _is_pow2(t.block_k)
        and 16 <= t.block_k <= 8192
        and 0 <= t.split_k <= 64
        and t.num_warps in (1, 2, 4, 8, 16)
    )
    if not ok:
        raise ValueError(
            f"{name}: bad GEMV tiles {t}: block_n a power of two <= 256, block_k a power of two "
            "in 16..8192, split_k in 0..64, num_warps in (1, 2, 4, 8, 16)"
        )
    return t


def _check_dot_tiles(name: str, tiles: tuple, extra: bool = False) -> tuple[int, ...]:
    """A user (BLOCK_M, BLOCK_N, BLOCK_K) override of the tl.dot path (extra: optionally
    followed by group_m, num_warps, num_stages, swap_ab, split_k: the int8 kernel's
    `Int8DotTiles`); ValueError when bad."""
    n_ok = 3 <= len(tiles) <= 8 if extra and isinstance(tiles, tuple) else len(tiles) == 3
    if (
        not isinstance(tiles, tuple)
        or not n_ok
        or not all(isinstance(v, int) and _is_pow2(v) and 16 <= v <= 256 for v in tiles[:3])
        or not all(isinstance(v, int) and v >= 1 for v in tiles[3:6])
        or not all(isinstance(v, bool) or v in (0, 1) for v in tiles[6:7])
        or not all(isinstance(v, int) and 0 <= v <= 64 for v in tiles[7:])
    ):
        raise ValueError(
            f"{name}: tl.dot tiles (M > {GEMV_MAX_M}) must be (BLOCK_M, BLOCK_N, BLOCK_K"
            f"{'[, group_m, num_warps, num_stages, swap_ab, split_k 0..64]' if extra else ''}), "
            f"powers of two in 16..256, got {tiles!r}"
        )
    return tiles


# ---- references ----------------------------------------------------------------------------------


def int8_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K], qweight int8 [N, K], scales [N] -> [M, N] x.dtype (fp32 math)."""
    y = x.float() @ qweight.float().t()
    return (y * scales.float()[None, :]).to(x.dtype)


def unpack_int4_torch(qweight: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 [N, K/2] (group half-split) -> uint8 [N, K] values 0..15."""
    n, k2 = qweight.shape
    h = group // 2
    p = qweight.view(n, (2 * k2) // group, h)
    return torch.stack([p & 0xF, p >> 4], dim=2).reshape(n, 2 * k2)


def dequant_int4_torch(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(uint8 [N, K/2], scales [N, G], zeros [N, G]) -> W [N, K] in `dtype`."""
    n, k2 = qweight.shape
    k = 2 * k2
    g = k // scales.shape[1]
    q = unpack_int4_torch(qweight, g).view(n, k // g, g).to(torch.float32)
    w = (q - zeros.to(torch.float32)[:, :, None]) * scales.to(torch.float32)[:, :, None]
    return w.view(n, k).to(dtype)


def int4_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """x [M, K] -> [M, N] x.dtype (fp32 math)."""
    w = dequant_int4_torch(qweight, scales, zeros, torch.float32)
    return (x.float() @ w.t()).to(x.dtype)


def dequant_fp8_torch(
    qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(uint8 [N, K] float8_e4m3fn bits, scales [N]) -> W [N, K] = fp8 value * scale in `dtype`."""
    w = qweight.view(torch.float8_e4m3fn).to(torch.float32) * scales.to(torch.float32)[:, None]
    return w.to(dtype)


def fp8_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Weight-only fp8: x [M, K], qweight uint8 [N, K] (float8_e4m3fn bits), scales [N] ->
    [M, N] x.dtype (fp32 math; x is not quantized)."""
    return (x.float() @ dequant_fp8_torch(qweight, scales, torch.float32).t()).to(x.dtype)


# ---- kernels -------------------------------------------------------------------------------------


@triton.jit
def _int8_mm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_ys, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, SWAP_AB: tl.constexpr = False, SPLIT: tl.constexpr = False,
):  # fmt: skip
    # Split-K (SPLIT): program_id(1) owns K range [pid * K_SPLIT, +K_SPLIT) (a multiple of
    # BLOCK_K) and writes its scaled fp32 partial to that plane of y (a workspace [SPLIT, M, N],
    # planes stride_ys apart).
    # 1-D grid in grouped order (grouped_mm_tile): each int8 weight tile is read from HBM about
    # once per GROUP_M tiles. Plain: acc [BLOCK_M, BLOCK_N] = x @ W^T. SWAP_AB: acc [BLOCK_N,
    # BLOCK_M] = W @ x^T, the converted weight as the dot's FIRST operand: Hopper's wgmma takes
    # that operand from registers, where the int8 -> bf16 conversion leaves it (the plain
    # order stores it back to shared memory first), and tokens sit on the dot's N side (no
    # 64-row minimum). Either way a is [BLOCK_A, BLOCK_K] and b [BLOCK_K, BLOCK_B].
    if SWAP_AB:
        ra, rb, a_ok, b_ok, a_ptrs, b_ptrs = grouped_mm_tile(
            w_ptr, x_ptr, N, M, stride_wn, stride_xm, BLOCK_N, BLOCK_M, BLOCK_K, GROUP_M
        )
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        ra, rb, a_ok, b_ok, a_ptrs, b_ptrs = grouped_mm_tile(
            x_ptr, w_ptr, M, N, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M
        )
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rk = tl.arange(0, BLOCK_K)
    k_lo, k_end, a_ptrs, b_ptrs, y_ptr = split_k_slice(
        a_ptrs, b_ptrs, y_ptr, K, K_SPLIT, stride_ys, SPLIT
    )
    for k0 in range(k_lo, k_end, BLOCK_K):
        k_ok = k0 + rk < K
        a = tl.load(a_ptrs, mask=a_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & b_ok[None, :], other=0)
        # int8 values are exact in fp16 / bf16 / fp32; the weight takes x's dtype
        if SWAP_AB:
            if UPCAST:
                b = b.to(tl.float32)
            acc += tl.dot(a.to(b.dtype), b)
        else:
            if UPCAST:
                a = a.to(tl.float32)
            acc += tl.dot(a, b.to(a.dtype))
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SWAP_AB:
        out = tl.trans(acc * tl.load(s_ptr + ra, mask=a_ok, other=0.0).to(tl.float32)[:, None])
        rm, rn = rb, ra
    else:
        out = acc * tl.load(s_ptr + rb, mask=b_ok, other=0.0).to(tl.float32)[None, :]
        rm, rn = ra, rb
    tl.store(
        y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
        out.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@triton.jit
def _int4_mm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    # BLOCK_K divides GROUP, so one K tile lies inside one group (one scale/zero per column).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    half: tl.constexpr = GROUP // 2
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        grp = k0 // GROUP
        kin = kk - grp * GROUP  # position inside the group
        byte = grp * half + (kin % half)
        shift = (kin >= half).to(tl.int32) * 4
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        packed = tl.load(
            w_ptr + rn[:, None] * stride_wn + byte[None, :],
            mask=(rn[:, None] < N) & (kk[None, :] < K),
            other=0,
        ).to(tl.int32)
        q = (packed >> shift[None, :]) & 0xF
        z = tl.load(z_ptr + rn * stride_sn + grp, mask=rn < N, other=0).to(tl.int32)
        s = tl.load(s_ptr + rn * stride_sn + grp, mask=rn < N, other=0.0).to(tl.float32)
        if UPCAST:
            x = x.to(tl.float32)
        wq = (q - z[:, None]).to(x.dtype)  # -16..15: exact in every float dtype
        acc += tl.dot(x, tl.trans(wq)) * s[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


# ---- GEMV kernels (small M) ------------------------------------------------------------------------
# Program (pid_n, pid_k) computes y[:, pid_n * BLOCK_N : +BLOCK_N] over K slice pid_k, written to
# y directly (SPLIT_K 1: stride_ys 0) or to fp32 workspace plane pid_k (summed by
# `_common.splitk_sum`). The weight tile is dequantized once per step and shared by the M rows of x
# (tl.static_range). int8 / fp8 at M == 1 keep an elementwise [BLOCK_N, BLOCK_K] fp32 accumulator,
# reduced once after the K loop (no cross-lane work in the loop); M > 1 reduces each row's
# products per step into [BLOCK_N, BLOCK_MP], so registers do not grow with M. int4 reduces
# per group chunk (see _gemv_int4_kernel).


@triton.jit
def _int8_bits_to_f32(b):
    # uint8 bits of an int8 code q -> float(q), exactly: b ^ 0x80 = q + 128 in 0..255; as the low
    # mantissa bits of 2^23 (0x4B000000) that float is 2^23 + q + 128; one fadd removes the bias.
    return (b.to(tl.int32) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _gemv_w8_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    N, K, K_SPLIT,
    stride_xm, stride_wn, stride_ys, stride_ym,
    M: tl.constexpr, BLOCK_MP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, BIT_CVT: tl.constexpr, VEC: tl.constexpr, X_TILE: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(USE_PDL)
    # w: uint8 [N, K], int8 codes or float8_e4m3fn bits; y = (x @ w^T) * s[n].
    # Layouts: w is read VEC bytes per thread, the width of x's 16-byte vectors, so that Triton
    # gives x the weight tile's layout; a differently laid out x costs a shared-memory round
    # trip with barriers every step. X_TILE loads x as a [BLOCK_N, BLOCK_K] broadcast tile (same
    # shape, so same layout; rows a thread holds twice are L1 hits); without it x is a [BLOCK_K]
    # vector, whose layout matches only when BLOCK_K >= VEC * 32 * num_warps (M == 1).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm = tl.arange(0, BLOCK_MP)
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    if M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_MP), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K  # K_SPLIT is a multiple of BLOCK_K: only the last step of K is ragged
        kw = tl.max_contiguous(kk, VEC)
        wb = tl.load(w_rows + kw[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        if FP8:
            w = wb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif BIT_CVT:
            w = _int8_bits_to_f32(wb)
        else:
            w = wb.to(tl.int8, bitcast=True).to(tl.float32)
        for m in tl.static_range(M):
            if X_TILE:
                xk = tl.broadcast_to(kk[None, :], (BLOCK_N, BLOCK_K))
                xv = tl.load(x_ptr + m * stride_xm + xk, mask=xk < K, other=0.0).to(tl.float32)
            else:
                xv = tl.load(x_ptr + m * stride_xm + kk, mask=k_ok, other=0.0).to(tl.float32)
                xv = xv[None, :]
            if M == 1:
                acc += w * xv
            else:
                part = tl.sum(w * xv, axis=1)
                acc += tl.where(rm[None, :] == m, part[:, None], 0.0)
    if M == 1:
        out = tl.sum(acc, axis=1)[:, None]
    else:
        out = acc
    s = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    out = out * s[:, None]
    ptrs = y_ptr + pid_k * stride_ys + rm[None, :] * stride_ym + rn[:, None]
    tl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & (rm[None, :] < M))


@triton.jit
def _gemv_int4_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr,
    N, KB, KB_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_ys, stride_ym,
    M: tl.constexpr, BLOCK_MP: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNKS: tl.constexpr, CHUNK: tl.constexpr, HALF: tl.constexpr, BIT_CVT: tl.constexpr,
    VEC: tl.constexpr, X_TILE: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(USE_PDL)
    # Packed byte b of a row (KB = K / 2 per row) holds k_lo = b + (b // HALF) * HALF in its low
    # nibble and k_lo + HALF in its high one (group half-split). A step reads CHUNKS x CHUNK
    # contiguous bytes per row; CHUNK divides HALF, so a chunk lies inside one group: its
    # products are summed first (mostly in-thread) and scaled once, one scale / zero per
    # (channel, chunk) instead of a multiply per element. Layouts as in _gemv_w8_kernel: bytes
    # are read VEC per thread; X_TILE: x as a broadcast [BLOCK_N, CHUNKS, CHUNK] tile, else as
    # [CHUNKS, CHUNK] (matching when a step's bytes >= VEC * 32 * num_warps, M == 1).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, CHUNKS)
    rj = tl.arange(0, CHUNK)
    rm = tl.arange(0, BLOCK_MP)
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None, None] * stride_wn
    sz_rows = rn[:, None] * stride_sn
    b_start = pid_k * KB_SPLIT
    b_end = tl.minimum(b_start + KB_SPLIT, KB)
    if M == 1:
        acc = tl.zeros((BLOCK_N, CHUNKS), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_MP), dtype=tl.float32)
    for b0 in range(b_start, b_end, CHUNKS * CHUNK):
        cb = b0 + rc * CHUNK  # first byte of each chunk
        c_ok = cb < KB  # KB_SPLIT is a multiple of the step: only the last step is ragged
        grp = cb // HALF
        bb = tl.max_contiguous(cb[:, None] + rj[None, :], [1, VEC])  # [CHUNKS, CHUNK] bytes
        k_lo = bb + (grp * HALF)[:, None]
        ok = n_ok[:, None] & c_ok[None, :]
        p = tl.load(w_rows + bb[None, :, :], mask=ok[:, :, None], other=0).to(tl.int32)
        sz = sz_rows + grp[None, :]
        s = tl.load(s_ptr + sz, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_N, CHUNKS]
        z = tl.load(z_ptr + sz, mask=ok, other=0)
        if BIT_CVT:
            # nibble q as the low mantissa bits of 2^23 is the float 2^23 + q: one fadd of
            # -(2^23 + z) gives q - z exactly.
            zf = (z.to(tl.float32) + 8388608.0)[:, :, None]
            q_lo = ((p & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf
            q_hi = ((p >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - zf
        else:
            zi = z.to(tl.int32)[:, :, None]
            q_lo = ((p & 0xF) - zi).to(tl.float32)
            q_hi = ((p >> 4) - zi).to(tl.float32)
        if X_TILE:
            xk = tl.broadcast_to(k_lo[None, :, :], (BLOCK_N, CHUNKS, CHUNK))
            x_ok = tl.broadcast_to(c_ok[None, :, None], (BLOCK_N, CHUNKS, CHUNK))
        else:
            xk = k_lo
            x_ok = tl.broadcast_to(c_ok[:, None], (CHUNKS, CHUNK))
        for m in tl.static_range(M):
            xm = x_ptr + m * stride_xm + xk
            x_lo = tl.load(xm, mask=x_ok, other=0.0).to(tl.float32)
            x_hi = tl.load(xm + HALF, mask=x_ok, other=0.0).to(tl.float32)
            if not X_TILE:
                x_lo = x_lo[None, :, :]
                x_hi = x_hi[None, :, :]
            seg = tl.sum(q_lo * x_lo + q_hi * x_hi, axis=2) * s
            if M == 1:
                acc += seg
            else:
                acc += tl.where(rm[None, :] == m, tl.sum(seg, axis=1)[:, None], 0.0)
    if M == 1:
        out = tl.sum(acc, axis=1)[:, None]
    else:
        out = acc
    ptrs = y_ptr + pid_k * stride_ys + rm[None, :] * stride_ym + rn[:, None]
    tl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & (rm[None, :] < M))


# ---- wrappers ------------------------------------------------------------------------------------


def _gemv(
    fmt: str,
    x: torch.Tensor,
    w: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group: int,
    tiles: GemvTiles,
    kernels: KernelConfig | None = None,
) -> torch.Tensor:
    """Launch the GEMV of format fmt on validated inputs: x [M, K] (1 <= M <= GEMV_MAX_M, last
    dim contiguous), w uint8 [N, K] (int4: [N, K/2]), contiguous scales (and zeros)."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    t = _resolve_split(tiles, n, k)
    split = t.split_k
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    stride_ys = 0 if split == 1 else m * n
    grid = (triton.cdiv(n, t.block_n), split)
    vec = 16 // x.element_size()  # x elements per 16-byte load: the weight's bytes per thread
    pdl = use_pdl(x, kernels)  # KernelConfig.pdl
    common = {"M": m, "BLOCK_MP": next_pow2(m), "BLOCK_N": t.block_n, "BIT_CVT": t.bit_cvt,
              "num_warps": t.num_warps, "USE_PDL": pdl, **pdl_kwargs(pdl)}  # fmt: skip
    if fmt == "int4":
        half = group // 2
        step = t.block_k // 2  # bytes per row per step
        chunk = min(half & -half, step)  # largest power of two dividing HALF, capped by the step
        kb = k // 2
        kb_split = triton.cdiv(triton.cdiv(kb, split), step) * step
        _gemv_int4_kernel[grid](
            x, w, scales, zeros, out, n, kb, kb_split,
            x.stride(0), w.stride(0), scales.stride(0), stride_ys, n,
            CHUNKS=step // chunk, CHUNK=chunk, HALF=half,
            VEC=min(vec, chunk),  # a contiguity hint: never past a chunk (odd groups)
            X_TILE=m > 1 or step < vec * 32 * t.num_warps, **common,
        )  # fmt: skip
    else:
        k_split = triton.cdiv(triton.cdiv(k, split), t.block_k) * t.block_k
        _gemv_w8_kernel[grid](
            x, w, scales, out, n, k, k_split,
            x.stride(0), w.stride(0), stride_ys, n,
            BLOCK_K=t.block_k, FP8=fmt == "fp8", VEC=vec,
            X_TILE=m > 1 or t.block_k < vec * 32 * t.num_warps, **common,
        )  # fmt: skip
    if split > 1:
        splitk_sum(out, y, pdl)
    return y


def _check_x_w(name: str, x: torch.Tensor, qweight: torch.Tensor) -> None:
    if x.dim() != 2 or qweight.dim() != 2:
        raise ValueError(
            f"{name}: x {tuple(x.shape)} and qweight {tuple(qweight.shape)} must be 2-D"
        )
    check_last_dim_contiguous(f"{name} x", x)
    check_last_dim_contiguous(f"{name} qweight", qweight)


def int8_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    *,
    tiles: GemvTiles | tuple | None = None,
    kernels: KernelConfig | None = None,
) -> torch.Tensor:
    """x [M, K] float, qweight int8 [N, K], scales float [N] -> y [M, N] x.dtype.

    M <= GEMV_DEFAULT_MAX_M["int8"] runs the GEMV kernel, larger M the tl.dot one (`use_gemv`).
    tiles overrides the config: a `GemvTiles` (or its tuple; M <= GEMV_MAX_M) runs the GEMV,
    an `Int8DotTiles` (or a prefix of its fields, from (BLOCK_M, BLOCK_N, BLOCK_K)) the tl.dot one.
    """
    check_device("int8_matmul", x, qweight, scales)
    check_dtype("int8_matmul x", x, FLOAT_DTYPES)
    check_dtype("int8_matmul qweight", qweight, (torch.int8,))
    check_dtype("int8_matmul scales", scales, FLOAT_DTYPES)
    _check_x_w("int8_matmul", x, qweight)
    if x.shape[1] != qweight.shape[1]:
        raise ValueError(f"int8_matmul: x {tuple(x.shape)} and qweight {tuple(qweight.shape)}")
    if scales.shape != (qweight.shape[0],):
        raise ValueError(f"int8_matmul: scales must be [N], got {tuple(scales.shape)}")
    m, k = x.shape
    n = qweight.shape[0]
    if use_gemv("int8", m, tiles):
        t = (_check_gemv_tiles("int8_matmul", tiles) if tiles is not None
             else gemv_tiles("int8", m, n, k))  # fmt: skip
        # The kernel reads int8 codes as raw bytes (see _int8_bits_to_f32).
        return _gemv("int8", x, qweight.view(torch.uint8), scales.contiguous(), None, 0, t, kernels)
    t = _check_dot_tiles("int8_matmul", tiles, extra=True) if tiles is not None else None
    return _int8_dot(x, qweight, scales.contiguous(), t)


def _int8_dot(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    tiles: Int8DotTiles | tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The tl.dot int8 path on validated inputs (any M; benchmarks time it at small M too).
    tiles: `Int8DotTiles` or a prefix of its fields; None = the INT8_DOT_TILES bucket of M."""
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    t = int8_dot_tiles(m) if tiles is None else Int8DotTiles(*tiles)
    k_split, split = split_k_range(k, dot_split_k(t, m, n, k), t.block_k)
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), split)
    _int8_mm_kernel[grid](
        x, qweight, scales, out, m, n, k, k_split,
        x.stride(0), qweight.stride(0), 0 if split == 1 else m * n, n,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        UPCAST=upcast_dot(x.dtype), SWAP_AB=bool(t.swap_ab), SPLIT=split > 1,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    if split > 1:
        splitk_sum(out, y)
    return y


def int4_block_k(group: int, preferred: int = 64) -> int | None:
    """Largest power of two <= preferred (>= 16) dividing `group`; None when there is none."""
    bk = preferred
    while bk >= 16:
        if group % bk == 0:
            return bk
        bk //= 2
    return None


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    *,
    tiles: GemvTiles | tuple | None = None,
    kernels: KernelConfig | None = None,
) -> torch.Tensor:
    """x [M, K] float, qweight uint8 [N, K/2], scales [N, G], zeros uint8 [N, G] -> [M, N].

    The group K / G must be even. M <= GEMV_DEFAULT_MAX_M["int4"] runs the GEMV kernel (any even
    group); larger M the tl.dot one (the group needs a power-of-two divisor >= 16). tiles: as in `int8_matmul`.
    """
    check_device("int4_matmul", x, qweight, scales, zeros)
    check_dtype("int4_matmul x", x, FLOAT_DTYPES)
    check_dtype("int4_matmul qweight", qweight, (torch.uint8,))
    check_dtype("int4_matmul scales", scales, FLOAT_DTYPES)
    check_dtype("int4_matmul zeros", zeros, (torch.uint8,))
    _check_x_w("int4_matmul", x, qweight)
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.shape != (n, k // 2) or k % 2:
        raise ValueError(f"int4_matmul: x {tuple(x.shape)} needs qweight [N, K/2], got "
                         f"{tuple(qweight.shape)}")  # fmt: skip
    if (
        scales.dim() != 2
        or scales.shape != zeros.shape
        or scales.shape[0] != n
        or scales.shape[1] == 0
        or k % scales.shape[1]
    ):
        raise ValueError(
            f"int4_matmul: scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} must be "
            f"[N, G] with G dividing K={k}"
        )
    group = k // scales.shape[1]
    if group % 2:
        raise ValueError(f"int4_matmul: group size {group} must be even (half-split packing)")
    scales, zeros = scales.contiguous(), zeros.contiguous()
    if use_gemv("int4", m, tiles):
        t = (_check_gemv_tiles("int4_matmul", tiles) if tiles is not None
             else gemv_tiles("int4", m, n, k))  # fmt: skip
        return _gemv("int4", x, qweight, scales, zeros, group, t, kernels)
    t = _check_dot_tiles("int4_matmul", tiles) if tiles is not None else _tiles(m)
    if int4_block_k(group, t[2]) is None:
        raise ValueError(f"int4_matmul: group size {group} has no power-of-two divisor >= 16")
    return _int4_dot(x, qweight, scales, zeros, group, t)


def _int4_dot(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    tiles: tuple[int, int, int],
) -> torch.Tensor:
    """The tl.dot int4 path on validated inputs (contiguous scales / zeros; int4_block_k(group,
    BLOCK_K) not None)."""
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk = tiles
    bk_g = int4_block_k(group, bk)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _int4_mm_kernel[grid](
        x, qweight, scales, zeros, y, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        GROUP=group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk_g, UPCAST=upcast_dot(x.dtype),
    )  # fmt: skip
    return y


@functools.lru_cache(maxsize=16)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_gemv_supported(device: torch.device | str) -> bool:
    """Whether the Triton fp8 GEMV runs on device: CUDA compute capability >= 8.9 (Triton's
    float8e4nv conversion), or CPU under TRITON_INTERPRET=1."""
    device = torch.device(device)
    if device.type == "cpu":
        return interpret_mode()
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index) >= (8, 9)


def fp8_weight_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    *,
    tiles: GemvTiles | tuple | None = None,
    kernels: KernelConfig | None = None,
) -> torch.Tensor:
    """Weight-only fp8: x [M, K] float, qweight uint8 [N, K] float8_e4m3fn bits (a float8_e4m3fn
    tensor is read as its bits), scales float [N] -> y [M, N] x.dtype = (x @ fp8(q)^T) * s.

    x is not quantized. M <= GEMV_DEFAULT_MAX_M["fp8"] (or a GEMV tiles override, M <=
    GEMV_MAX_M) on a device with `fp8_gemv_supported`: the Triton
    GEMV (fp32 accumulation); otherwise the weight is dequantized to x.dtype and multiplied by
    torch. tiles: a `GemvTiles` override of the GEMV (ValueError where that path is not taken).
    """
    check_device("fp8_weight_matmul", x, qweight, scales)
    check_dtype("fp8_weight_matmul x", x, FLOAT_DTYPES)
    check_dtype("fp8_weight_matmul qweight", qweight, (torch.uint8, torch.float8_e4m3fn))
    check_dtype("fp8_weight_matmul scales", scales, FLOAT_DTYPES)
    _check_x_w("fp8_weight_matmul", x, qweight)
    if x.shape[1] != qweight.shape[1]:
        raise ValueError(
            f"fp8_weight_matmul: x {tuple(x.shape)} and qweight {tuple(qweight.shape)}"
        )
    if scales.shape != (qweight.shape[0],):
        raise ValueError(f"fp8_weight_matmul: scales must be [N], got {tuple(scales.shape)}")
    qweight = qweight.view(torch.uint8)
    m, k = x.shape
    n = qweight.shape[0]
    if use_gemv("fp8", m, tiles) and fp8_gemv_supported(x.device):
        t = (_check_gemv_tiles("fp8_weight_matmul", tiles) if tiles is not None
             else gemv_tiles("fp8", m, n, k))  # fmt: skip
        return _gemv("fp8", x, qweight, scales.contiguous(), None, 0, t, kernels)
    if tiles is not None:
        raise ValueError(
            f"fp8_weight_matmul: tiles apply to the Triton GEMV only (a GEMV config, 1 <= M <= "
            f"{GEMV_MAX_M}, on CUDA cc >= 8.9), not M={m} on {x.device}"
        )
    return torch.nn.functional.linear(x, dequant_fp8_torch(qweight, scales, x.dtype))
