"""Dense (fp16 / bf16 / fp32) GEMV in Triton for decode: y[1, N] = x[1, K] @ W[N, K]^T (+ b).

At batch-1 decode every linear is a GEMV: the weight is read once and each element feeds one FMA,
so the bound is HBM bandwidth. cuBLAS picks kernels that reach ~4.1 TB/s on the widest shape of
Llama-8B (gate_up) but 2.6-3.3 TB/s on the narrow ones (qkv, o_proj) and adds a split-K reduce
kernel on some; this kernel is the int8 / fp8 GEMV of quant_matmul.py (`_gemv_w8_kernel`) with
the weight read as floats: many programs, each owning BLOCK_N output rows and streaming wide
contiguous K chunks (BLOCK_K elements per row per step, 16-byte loads), fp32 FMA into an
elementwise [BLOCK_N, BLOCK_K] accumulator reduced once after the K loop, no tl.dot. Optional
split-K: SPLIT_K programs per row block write fp32 partials that quant_matmul's deterministic
`_splitk_sum_kernel` adds in a fixed order (no atomics). The launch config is quant_matmul's
`GemvTiles` (bit_cvt is ignored here) and split_k 0 is resolved by its `_resolve_split`.

Data, set from H200 measurements (`python -m xlaserve.kernels_cuda.bench_kernels --only
dense_gemv`):
  * DENSE_GEMV_TILES: (N, K) -> GemvTiles; other shapes use DENSE_GEMV_DEFAULT_TILES.
  * DENSE_GEMV_SHAPES: the (N, K) weight shapes whose M == 1 forward takes this kernel instead of
    cuBLAS (`use_dense_gemv`, wired into backends_torch.layers.linear); None (the default) = all
    shapes on CUDA, as it beat cuBLAS on every shape measured. $XLASERVE_DENSE_GEMV=1 / 0 forces
    every shape on / off.

No residual epilogue: the decoder adds the residual inside its fused add + RMSNorm kernel, which
reads the residual anyway, so folding the add into o_proj / down saves no traffic or launch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from xlaserve.kernels_cuda._common import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    interpret_mode,
    pdl_kwargs,
    pdl_prologue,
    use_pdl,
)
from xlaserve.kernels_cuda.activation import ACT_CODES, apply_activation
from xlaserve.kernels_cuda.quant_matmul import (
    _SPLITK_SUM_BLOCK,
    GemvTiles,
    _check_gemv_tiles,
    _resolve_split,
    _splitk_sum_kernel,
)

# Default tiles, measured on the H200 (bench/RESULTS.md, 2026-12-03 fourth session; a sweep of
# 36 configs per shape): 2 rows x 1024 k's per step, auto split-K, 4 warps is the best or within
# 0.2 us of it on every Llama-8B shape (1024 = 8 bf16 per 16-byte load x 32 lanes x 4 warps, so
# x's vector layout matches the weight tile's and no shared-memory shuffle is needed).
DENSE_GEMV_DEFAULT_TILES = GemvTiles(2, 1024, 0, 4)
# Per (N, K) overrides (none needed so far; `bench_kernels --only dense_gemv` sweeps them).
DENSE_GEMV_TILES: dict[tuple[int, int], GemvTiles] = {}
# (N, K) weight shapes whose M == 1 (decode) forward takes the Triton GEMV rather than cuBLAS;
# None = every shape on CUDA. Measured on the H200, bf16, us per call (cuBLAS -> this kernel):
# qkv 6144x4096 15.4 -> 14.4, o_proj 4096x4096 13.3 -> 10.9 (cuBLAS adds a split-K reduce
# kernel), gate_up 28672x4096 58.0 -> 56.3, down 4096x14336 32.5 -> 30.4, lm_head 128256x4096
# 282.9 -> 238.5: faster on every shape measured, so on by default.
DENSE_GEMV_SHAPES: frozenset[tuple[int, int]] | None = None
# Tiles of the act-and-mul prologue variant (`dense_gemv_act_mul`): each program recomputes
# act(gate) * up for its K chunk, so taller row blocks (fewer programs) read the [gate | up]
# activations from L2 fewer times; (8, 2048) matched the best plain config on the down
# projection's shape (4096 x 14336) on the H200.
DENSE_GEMV_ACT_TILES = GemvTiles(8, 2048, 0, 4)
# Whether a gated MLP's batch-1 decode fuses act-and-mul into the down GEMV when both run as
# Triton kernels; $XLASERVE_FUSED_ACT_GEMV "1" / "0" overrides. Off: measured slower on the
# H200 (Llama-8B batch-1 decode 226.2 tok/s fused vs 233.1 with the separate act-and-mul
# kernel, same call): each program recomputes the activation of its whole K range, and the
# tiles were not swept for it.
FUSED_ACT_GEMV = False
# Activation dtypes the dispatch considers (the kernel itself also runs fp32, for tests).
DENSE_GEMV_DTYPES = (torch.float16, torch.bfloat16)
ENV_DENSE_GEMV = "XLASERVE_DENSE_GEMV"


def dense_gemv_tiles(n: int, k: int) -> GemvTiles:
    """The launch config for a weight [n, k]: DENSE_GEMV_TILES or the default, split resolved."""
    return _resolve_split(DENSE_GEMV_TILES.get((n, k), DENSE_GEMV_DEFAULT_TILES), n, k)


def use_dense_gemv(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether x [m, k] @ W[n, k]^T takes the Triton GEMV: m == 1, dtype fp16 / bf16, a CUDA
    device (or CPU under TRITON_INTERPRET=1), and (n, k) in DENSE_GEMV_SHAPES (None: every
    shape on CUDA), unless
    $XLASERVE_DENSE_GEMV is "1" (every shape) or "0" (none)."""
    if m != 1 or dtype not in DENSE_GEMV_DTYPES:
        return False
    dev = torch.device(device)
    if not (dev.type == "cuda" or (dev.type == "cpu" and interpret_mode())):
        return False
    env = os.environ.get(ENV_DENSE_GEMV)
    if env in ("0", "1"):
        return env == "1"
    if DENSE_GEMV_SHAPES is None:  # every shape, on CUDA (not by default in the interpreter)
        return dev.type == "cuda"
    return (n, k) in DENSE_GEMV_SHAPES


@triton.jit
def _load_x(x_ptr, idx, mask, K, ACT_MUL: tl.constexpr, ACT: tl.constexpr):
    """x[idx] as fp32; ACT_MUL: x is [gate | up] of 2K values and the GEMV input is
    act(gate) * up, rounded to x's dtype exactly as the act-and-mul kernel stores it."""
    if ACT_MUL:
        g = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + idx, mask=mask, other=0.0).to(tl.float32)
        a = apply_activation(g, ACT) * u
        return a.to(x_ptr.dtype.element_ty).to(tl.float32)
    return tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _dense_gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    N, K, K_SPLIT,
    stride_wn, stride_ys,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, X_TILE: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT_MUL: tl.constexpr, ACT: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(USE_PDL)
    # Program (pid_n, pid_k): rows [pid_n * BLOCK_N, +BLOCK_N) over K slice pid_k, written to
    # y directly (one slice: stride_ys 0) or to fp32 workspace plane pid_k. Layouts as in
    # quant_matmul._gemv_w8_kernel: VEC elements (16 bytes) per thread along K; X_TILE loads x
    # as a broadcast [BLOCK_N, BLOCK_K] tile (same layout as w; repeated rows are L1 hits)
    # for steps narrower than one 16-byte load per thread, else as a [BLOCK_K] vector.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K  # K_SPLIT is a multiple of BLOCK_K: only the last step of K is ragged
        kw = tl.max_contiguous(kk, VEC)
        w = tl.load(w_rows + kw[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if X_TILE:
            xk = tl.broadcast_to(kw[None, :], (BLOCK_N, BLOCK_K))
            xv = _load_x(x_ptr, xk, xk < K, K, ACT_MUL, ACT)
        else:
            xv = _load_x(x_ptr, kw, k_ok, K, ACT_MUL, ACT)[None, :]
        acc += w.to(tl.float32) * xv
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:  # added once: by the first K slice
        first = (rn * 0 + pid_k) == 0  # a tensor mask (the interpreter rejects scalar ones)
        b = tl.load(b_ptr + rn, mask=n_ok & first, other=0.0)
        out += b.to(tl.float32)
    tl.store(y_ptr + pid_k * stride_ys + rn, out.to(y_ptr.dtype.element_ty), mask=n_ok)


def fused_act_gemv_enabled() -> bool:
    """FUSED_ACT_GEMV unless $XLASERVE_FUSED_ACT_GEMV is "1" / "0"."""
    env = os.environ.get("XLASERVE_FUSED_ACT_GEMV")
    return env == "1" if env in ("0", "1") else FUSED_ACT_GEMV


def dense_gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T (+ bias [N]) in fp32 math -> [1, N] x.dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def dense_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tiles: GemvTiles | tuple | None = None,
) -> torch.Tensor:
    """y [1, N] = x [1, K] @ weight [N, K]^T (+ bias [N]), fp32 accumulation, one rounding.

    x, weight, bias: one float dtype (fp16 / bf16 / fp32), last dims contiguous (weight rows may
    be strided, e.g. a row slice of a fused weight). M must be 1 (decode). tiles: a `GemvTiles`
    override (block_n, block_k, split_k (0: auto), num_warps[, bit_cvt ignored]); default
    `dense_gemv_tiles(N, K)`. split_k > 1 runs a second, deterministic summing kernel.
    """
    return _launch("dense_gemv", x, weight, bias, tiles, act=None)


def dense_gemv_act_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    act: str = "silu",
    *,
    tiles: GemvTiles | tuple | None = None,
) -> torch.Tensor:
    """y [1, N] = (act(gate) * up) @ weight [N, K]^T (+ bias) for x = [gate | up] [1, 2K]: the
    gated MLP's act-and-mul fused into the down projection's GEMV (one kernel and one launch
    fewer per layer at batch-1 decode). Bit-identical to `silu_and_mul` (etc.) followed by
    `dense_gemv` with the same tiles: the product is rounded to x's dtype before the FMA.
    act: a key of kernels_cuda.activation.ACT_CODES. Default tiles DENSE_GEMV_ACT_TILES."""
    if act not in ACT_CODES:
        raise ValueError(f"dense_gemv_act_mul: act must be one of {sorted(ACT_CODES)}, got {act!r}")
    return _launch("dense_gemv_act_mul", x, weight, bias, tiles, act=act)


def _launch(
    name: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: GemvTiles | tuple | None,
    act: str | None,
) -> torch.Tensor:
    check_device(name, x, weight, *(() if bias is None else (bias,)))
    check_dtype(f"{name} x", x, FLOAT_DTYPES)
    kx = weight.shape[1] * (2 if act is not None else 1) if weight.dim() == 2 else -1
    if x.dim() != 2 or weight.dim() != 2 or x.shape[0] != 1 or x.shape[1] != kx:
        want = "[1, 2K] (gate | up)" if act is not None else "[1, K]"
        raise ValueError(
            f"{name}: x must be {want} and weight [N, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"{name}: x, weight (and bias) must share one dtype")
    n, k = weight.shape
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"{name}: bias must be [N={n}], got {tuple(bias.shape)}")
    check_last_dim_contiguous(f"{name} x", x)
    check_last_dim_contiguous(f"{name} weight", weight)
    if bias is not None:
        check_last_dim_contiguous(f"{name} bias", bias)
    if tiles is not None:
        tiles = _check_gemv_tiles(name, tiles)
    elif act is not None:
        tiles = DENSE_GEMV_ACT_TILES
    t = _resolve_split(tiles, n, k) if tiles is not None else dense_gemv_tiles(n, k)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    split = t.split_k
    out = y if split == 1 else torch.empty((split, n), dtype=torch.float32, device=x.device)
    vec = 16 // x.element_size()  # elements per 16-byte load
    k_split = triton.cdiv(triton.cdiv(k, split), t.block_k) * t.block_k
    _dense_gemv_kernel[(triton.cdiv(n, t.block_n), split)](
        x, weight, y if bias is None else bias, out, n, k, k_split,
        weight.stride(0), 0 if split == 1 else n,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, VEC=vec,
        X_TILE=t.block_k < vec * 32 * t.num_warps, HAS_BIAS=bias is not None,
        ACT_MUL=act is not None, ACT=ACT_CODES[act] if act is not None else 0,
        num_warps=t.num_warps, USE_PDL=(pdl := use_pdl(x)), **pdl_kwargs(pdl),
    )  # fmt: skip
    if split > 1:
        _splitk_sum_kernel[(triton.cdiv(n, _SPLITK_SUM_BLOCK),)](
            out, y, n, SPLIT=split, BLOCK=_SPLITK_SUM_BLOCK, USE_PDL=pdl, **pdl_kwargs(pdl)
        )
    return y
