"""Fused MoE (Triton): the routed experts of a FusedMoE layer as two grouped GEMMs.

Design (same idea as vLLM's fused_moe; written here from scratch):

1. ``moe_align``: the T*K (token, choice) rows, flattened as ``row = t * K + k``, are sorted by
   expert and each expert's run is padded to a multiple of BLOCK_M, so every block of BLOCK_M
   sorted rows belongs to one expert. Padding slots hold the sentinel ``T*K``. Plain torch ops
   with shapes fixed by (T, K, E, BLOCK_M) and no host sync (no ``.item()``/``nonzero``): the
   grid is the upper bound of blocks and blocks past the real padded count exit at once.
2. ``_moe_gemm_kernel`` over (row blocks, N tiles): gathers each row's input by its sorted index,
   multiplies by the block's expert weight tile (fp32 accumulation) and scatters the result back
   to the row's slot. Run twice:
   - gate/up: A = x [T, H] (row -> token ``row // K``), two accumulators against w_gate and w_up
     [E, I, H], ``act(gate) * up`` in the epilogue (the activation is fused, so no [T*K, 2I]
     buffer and no separate silu_and_mul launch) -> h [T*K, I];
   - down: A = h, weights w_down [E, H, I], routing weight multiplied in -> y [T*K, H].
3. ``y.view(T, K, H).sum(1)`` -> [T, H].

Weight layout is backends_torch/layers/moe.py's ``Experts``: w_gate/w_up [E, I, H], w_down
[E, H, I] (nn.Linear [out, in] per expert). Shared experts stay outside (as in the reference).
fp16/bf16/fp32 inputs, fp32 accumulation; fp32 dots use IEEE precision (no TF32) so fp32 matches
the torch reference closely. Under the CPU interpreter bf16 dot operands are upcast (see
``_common.upcast_dot``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device, check_dtype, interpret_mode, upcast_dot
from .activation import ACT_CODES, apply_activation


@dataclass(frozen=True)
class MoEConfig:
    """Tile sizes of one launch. BLOCK_M is also the expert-run padding of ``moe_align``."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# (largest T of the bucket, config): the first bucket with T <= bound applies. Not yet tuned on a
# GPU (no device time when written): decode buckets use BLOCK_M 16 (few rows per expert, bound by
# streaming expert weights), prefill buckets larger row tiles. Gate/up keeps two accumulators and
# loads two weight tiles per step, so its register tile is 2 * BLOCK_M * BLOCK_N and its shared
# memory per pipeline stage (BLOCK_M + 2 * BLOCK_N) * BLOCK_K elements (16-bit: <= 82 KB here).
MOE_CONFIGS: tuple[tuple[int, MoEConfig], ...] = (
    (32, MoEConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=4)),
    (256, MoEConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)),
    (2048, MoEConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)),
    (1 << 62, MoEConfig(block_m=64, block_n=128, block_k=32, num_warps=8, num_stages=4)),
)
# Pipeline stages are cut to keep shared memory under this (fits consumer GPUs' ~100 KB too).
SMEM_BUDGET = 96 * 1024
# The interpreter runs every program in numpy: small tiles are faster there.
INTERPRET_CONFIG = MoEConfig(block_m=16, block_n=32, block_k=32, num_warps=1, num_stages=1)


def get_moe_config(num_tokens: int, interpret: bool = False, elem_bytes: int = 2) -> MoEConfig:
    """Tile config for a batch of ``num_tokens`` tokens (M bucket lookup in ``MOE_CONFIGS``),
    with num_stages lowered so the gate/up pipeline fits SMEM_BUDGET at ``elem_bytes`` (4: fp32)."""
    if interpret:
        return INTERPRET_CONFIG
    cfg = next((c for bound, c in MOE_CONFIGS if num_tokens <= bound), MOE_CONFIGS[-1][1])
    per_stage = (cfg.block_m + 2 * cfg.block_n) * cfg.block_k * elem_bytes
    stages = max(1, min(cfg.num_stages, SMEM_BUDGET // per_stage))
    return cfg if stages == cfg.num_stages else replace(cfg, num_stages=stages)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, choice) rows by expert, each expert's run padded to a multiple of block_m.

    topk_ids [T, K] (ints in [0, E)) -> (sorted_ids int32 [P], expert_ids int32 [P // block_m],
    num_padded int32 [1]). ``sorted_ids[j]`` is a flat row ``t * K + k`` or the padding sentinel
    ``T * K``; rows of one expert keep their original order (stable). Block b (rows
    ``b*block_m .. (b+1)*block_m``) belongs to expert ``expert_ids[b]``; only the first
    ``num_padded[0]`` slots are used. P is the static upper bound ``T*K + min(E, T*K) *
    (block_m - 1)`` rounded up to block_m; experts with no rows get no block.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    dev = flat.device
    cap = n + min(num_experts, n) * (block_m - 1)
    cap = -(-cap // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    sorted_exp = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_exp]
    dest = starts[sorted_exp] + rank
    sorted_ids = torch.full((cap,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, cap, block_m, device=dev)
    # Blocks past the used count map to E (clamped); the kernel skips them before reading it.
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), ends[-1:].to(torch.int32)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    w2_ptr,
    out_ptr,
    topk_w_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    N,
    K,
    num_rows,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    MUL_ROUTED: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[row, n] = sum_k A[row // A_ROW_DIV, k] * W[e, n, k] for the rows of one sorted block.

    GATED: act(A @ W^T) * (A @ W2^T). MUL_ROUTED: times topk_weights.flat[row]. w2_ptr has
    w_ptr's strides. Padding rows (sorted id == num_rows) are neither read nor written.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids_ptr + offs_m)
    row_mask = rows < num_rows
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (rows // A_ROW_DIV).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    # W tile [BLOCK_K, BLOCK_N] of expert e's [N, K] matrix (int64: E*N*K may pass 2^31).
    w_off = (
        expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    )
    w_ptrs = w_ptr + w_off
    w2_ptrs = w2_ptr + w_off
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
        if GATED:
            w2 = tl.load(w2_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if UPCAST:
                w2 = w2.to(tl.float32)
            acc2 = tl.dot(a, w2, acc2, input_precision=DOT_PREC)
            w2_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if GATED:
        acc = apply_activation(acc, ACT) * acc2
    if MUL_ROUTED:
        rw = tl.load(topk_w_ptr + rows, mask=row_mask, other=0.0)
        acc = acc * rw[:, None]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def _launch_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    w2: torch.Tensor | None,
    out: torch.Tensor,
    topk_weights: torch.Tensor | None,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_rows: int,
    a_row_div: int,
    act: int,
    cfg: MoEConfig,
) -> None:
    sorted_ids, expert_ids, num_padded = align
    _, n, k = w.shape
    grid = (expert_ids.numel(), triton.cdiv(n, cfg.block_n))
    _moe_gemm_kernel[grid](
        a, w, w if w2 is None else w2, out, out if topk_weights is None else topk_weights,
        sorted_ids, expert_ids, num_padded,
        n, k, num_rows,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        A_ROW_DIV=a_row_div, GATED=w2 is not None, ACT=act, MUL_ROUTED=topk_weights is not None,
        UPCAST=upcast_dot(a.dtype), DOT_PREC="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def fused_experts(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """sum_k w[t,k] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = ids[t,k] (Triton).

    x [T, H]; w_gate/w_up [E, I, H]; w_down [E, H, I]; topk_weights [T, K] (any float dtype,
    used in fp32); topk_ids [T, K] ints in [0, E) -> [T, H] in x.dtype. The signature of
    ``backends_torch.layers.moe.fused_experts_ref`` (registered there as moe_impl "triton");
    ``config`` overrides the tile table. Intermediates h [T*K, I] and y [T*K, H] are in x.dtype.
    """
    name = "fused_experts"
    if activation not in ACT_CODES:
        raise ValueError(f"{name}: unsupported activation {activation!r}; known: {list(ACT_CODES)}")
    if x.ndim != 2 or w_gate.ndim != 3 or topk_ids.ndim != 2:
        raise ValueError(f"{name}: x must be [T, H], weights [E, ., .], topk_ids [T, K]")
    t, h = x.shape
    e, inter, h_w = w_gate.shape
    if h_w != h or w_up.shape != w_gate.shape or tuple(w_down.shape) != (e, h, inter):
        raise ValueError(
            f"{name}: want w_gate/w_up [E, I, H={h}] and w_down [E, H, I]; got "
            f"{tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}"
        )
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != t:
        raise ValueError(
            f"{name}: topk_weights/ids must both be [T={t}, K], got "
            f"{tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}"
        )
    check_dtype(name, x, FLOAT_DTYPES)
    for wt in (w_gate, w_up, w_down):
        if wt.dtype != x.dtype:
            raise ValueError(f"{name}: weights must be {x.dtype}, got {wt.dtype}")
    check_device(name, x, w_gate, w_up, w_down, topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    if t == 0 or top_k == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w_gate, w_up, w_down = (
        wt if wt.stride(-1) == 1 else wt.contiguous() for wt in (w_gate, w_up, w_down)
    )
    if w_up.stride() != w_gate.stride():  # the kernel reads both with one set of strides
        w_gate, w_up = w_gate.contiguous(), w_up.contiguous()
    interpret = x.device.type == "cpu" or interpret_mode()
    cfg = config or get_moe_config(t, interpret, x.element_size())
    rows = t * top_k
    align = moe_align(topk_ids, e, cfg.block_m)
    hidden = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    _launch_gemm(x, w_gate, w_up, hidden, None, align, rows, top_k, ACT_CODES[activation], cfg)
    y = torch.empty(rows, h, dtype=x.dtype, device=x.device)
    rw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _launch_gemm(hidden, w_down, None, y, rw, align, rows, 1, 0, cfg)
    return y.view(t, top_k, h).sum(dim=1) if top_k > 1 else y.view(t, h)
