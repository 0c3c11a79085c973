"""Dense (fp16 / bf16 / fp32) GEMV in Triton for decode: y[1, N] = x[1, K] @ W[N, K]^T (+ b).

At batch-1 decode every linear is a GEMV: the weight is read once and each element feeds one FMA,
so the bound is HBM bandwidth. cuBLAS picks kernels that reach ~4.1 TB/s on the widest shape of
Llama-8B (gate_up) but 2.6-3.3 TB/s on the narrow ones (qkv, o_proj) and adds a split-K reduce
kernel on some; this kernel is the int8 / fp8 GEMV of quant_matmul.py (`_gemv_w8_kernel`) with
the weight read as floats: many programs, each owning BLOCK_N output rows and streaming wide
contiguous K chunks (BLOCK_K elements per row per step, 16-byte loads), fp32 FMA into an
elementwise [BLOCK_N, BLOCK_K] accumulator reduced once after the K loop, no tl.dot. Optional
split-K: SPLIT_K programs per row block write fp32 partials that the deterministic
`_common.splitk_sum` adds in a fixed order (no atomics). The launch config is quant_matmul's
`GemvTiles` (bit_cvt is ignored here) and split_k 0 is resolved by its `_resolve_split`.

Data, set from H200 measurements (`python -m xlaserve.bench.kernels.cuda_kernels --only
dense_gemv`):
  * DENSE_GEMV_TILES: (N, K) -> GemvTiles; other shapes use DENSE_GEMV_DEFAULT_TILES.
  * DENSE_GEMV_SHAPES: the (N, K) weight shapes whose M == 1 forward takes this kernel instead of
    cuBLAS (`use_dense_gemv`, wired into backends_torch.layers.linear); None (the default) = all
    shapes on CUDA, as it beat cuBLAS on every shape measured. KernelConfig.dense_gemv "on" /
    "off" forces every shape on / off.
  * KernelConfig.gemv_prefetch: each program reads its first weight tile before the PDL wait.
  * KernelConfig.gate_act_gemv: a gated MLP's gate_up GEMV applies act(gate) * up in its epilogue
    (`dense_gemv_gate_act`, used by backends_torch.layers.activation.MLP at one row).
The switches come from a `KernelConfig` argument (the layers pass the engine's); None = the
config defaults and their XLASERVE_* environment overrides (`config.kernel_switch`).

No residual epilogue: the decoder adds the residual inside its fused add + RMSNorm kernel, which
reads the residual anyway, so folding the add into o_proj / down saves no traffic or launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xlaserve.config import KernelConfig, kernel_switch
from xlaserve.kernels_cuda._common import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    interpret_mode,
    pdl_kwargs,
    splitk_sum,
    use_pdl,
)
from xlaserve.kernels_cuda.activation import ACT_CODES, apply_activation
from xlaserve.kernels_cuda.quant_matmul import GemvTiles, _check_gemv_tiles, _resolve_split

# Default tiles, measured on the H200 (bench/RESULTS.md, 2026-12-03 fourth session; a sweep of
# 36 configs per shape): 2 rows x 1024 k's per step, auto split-K, 4 warps is the best or within
# 0.2 us of it on every Llama-8B shape (1024 = 8 bf16 per 16-byte load x 32 lanes x 4 warps, so
# x's vector layout matches the weight tile's and no shared-memory shuffle is needed).
DENSE_GEMV_DEFAULT_TILES = GemvTiles(2, 1024, 0, 4)
# Per (N, K) overrides (none needed so far; `cuda_kernels --only dense_gemv` sweeps them).
DENSE_GEMV_TILES: dict[tuple[int, int], GemvTiles] = {}
# (N, K) weight shapes whose M == 1 (decode) forward takes the Triton GEMV rather than cuBLAS;
# None = every shape on CUDA. Measured on the H200, bf16, us per call (cuBLAS -> this kernel):
# qkv 6144x4096 15.4 -> 14.4, o_proj 4096x4096 13.3 -> 10.9 (cuBLAS adds a split-K reduce
# kernel), gate_up 28672x4096 58.0 -> 56.3, down 4096x14336 32.5 -> 30.4, lm_head 128256x4096
# 282.9 -> 238.5: faster on every shape measured, so on by default.
DENSE_GEMV_SHAPES: frozenset[tuple[int, int]] | None = None
# KernelConfig.gate_act_gemv (default on): a gated MLP's batch-1 decode computes act(gate) * up
# in the gate_up GEMV's epilogue (`dense_gemv_gate_act`: one kernel and one launch fewer per layer
# than the GEMV followed by the act-and-mul kernel). H200, Llama-8B batch-1 decode graph replay
# (bench/RESULTS.md, 2026-12-03 fifth session): with the prefetch below 3.881 ms on, 3.888 off (a
# tie; on: one launch fewer); without the prefetch 4.072 on vs 3.952 off.
# Its tiles: one gate row (and its up row) per program, like the 2-row plain config.
DENSE_GEMV_GATE_ACT_TILES = GemvTiles(1, 1024, 1, 4)
ENV_GATE_ACT_GEMV = KernelConfig.env_name("gate_act_gemv")
# KernelConfig.gemv_prefetch (default on): weight prefetch across the PDL wait: each program
# loads its first weight tile before waiting for the previous kernel (the weights do not depend
# on it), so it streams in during that kernel's tail. H200 batch-1 graph replay 3.952 -> 3.888 ms
# (dense GEMVs without the gate-act epilogue). A second tile in flight during each step (double
# buffering) measured slower (224.6 vs 235.1 tok/s) and was dropped.
ENV_GEMV_PREFETCH = KernelConfig.env_name("gemv_prefetch")
# Activation dtypes the dispatch considers (the kernel itself also runs fp32, for tests).
DENSE_GEMV_DTYPES = (torch.float16, torch.bfloat16)
ENV_DENSE_GEMV = KernelConfig.env_name("dense_gemv")


def dense_gemv_tiles(n: int, k: int) -> GemvTiles:
    """The launch config for a weight [n, k]: DENSE_GEMV_TILES or the default, split resolved."""
    return _resolve_split(DENSE_GEMV_TILES.get((n, k), DENSE_GEMV_DEFAULT_TILES), n, k)


def use_dense_gemv(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    device: torch.device | str,
    kernels: KernelConfig | None = None,
) -> bool:
    """Whether x [m, k] @ W[n, k]^T takes the Triton GEMV: m == 1, dtype fp16 / bf16, a CUDA
    device (or CPU under TRITON_INTERPRET=1), and (n, k) in DENSE_GEMV_SHAPES (None: every
    shape on CUDA), unless KernelConfig.dense_gemv is "on" (every shape) or "off" (none)."""
    if m != 1 or dtype not in DENSE_GEMV_DTYPES:
        return False
    dev = torch.device(device)
    if not (dev.type == "cuda" or (dev.type == "cpu" and interpret_mode())):
        return False
    mode = kernel_switch("dense_gemv", kernels)
    if mode != "auto":
        return mode == "on"
    if DENSE_GEMV_SHAPES is None:  # every shape, on CUDA (not by default in the interpreter)
        return dev.type == "cuda"
    return (n, k) in DENSE_GEMV_SHAPES


@triton.jit
def _w_tile(rows, kw, n_ok, k_ok):
    """Weight tile [BLOCK_N, BLOCK_K] of `rows` at columns kw, as fp32."""
    return tl.load(rows + kw[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _x_tile(x_ptr, kw, k_ok, K, X_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr):  # fmt: skip
    """x at columns kw as fp32, broadcastable against a weight tile. (One return after a static
    if / else: Triton also generates the code after a return inside a constexpr branch, and
    two returns of different shapes fail to compile: "Inconsistent return types" on the H200
    for every X_TILE config, e.g. GemvTiles(8, 512, 1, 4).)"""
    if X_TILE:
        xk = tl.broadcast_to(kw[None, :], (BLOCK_N, BLOCK_K))
        xv = tl.load(x_ptr + xk, mask=xk < K, other=0.0).to(tl.float32)
    else:
        xv = tl.load(x_ptr + kw, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    return xv


@triton.jit
def _dense_gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    N, K, K_SPLIT,
    stride_wn, stride_ys,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, X_TILE: tl.constexpr,
    HAS_BIAS: tl.constexpr, GATE_ACT: tl.constexpr, ACT: tl.constexpr,
    PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # Program (pid_n, pid_k): rows [pid_n * BLOCK_N, +BLOCK_N) over K slice pid_k, written to
    # y directly (one slice: stride_ys 0) or to fp32 workspace plane pid_k. Layouts as in
    # quant_matmul._gemv_w8_kernel: VEC elements (16 bytes) per thread along K; X_TILE loads x
    # as a broadcast [BLOCK_N, BLOCK_K] tile (same layout as w; repeated rows are L1 hits)
    # for steps narrower than one 16-byte load per thread, else as a [BLOCK_K] vector.
    # GATE_ACT (one slice): W is [gate; up] of 2N rows; the program also reads up rows n + N
    # and stores act(gate) * up, each rounded to y's dtype first (as the separate GEMV and
    # act-and-mul kernels would).
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    u_rows = w_rows + N.to(tl.int64) * stride_wn  # GATE_ACT: the up rows
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_first = k_start
    if PREFETCH:
        # The first step's weights do not depend on the previous kernel: read them before the
        # PDL wait, so they stream in while that kernel's tail runs.
        kw = tl.max_contiguous(k_start + rk, VEC)
        k_ok = kw < K  # K_SPLIT is a multiple of BLOCK_K: only the last step of K is ragged
        w = _w_tile(w_rows, kw, n_ok, k_ok)
        if GATE_ACT:
            u = _w_tile(u_rows, kw, n_ok, k_ok)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        xv = _x_tile(x_ptr, kw, k_ok, K, X_TILE, BLOCK_N, BLOCK_K)
        acc += w * xv
        if GATE_ACT:
            acc_u += u * xv
        k_first = k_start + BLOCK_K
    elif USE_PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(k_first, k_end, BLOCK_K):
        kw = tl.max_contiguous(k0 + rk, VEC)
        k_ok = kw < K
        w = _w_tile(w_rows, kw, n_ok, k_ok)
        xv = _x_tile(x_ptr, kw, k_ok, K, X_TILE, BLOCK_N, BLOCK_K)
        acc += w * xv
        if GATE_ACT:
            acc_u += _w_tile(u_rows, kw, n_ok, k_ok) * xv
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:  # added once: by the first K slice
        first = (rn * 0 + pid_k) == 0  # a tensor mask (the interpreter rejects scalar ones)
        b = tl.load(b_ptr + rn, mask=n_ok & first, other=0.0)
        out += b.to(tl.float32)
    if GATE_ACT:
        up = tl.sum(acc_u, axis=1)
        if HAS_BIAS:
            up += tl.load(b_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)
        g = out.to(y_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(y_ptr.dtype.element_ty).to(tl.float32)
        out = apply_activation(g, ACT) * up
    tl.store(y_ptr + pid_k * stride_ys + rn, out.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv_prefetch_enabled(kernels: KernelConfig | None = None) -> bool:
    """KernelConfig.gemv_prefetch (None: its default and environment override)."""
    return bool(kernel_switch("gemv_prefetch", kernels))


def gate_act_gemv_enabled(kernels: KernelConfig | None = None) -> bool:
    """KernelConfig.gate_act_gemv (None: its default and environment override)."""
    return bool(kernel_switch("gate_act_gemv", kernels))


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
    kernels: KernelConfig | None = None,
) -> torch.Tensor:
    """y [1, N] = x [1, K] @ weight [N, K]^T (+ bias [N]), fp32 accumulation, one rounding.

    x, weight, bias: one float dtype (fp16 / bf16 / fp32), last dims contiguous (weight rows may
    be strided, e.g. a row slice of a fused weight). M must be 1 (decode). tiles: a `GemvTiles`
    override (block_n, block_k, split_k (0: auto), num_warps[, bit_cvt ignored]); default
    `dense_gemv_tiles(N, K)`. split_k > 1 runs a second, deterministic summing kernel.
    kernels: the prefetch and PDL switches (None: defaults + environment).
    """
    return _launch("dense_gemv", x, weight, bias, tiles, None, kernels)


def dense_gemv_gate_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    act: str = "silu",
    *,
    tiles: GemvTiles | tuple | None = None,
    kernels: KernelConfig | None = None,
) -> torch.Tensor:
    """y [1, N] = act(gate) * up for [gate | up] = x [1, K] @ weight [2N, K]^T (+ bias [2N]):
    a gated MLP's gate_up projection with the act-and-mul in its epilogue (batch-1 decode: one
    kernel instead of the GEMV and the act-and-mul kernel). Bit-identical to `dense_gemv`
    followed by `silu_and_mul` (etc.) with the same tiles: gate and up are rounded to x's dtype
    before the activation. act: a key of kernels_cuda.activation.ACT_CODES. tiles (BLOCK_N
    gate rows per program, each with its up row): default DENSE_GEMV_GATE_ACT_TILES; split_k
    must be 1 (the activation needs whole sums)."""
    if act not in ACT_CODES:
        raise ValueError(
            f"dense_gemv_gate_act: act must be one of {sorted(ACT_CODES)}, got {act!r}"
        )
    return _launch("dense_gemv_gate_act", x, weight, bias, tiles, act, kernels)


def _launch(
    name: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: GemvTiles | tuple | None,
    act: str | None,
    kernels: KernelConfig | None,
) -> torch.Tensor:
    check_device(name, x, weight, *(() if bias is None else (bias,)))
    check_dtype(f"{name} x", x, FLOAT_DTYPES)
    gate_act = act is not None
    if x.dim() != 2 or weight.dim() != 2 or x.shape[0] != 1 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{name}: x must be [1, K] and weight [N, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"{name}: x, weight (and bias) must share one dtype")
    rows, k = weight.shape
    if gate_act and rows % 2:
        raise ValueError(f"{name}: weight must be [gate; up] with an even row count, got {rows}")
    n = rows // 2 if gate_act else rows
    if bias is not None and bias.shape != (rows,):
        raise ValueError(f"{name}: bias must be [{rows}], got {tuple(bias.shape)}")
    check_last_dim_contiguous(f"{name} x", x)
    check_last_dim_contiguous(f"{name} weight", weight)
    if bias is not None:
        check_last_dim_contiguous(f"{name} bias", bias)
    if tiles is not None:
        tiles = _check_gemv_tiles(name, tiles)
    elif gate_act:
        tiles = DENSE_GEMV_GATE_ACT_TILES
    t = _resolve_split(tiles, n, k) if tiles is not None else dense_gemv_tiles(n, k)
    if gate_act and t.split_k != 1:
        raise ValueError(f"{name}: split_k must be 1 (the activation needs whole sums), got {t}")
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
        GATE_ACT=gate_act, ACT=ACT_CODES[act] if gate_act else 0,
        PREFETCH=gemv_prefetch_enabled(kernels), num_warps=t.num_warps,
        USE_PDL=(pdl := use_pdl(x, kernels)), **pdl_kwargs(pdl),
    )  # fmt: skip
    if split > 1:
        splitk_sum(out, y, pdl)
    return y
