"""Long prefill chunks through cuDNN's fused attention (torch SDPA on CUDA) over the paged cache.

The unified Triton kernel (paged_attention.py) reads K / V through the block table tile by tile;
on the H100 it spent 592 ms of a 30,000-token prompt's prefill in attention against 398 ms for
transformers' cuDNN calls on the same prompt (bench/gpu_probes/prefill_profile.py, 2026-12-05).
For a chunk of at least `min_tokens` queries, gathering its context into contiguous K / V (one
copy of 2 * context * Hkv * D elements per layer, ~1% of the attention's time at 30k) costs
little, so those sequences attend through SDPA without repeating K / V for GQA: a fresh prompt as
one causal call; a chunk over a cached prefix (its queries are the last q_len positions of its
context) by `chunk_route`: on CUDA as two cuDNN calls merged by their log-sum-exp
(`split_attention`), since torch runs a bottom-right causal call on FlashAttention-2 at about
half cuDNN's rate. The other sequences of the step (decodes, short chunks) keep the Triton
kernel, packed into a launch of their own.

Layouts as kernels_cuda.paged_attention: q [T, Hq, D]; caches [N, S, Hkv, D] (or int8 / fp8
codes with float32 scales [N, S, Hkv], dequantized to q's dtype by the gather); query_start_loc
[B + 1], seq_lens [B], block_tables [B, M] int32. Only for layers without a sliding window,
soft-cap or attention chunk (the caller keeps the Triton kernel for those).

No device->host synchronization: every size the split needs is a host int of the step's
metadata. Never part of a CUDA graph (decode steps have one query per sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention.bias import causal_lower_right

from .kv_quant import gather_context


class HostBatch(Protocol):
    """The step metadata the split reads (backends_torch's AttentionMetadata is one)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc_host: list[int]
    seq_lens_host: list[int]


@dataclass(frozen=True)
class RestBatch:
    """The sequences left to the Triton kernel, packed (a `paged_attention.PagedBatch`).

    rows: int64 [T_rest], the q rows of these sequences in the step's order; their queries are
    q[rows], their outputs go back to out[rows]."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    rows: torch.Tensor
    num_kv_splits: int | None = None


@dataclass(frozen=True)
class SdpaSplit:
    """How one step's batch divides between SDPA and the Triton kernel (built once per step).

    long: (sequence index b, first q row, end q row, context length) of each SDPA sequence.
    rest: the other sequences, or None when every sequence is long.
    num_tokens: query_start_loc[B]; rows of q at or past it are padding (zeros in the output).
    """

    long: tuple[tuple[int, int, int, int], ...]
    rest: RestBatch | None
    num_tokens: int


def plan_sdpa_split(md: HostBatch, min_tokens: int) -> SdpaSplit | None:
    """The split of `md`'s batch: sequences with >= min_tokens queries go to SDPA; None when
    there are none (the whole batch stays one Triton launch)."""
    qsl, seq = md.query_start_loc_host, md.seq_lens_host
    long: list[tuple[int, int, int, int]] = []
    rest: list[int] = []
    for b, kv_len in enumerate(seq):
        q0, q1 = qsl[b], qsl[b + 1]
        if q1 - q0 >= min_tokens:
            long.append((b, q0, q1, kv_len))
        elif q1 > q0:
            rest.append(b)
    if not long:
        return None
    return SdpaSplit(tuple(long), _rest_batch(md, rest) if rest else None, qsl[len(seq)])


def _rest_batch(md: HostBatch, keep: list[int]) -> RestBatch:
    """The sequences `keep` of md as a batch of their own (one host->device copy each of the
    index, the packed query_start_loc and the q rows)."""
    qsl, seq = md.query_start_loc_host, md.seq_lens_host
    dev = md.seq_lens.device
    q_lens = [qsl[b + 1] - qsl[b] for b in keep]
    sub_qsl = [0]
    for n in q_lens:
        sub_qsl.append(sub_qsl[-1] + n)
    rows = torch.cat([torch.arange(qsl[b], qsl[b + 1]) for b in keep])
    idx = torch.tensor(keep, dtype=torch.long).to(dev, non_blocking=True)
    return RestBatch(
        query_start_loc=torch.tensor(sub_qsl, dtype=torch.int32).to(dev, non_blocking=True),
        seq_lens=md.seq_lens.index_select(0, idx),
        block_tables=md.block_tables.index_select(0, idx),
        max_query_len=max(q_lens),
        max_seq_len=max(seq[b] for b in keep),
        rows=rows.to(dev, non_blocking=True),
    )


# A chunk over a cached prefix (q_len < kv_len): torch runs its bottom-right causal call on
# FlashAttention-2, while a square causal call takes the faster cuDNN kernel. On the H100
# (bench/gpu_probes/chunk_attention.py, 2026-12-05, eighteenth session; 13,616 queries over
# 30,000 keys, 32 / 8 heads, D 128, bf16): lower right 14.54 ms (356 TFLOP/s of the chunk's own
# work), the square call of all 30,000 positions 11.42 ms (646 TFLOP/s), the chunk padded in
# front with zero queries to that square call 11.57 ms. Padding pays the prefix's own triangle
# again, so it is taken where the square call's pairs, at SQUARE_SPEEDUP times the rate, cost
# less than the chunk's own pairs: here 450M against 316M query-key pairs.
SQUARE_SPEEDUP = 1.8
# How a chunk over a cached prefix attends on CUDA: "split" = the prefix's keys without a mask
# and the chunk's own square causal block, two cuDNN calls merged by their log-sum-exp (every
# query-key pair once, each call of a shape cuDNN runs at full rate: `split_attention`); "pad"
# = the padded square call where `pad_to_square` takes it, else bottom-right causal SDPA.
CHUNK_ROUTE = "split"


def chunk_route(q_len: int, kv_len: int, cuda: bool, cudnn: bool = True) -> str:
    """How `sdpa_prefill` attends a chunk of q_len queries ending a kv_len context: "causal"
    (the whole context is new), "split", "pad" or "lower_right" (see CHUNK_ROUTE; the CPU's
    math kernel gains from neither split nor padding). cudnn: the device runs cuDNN's fused
    attention (`cudnn_attention_ok`); without it the split is not taken."""
    if q_len >= kv_len:
        return "causal"
    if cuda and cudnn and CHUNK_ROUTE == "split":
        return "split"
    return "pad" if pad_to_square(q_len, kv_len, cuda) else "lower_right"


_CUDNN_OK: dict[torch.device, bool] = {}


def cudnn_attention_ok(device: torch.device) -> bool:
    """Whether the split route's cuDNN op runs on `device`: an NVIDIA GPU (not ROCm) of compute
    capability 8.0 or newer (cuDNN's fused attention needs it) with cuDNN and the aten op."""
    ok = _CUDNN_OK.get(device)
    if ok is None:
        ok = (
            device.type == "cuda"
            and torch.version.hip is None
            and torch.backends.cudnn.is_available()
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
            and torch.cuda.get_device_capability(device)[0] >= 8
        )
        _CUDNN_OK[device] = ok
    return ok


def split_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `split_attention` runs these queries: a device where `cudnn_attention_ok`, 16-bit
    queries, a head size that is a multiple of 8 and at most 128 (256 on sm_90 and newer), the
    cuDNN fused attention's limits. The split has no fallback inside (the private op raises),
    so anything else takes the public SDPA routes, which choose among their kernels."""
    if dtype not in (torch.float16, torch.bfloat16) or head_dim % 8:
        return False
    if not cudnn_attention_ok(device):
        return False
    return head_dim <= (256 if torch.cuda.get_device_capability(device)[0] >= 9 else 128)


def pad_to_square(q_len: int, kv_len: int, cuda: bool) -> bool:
    """Whether a chunk of q_len queries ending a kv_len context attends as a padded square
    causal call (CUDA only: the CPU's math kernel gains nothing from it)."""
    if not cuda or q_len >= kv_len:
        return False
    own = q_len * (kv_len - q_len) + q_len * (q_len + 1) / 2
    return kv_len * (kv_len + 1) / 2 <= SQUARE_SPEEDUP * own


def max_padded_len(max_chunk: int, max_len: int) -> int:
    """The longest context (<= max_len) whose chunk of at most max_chunk queries `pad_to_square`
    pads: the padded call's query rows are bounded by it, not by max_len (padding needs the
    chunk to be about a third of its context or more)."""
    q = min(max_chunk, max_len - 1)  # a padded chunk is shorter than its context
    if q < 1 or not pad_to_square(q, q + 1, True):
        return 0
    lo, hi = q + 1, max_len
    while lo < hi:  # the largest kv_len with pad_to_square(q, kv_len) (monotone in kv_len)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if pad_to_square(q, mid, True) else (lo, mid - 1)
    return lo


# The attention call's own scratch beyond the buffers `call_bytes` names (its float32
# log-sum-exp, its workspace): 4 x 4 bytes per head and row of the longer side, plus 1 MiB.
# Fitted on the GPU test's three shapes (H100, torch 2.11, 2026-12-05): allocated above the
# named buffers 1.5 KB (2048 / 2048), 2.0 MB (a 3000-query chunk of 5000, padded) and 0.62 MB
# (1024 of 12000, masked); this term gives 2.1, 3.6 and 7.2 MB there.
SCRATCH_BYTES_PER_HEAD_ROW = 16
SCRATCH_FIXED_BYTES = 1 << 20


def call_bytes(
    q_len: int,
    kv_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    elem: int,
    quantized_cache: bool,
    route: str,
) -> int:
    """Bytes one `sdpa_prefill` call of a q_len-query chunk ending a kv_len context allocates
    beyond its inputs, by `chunk_route`; elem: bytes of q's dtype.

    Counted: the gathered K and V [kv_len, Hkv, D] (a quantized cache's gather also holds the
    codes and a float32 product of one of them); then by route: "causal" / "lower_right" the
    output [q_len, Hq, D]; "pad" the padded queries and the square output, each [kv_len, Hq,
    D]; "split" both calls' outputs [q_len, Hq, D] (`merge_lse` writes into the step's output);
    and the kernel's scratch (SCRATCH_BYTES_PER_HEAD_ROW, SCRATCH_FIXED_BYTES). No K / V
    repeated to the query heads on any route: the GPU test measured none."""
    kv = num_kv_heads * head_dim
    qrow = num_heads * head_dim * elem
    gathered = 2 * kv_len * kv * elem + (kv_len * kv * 5 if quantized_cache else 0)
    if route == "pad":
        own = 2 * kv_len * qrow
    elif route == "split":  # both calls' outputs (the merge writes into out)
        own = 2 * q_len * qrow
    else:
        own = q_len * qrow
    scratch = SCRATCH_BYTES_PER_HEAD_ROW * num_heads * max(q_len, kv_len) + SCRATCH_FIXED_BYTES
    return gathered + own + scratch


def transient_bytes(
    max_chunk: int,
    max_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    elem: int,
    quantized_cache: bool,
    cudnn: bool = True,
) -> int:
    """Peak bytes `sdpa_prefill` allocates beyond the step's own activations, for one layer (the
    allocator reuses them layer after layer), at chunks of <= max_chunk queries over contexts
    of <= max_len tokens, by the routes `chunk_route` takes on CUDA (cudnn: as it is given):
    the largest `call_bytes` of the longest call of each route (a padded one's context bounded
    by `max_padded_len`). The KV-cache profiling forward runs one max_chunk-token prompt, which
    never takes this path at long contexts, so the runner reserves this on top of its peak."""
    shape = (num_heads, num_kv_heads, head_dim, elem, quantized_cache)
    q = min(max_chunk, max_len)
    worst = call_bytes(q, max_len, *shape, route="causal")
    if max_len > 1 and cudnn and CHUNK_ROUTE == "split":  # every chunk over a prefix
        worst = max(worst, call_bytes(min(q, max_len - 1), max_len, *shape, route="split"))
    elif max_len > 1:
        worst = max(worst, call_bytes(min(q, max_len - 1), max_len, *shape, route="lower_right"))
        lp = max_padded_len(max_chunk, max_len)
        if lp:
            worst = max(worst, call_bytes(min(max_chunk, lp - 1), lp, *shape, route="pad"))
    return worst


def sdpa_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    long: tuple[tuple[int, int, int, int], ...],
    sm_scale: float,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Attention of each `long` sequence (SdpaSplit.long) into its rows of `out` [T, Hq, D]:
    the chunk's q_len queries are the last positions of its kv_len-token context, causal."""
    cudnn = q.is_cuda and split_supported(q.device, q.dtype, q.shape[2])
    for b, q0, q1, kv_len in long:
        k = gather_context(k_cache, k_scale, block_tables[b], kv_len, q.dtype)
        v = gather_context(v_cache, v_scale, block_tables[b], kv_len, q.dtype)
        # [L, H, D] -> [1, H, L, D] views: the memory stays [L, H, D], the layout flash reads.
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q[q0:q1], k, v))
        q_len = q1 - q0
        route = chunk_route(q_len, kv_len, q.is_cuda, cudnn)
        if route == "causal":  # the whole context is new: plain causal
            o = F.scaled_dot_product_attention(
                qb, kb, vb, is_causal=True, scale=sm_scale, enable_gqa=True
            )
        elif route == "split":
            split_attention(qb, kb, vb, sm_scale, out[q0:q1])
            continue
        elif route == "pad":
            # Zero queries in front make the call square, where causal top left = bottom
            # right and the square kernel runs; their rows are dropped.
            qp = q.new_empty(kv_len, q.shape[1], q.shape[2])  # one buffer, not zeros + cat
            qp[: kv_len - q_len].zero_()
            qp[kv_len - q_len :] = q[q0:q1]
            o = F.scaled_dot_product_attention(
                qp.transpose(0, 1).unsqueeze(0), kb, vb, is_causal=True, scale=sm_scale,
                enable_gqa=True,
            )[:, :, kv_len - q_len :]  # fmt: skip
            del qp
        else:  # a chunk over a cached prefix: causal aligned to the last key
            o = F.scaled_dot_product_attention(
                qb, kb, vb, attn_mask=causal_lower_right(q_len, kv_len), scale=sm_scale,
                enable_gqa=True,
            )  # fmt: skip
        out[q0:q1] = o[0].transpose(0, 1)


def lse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, Hq, Lq, D], k / v [1, Hkv, Lk, D] (causal: Lq == Lk) -> (output [1, Hq, Lq, D],
    its natural log-sum-exp float32 [1, Hq, Lq]). CUDA: cuDNN's fused attention (the private
    aten op that returns the log-sum-exp), GQA by the heads' shapes without repeating K / V (the
    H100 probe: 9.16 ms against 9.41 with them repeated; bench/RESULTS.md); elsewhere the same
    in plain torch (tests)."""
    hq, hkv = q.shape[1], k.shape[1]
    if q.is_cuda:
        o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )[:2]
        lse = lse.reshape(lse.shape[0], -1, lse.shape[-2] if lse.shape[-1] == 1 else lse.shape[-1])
        if lse.shape[1] != hq:  # [1, Lq, H] layout
            lse = lse.transpose(1, 2)
        return o, lse.float()
    if hkv != hq:
        k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[2]
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.exp(s - lse[..., None]), v.float()).to(q.dtype)
    return o, lse


@triton.jit
def _merge_lse_kernel(
    o1_ptr,
    o2_ptr,
    l1_ptr,
    l2_ptr,
    out_ptr,
    s1h,
    s1l,
    s2h,
    s2l,
    sl1h,
    sl1l,
    sl2h,
    sl2l,
    soh,
    sol,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One query row, BLOCK_H heads: out = (o1 e^l1 + o2 e^l2) / (e^l1 + e^l2), float32 math."""
    row = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hm = h < num_heads
    m2 = hm[:, None] & (d[None, :] < head_dim)
    a = tl.load(l1_ptr + h * sl1h + row * sl1l, mask=hm, other=0.0)
    b = tl.load(l2_ptr + h * sl2h + row * sl2l, mask=hm, other=0.0)
    top = tl.maximum(a, b)
    wa = tl.exp(a - top)
    wb = tl.exp(b - top)
    total = wa + wb
    x = tl.load(o1_ptr + h[:, None] * s1h + row * s1l + d[None, :], mask=m2, other=0.0)
    y = tl.load(o2_ptr + h[:, None] * s2h + row * s2l + d[None, :], mask=m2, other=0.0)
    r = (x.to(tl.float32) * (wa / total)[:, None]) + (y.to(tl.float32) * (wb / total)[:, None])
    tl.store(out_ptr + row * sol + h[:, None] * soh + d[None, :], r.to(out_ptr.dtype.element_ty),
             mask=m2)  # fmt: skip


def merge_lse(
    o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor, out: torch.Tensor
) -> None:
    """Two attention outputs over disjoint key sets -> the one over their union, in one pass:
    o1 / o2 [1, H, Lq, D] (any strides, D contiguous), their log-sum-exps l1 / l2 float32
    [1, H, Lq], out [Lq, H, D] (D contiguous). Both key sets are non-empty for every row
    (finite log-sum-exps)."""
    _, h, lq, d = o1.shape
    for name, t in (("o1", o1), ("o2", o2), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"merge_lse: {name}'s last dim must be contiguous, got {t.stride()}")
    if lq == 0:
        return
    block_h = min(8, triton.next_power_of_2(h))
    grid = (lq, triton.cdiv(h, block_h))
    _merge_lse_kernel[grid](
        o1, o2, l1, l2, out, o1.stride(1), o1.stride(2), o2.stride(1), o2.stride(2),
        l1.stride(1), l1.stride(2), l2.stride(1), l2.stride(2), out.stride(1), out.stride(0),
        h, d, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d), num_warps=4,
    )  # fmt: skip


def split_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    """A chunk over a cached prefix as two calls merged by their log-sum-exp: q [1, Hq, Lq, D]
    the last Lq positions of the k / v [1, Hkv, L, D] context. The queries see the L - Lq
    prefix keys without a mask and their own Lq keys causally (square: top left = bottom
    right), so every query-key pair is computed once; out [Lq, Hq, D] gets the softmax over
    both key sets (`merge_lse`, one fused pass)."""
    p = k.shape[2] - q.shape[2]
    o1, l1 = lse_attention(q, k[:, :, :p], v[:, :, :p], False, scale)
    o2, l2 = lse_attention(q, k[:, :, p:], v[:, :, p:], True, scale)
    merge_lse(o1, l1, o2, l2, out)
