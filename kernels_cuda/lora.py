"""Batched multi-LoRA kernels (Triton; punica-style shrink / expand) + torch references.

A step's tokens each use one adapter slot (-1: the base model, no LoRA). The runner sorts the
token indices by slot once per step (`lora_token_groups`): `sorted_idx` [T] (token ids grouped
by slot), `starts` / `counts` [L] (each slot's range in sorted_idx). Every kernel's grid is
(cdiv(T, BLOCK_M), column blocks, L): program (m, n, l) takes rows [m * BLOCK_M, ...) of slot l's
tokens (exits at once past its count), so each adapter's weights are read once per tile of its
tokens and the grid depends on T only (CUDA-graph capturable with static index buffers).

- `lora_shrink(x [T, K], a [L, R, K], groups) -> s [S, T, R]` float32 partial sums over S
  slices of K: s.sum(0)[t] = A[slot_t] @ x[t] (rows of base tokens are left unwritten: expand
  never reads them). S (`shrink_splits`) depends on T, K and L only (one per CUDA-graph bucket):
  a decode step has one token or a few per adapter, so without a K split one program per adapter
  walked all of K alone (batch-1 LoRA decode ran at 0.44x of the base model on the H200); the
  expand kernel sums the S partials while loading s, so the result is deterministic (no atomics).
- `lora_expand(s, b [L, N, R], y [T, >= off + N], groups, s_offset, y_offset)`:
  y[t, off:off+N] += B[slot_t] @ s.sum(0)[t, s_offset:s_offset+R], in place (s [T, R'] or
  [S, T, R']). The column offsets let a
  fused qkv / gate_up output take each part's delta, and one shrink serve every part (A of
  the parts stacked along R).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device, check_dtype, next_pow2


@dataclass
class LoRAGroups:
    """Tokens of one step grouped by adapter slot (device tensors, int32)."""

    sorted_idx: torch.Tensor  # [>= T]: token indices, slot 0's first, then slot 1's, ...
    starts: torch.Tensor  # [L]: slot l's tokens are sorted_idx[starts[l] : starts[l] + counts[l]]
    counts: torch.Tensor  # [L]
    num_tokens: int  # T (the grid's row extent)


def lora_token_groups_np(token_slots: np.ndarray, num_slots: int) -> np.ndarray:
    """Host side of `LoRAGroups`: int32 [T + 2L] = sorted_idx [T] | starts [L] | counts [L]
    (base tokens, slot -1, are left out of sorted_idx: its tail past sum(counts) is unused)."""
    slots = np.asarray(token_slots, dtype=np.int64)
    t = slots.shape[0]
    out = np.zeros(t + 2 * num_slots, dtype=np.int32)
    if t == 0:
        return out
    if slots.max(initial=-1) >= num_slots:
        raise ValueError(f"token slot {int(slots.max())} out of range (num_slots {num_slots})")
    lora = slots >= 0
    order = np.argsort(np.where(lora, slots, num_slots), kind="stable")
    counts = np.bincount(slots[lora], minlength=num_slots)
    starts = np.zeros(num_slots, np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    n = int(counts.sum())
    out[:n] = order[:n]
    out[t : t + num_slots] = starts
    out[t + num_slots :] = counts
    return out


def lora_token_groups(token_slots: torch.Tensor | np.ndarray, num_slots: int) -> LoRAGroups:
    """`LoRAGroups` of a step (tests and eager callers; the runner uploads the packed array)."""
    slots = np.asarray(token_slots.cpu() if torch.is_tensor(token_slots) else token_slots)
    dev = token_slots.device if torch.is_tensor(token_slots) else torch.device("cpu")
    packed = torch.from_numpy(lora_token_groups_np(slots, num_slots)).to(dev)
    t = slots.shape[0]
    return LoRAGroups(packed[:t], packed[t : t + num_slots], packed[t + num_slots :], t)


@triton.jit
def _slot_tokens(idx_ptr, start_ptr, slot, count, pid_m, BLOCK_M: tl.constexpr):
    """Token ids (int64 [BLOCK_M]) of rows [pid_m * BLOCK_M, ...) of slot `slot`'s group (of
    `count` tokens) and their mask: what one shrink / expand program works on."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < count
    start = tl.load(start_ptr + slot)
    tok = tl.load(idx_ptr + start + rows, mask=mask_m, other=0).to(tl.int64)
    return tok, mask_m


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, s_ptr, idx_ptr, start_ptr, count_ptr,
    K, R, K_PER_SPLIT, NUM_R_BLOCKS,
    stride_xt, stride_al, stride_ar, stride_ss, stride_st,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # Program (m, split * NUM_R_BLOCKS + r, slot): rows m of the slot's tokens, R block r,
    # the K slice [split * K_PER_SPLIT, (split + 1) * K_PER_SPLIT) into partial s[split].
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1) % NUM_R_BLOCKS
    pid_s = tl.program_id(1) // NUM_R_BLOCKS
    slot = tl.program_id(2)
    count = tl.load(count_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    tok, mask_m = _slot_tokens(idx_ptr, start_ptr, slot, count, pid_m, BLOCK_M)
    rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rr < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * stride_al
    k_lo = pid_s * K_PER_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        mask_k = kk < K
        x = tl.load(x_ptr + tok[:, None] * stride_xt + kk[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
        a = tl.load(a_base + rr[None, :] * stride_ar + kk[:, None],
                    mask=mask_r[None, :] & mask_k[:, None], other=0.0)  # [BK, BR]  # fmt: skip
        if IEEE:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, a.to(x.dtype))
    tl.store(s_ptr + pid_s * stride_ss + tok[:, None] * stride_st + rr[None, :], acc,
             mask=mask_m[:, None] & mask_r[None, :])  # fmt: skip


@triton.jit
def _expand_kernel(
    s_ptr, b_ptr, y_ptr, idx_ptr, start_ptr, count_ptr,
    N, R, SPLITS,
    stride_ss, stride_st, stride_bl, stride_bn, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    count = tl.load(count_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    tok, mask_m = _slot_tokens(idx_ptr, start_ptr, slot, count, pid_m, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    mask_r = rr < R
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = nn < N
    s_ptrs = s_ptr + tok[:, None] * stride_st + rr[None, :]
    mask_s = mask_m[:, None] & mask_r[None, :]
    s = tl.load(s_ptrs, mask=mask_s, other=0.0)  # [BM, BR] fp32: the shrink's K partials summed
    for i in range(1, SPLITS):
        s += tl.load(s_ptrs + i * stride_ss, mask=mask_s, other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + nn[None, :] * stride_bn + rr[:, None],
                mask=mask_n[None, :] & mask_r[:, None], other=0.0)  # [BR, BN]  # fmt: skip
    if IEEE:
        d = tl.dot(s, b.to(tl.float32), input_precision="ieee")
    else:
        d = tl.dot(s.to(b.dtype), b)
    y_ptrs = y_ptr + tok[:, None] * stride_yt + nn[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + d).to(y_ptr.dtype.element_ty), mask=mask)


def _block_m(t: int) -> int:
    return 16 if t <= 16 else 32 if t <= 512 else 64


# Programs a shrink aims to keep busy (about two per SM of an H100 / H200) and the fewest K
# elements one program walks (a shorter slice costs more in partial sums than it saves).
_SHRINK_TARGET_PROGRAMS = 256
_SHRINK_MIN_K_PER_SPLIT = 256


def shrink_splits(t: int, k: int, num_slots: int) -> int:
    """K slices of a shrink over T tokens (a function of the shapes only, so a CUDA graph's
    bucket always gets the same): enough programs to fill the GPU when few tokens per adapter
    leave most of the (m, r, slot) grid idle, at most K / 256 slices."""
    # (m, slot) programs that can hold tokens: each slot's tokens straddle at most one extra
    # row block, and every such program holds at least one token.
    busy = max(1, min(t, -(-t // _block_m(t)) + num_slots - 1))
    return max(1, min(_SHRINK_TARGET_PROGRAMS // busy, k // _SHRINK_MIN_K_PER_SPLIT))


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, groups: LoRAGroups, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] (model dtype), a [L, R, K] -> s [S, T, R] float32 K partials (S =
    `shrink_splits(T, K, L)`; see the module docstring). `out`: a float32 [S, >= T, >= R]
    buffer to write into."""
    name = "lora_shrink"
    if x.ndim != 2 or a.ndim != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"{name}: x [T, K] and a [L, R, K] expected, got {tuple(x.shape)}, "
                         f"{tuple(a.shape)}")  # fmt: skip
    check_dtype(name, x, FLOAT_DTYPES)
    check_device(name, x, a, groups.sorted_idx)
    if x.stride(1) != 1 or not a.is_contiguous():
        raise ValueError(f"{name}: x rows and a must be contiguous")
    t, k = x.shape
    num_slots, r, _ = a.shape
    splits = shrink_splits(t, k, num_slots)
    if out is None:
        out = torch.empty((splits, t, r), dtype=torch.float32, device=x.device)
    elif (out.ndim != 3 or out.shape[0] != splits or out.shape[1] < t or out.shape[2] < r
          or out.dtype != torch.float32 or out.stride(2) != 1):  # fmt: skip
        raise ValueError(f"{name}: out must be float32 [{splits}, >= {t}, >= {r}], got "
                         f"{tuple(out.shape)}")  # fmt: skip
    if t == 0:
        return out
    bm, br = _block_m(t), max(16, min(64, next_pow2(r)))
    bk = 64 if k >= 64 else max(16, next_pow2(k))
    k_per = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    nr = triton.cdiv(r, br)
    grid = (triton.cdiv(t, bm), nr * splits, num_slots)
    _shrink_kernel[grid](
        x, a, out, groups.sorted_idx, groups.starts, groups.counts, k, r, k_per, nr,
        x.stride(0), a.stride(0), a.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=bm, BLOCK_R=br, BLOCK_K=bk, IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return out


def lora_expand(
    s: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    groups: LoRAGroups,
    s_offset: int = 0,
    y_offset: int = 0,
) -> torch.Tensor:
    """y[t, y_offset : y_offset + N] += B[slot_t] @ s.sum(0)[t, s_offset : s_offset + R] for
    every token with a slot; s float32 [T, >= s_offset + R] or the shrink's K partials
    [S, T, >= s_offset + R], b [L, N, R], y [T, >= y_offset + N] (in place, returned)."""
    name = "lora_expand"
    if s.ndim == 2:
        s = s.unsqueeze(0)
    if s.ndim != 3 or b.ndim != 3 or y.ndim != 2:
        raise ValueError(f"{name}: s [T, R'] or [S, T, R'], b [L, N, R], y [T, N'] expected")
    num_slots, n, r = b.shape
    t = y.shape[0]
    if s.shape[1] < t or s.shape[2] < s_offset + r or y.shape[1] < y_offset + n:
        raise ValueError(
            f"{name}: s {tuple(s.shape)} / y {tuple(y.shape)} too small for b {tuple(b.shape)} "
            f"at offsets {s_offset} / {y_offset}"
        )
    check_dtype(name, y, FLOAT_DTYPES)
    check_device(name, s, b, y, groups.sorted_idx)
    if s.dtype != torch.float32 or s.stride(2) != 1 or y.stride(1) != 1 or not b.is_contiguous():
        raise ValueError(f"{name}: s must be float32, and s / y rows and b contiguous")
    if t == 0:
        return y
    bm, br = _block_m(t), max(16, next_pow2(r))
    bn = 64 if n >= 64 else max(16, next_pow2(n))
    grid = (triton.cdiv(t, bm), triton.cdiv(n, bn), num_slots)
    _expand_kernel[grid](
        s[:, :, s_offset:], b, y[:, y_offset:], groups.sorted_idx, groups.starts, groups.counts,
        n, r, s.shape[0], s.stride(0), s.stride(1), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br, IEEE=y.dtype == torch.float32,
    )  # fmt: skip
    return y


# ---- references ------------------------------------------------------------------------------


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """s [T, R] float32: A[slot_t] @ x[t] (zero rows for slot -1). Plain torch, any device."""
    s = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)
        s[rows] = x[rows].float() @ a[slot].float().T
    return s


def lora_expand_ref(
    s: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    token_slots: torch.Tensor,
    s_offset: int = 0,
    y_offset: int = 0,
) -> torch.Tensor:
    """y[t, y_offset : y_offset + N] += B[slot_t] @ s[t, s_offset : s_offset + R] (in place)."""
    n, r = b.shape[1], b.shape[2]
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)
        d = s[rows, s_offset : s_offset + r] @ b[slot].float().T
        y[rows, y_offset : y_offset + n] = (y[rows, y_offset : y_offset + n].float() + d).to(
            y.dtype
        )
    return y
