"""Unified paged attention (Triton): one launch for a ragged batch mixing prefill chunks and decodes.

Layout (shared with the Torch backend's CPU path):
- ``q``: [T, Hq, D]; tokens of sequence i are rows ``query_start_loc[i] : query_start_loc[i+1]``.
- ``k_cache`` / ``v_cache``: [N, S, Hkv, D] per layer (N blocks of S slots).
- ``block_tables``: int32 [B, M]; logical block j of sequence i lives in physical block
  ``block_tables[i, j]``.
- ``seq_lens``: int32 [B], context length of each sequence INCLUDING this step's new tokens.
  The q_len_i queries of sequence i are the LAST q_len_i positions of its context, so query r
  (0-based within the sequence) sits at position ``seq_len_i - q_len_i + r`` and attends to key
  positions ``<= `` its own (causal), and, with a sliding window w, ``> q_pos - w``; with an
  attention chunk C (Llama 4), only keys of its own chunk: ``k_pos // C == q_pos // C``.
- Soft-cap: ``score = cap * tanh(score / cap)`` applied after the ``sm_scale`` multiply.

Kernel shape: the grid is (query tiles across the flattened ragged batch, Hkv). A tile holds
BLOCK_Q query positions of ONE sequence times the G = Hq // Hkv query heads that share the kv
head, packed as BLOCK_M = BLOCK_Q * G rows (row r -> query r // G, head r % G), so a decode of one
token with G heads still fills a matmul tile and K/V of that kv head are read once for all G
heads. Sequence i owns programs ``[qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1)`` (at
least cdiv(q_len_i, BLOCK_Q) of them; the surplus exits at once), so the grid size
``T // BLOCK_Q + B`` depends only on host-known sizes: no device->host sync, CUDA-graph safe.
Each program finds its sequence by binary search over ``query_start_loc``. K/V tiles of BLOCK_N
keys are gathered through the block table (any page size S), softmax is online in fp32.

Rows of ``out`` beyond ``query_start_loc[B]`` (padding tokens) are written as zeros when
``zero_padding`` (the default when ``out`` is allocated here, with torch.empty: no separate fill
kernel): by cdiv(T, BLOCK_Q) extra programs past the attention tiles (one split), or by the merge
kernel (split-KV, whose grid covers every row). Otherwise they are left untouched.

Quantized cache (``k_scale`` / ``v_scale`` given; contract in xlaserve.quantization.kv_quant):
``k_cache`` / ``v_cache`` hold int8 or float8_e4m3fn codes and the scales are float32 [N, S, Hkv]
(one per token and KV head). Each K/V tile loads its BLOCK_N scales with it: K codes are cast
(exactly) to the compute dtype and the scores scaled per key column in fp32; V is dequantized in
registers (codes * scale) before the P @ V dot.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

import torch
import triton
import triton.language as tl

from xlaserve.config import KernelConfig

from ._common import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    next_pow2,
    pdl_kwargs,
    pdl_prologue,
    upcast_dot,
    use_pdl,
)
from .kv_quant import dequantize_kv
from .kv_write import check_kv_scales

# Tuned launch parameters, kept as data. "decode": every sequence has one query token (BLOCK_M
# is raised to next_pow2(G) when G is larger). "prefill": any sequence has more; keyed by the
# head-dim bucket since shared memory bounds the tile at D=256.
ATTENTION_CONFIGS: dict[str, dict[int, dict[str, int]]] = {
    "decode": {
        64: {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
        128: {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
        256: {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    },
    "prefill": {
        64: {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
        128: {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        256: {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    },
}

# Prefill tiles on GPUs with at least PREFILL_WIDE_SMEM bytes of opt-in shared memory per
# block (Hopper's 227 KB; a 128-key tile with 3 stages takes ~224 KB at D=128: the Q tile and 3
# x (K + V) in 16-bit), for 16-bit queries over unquantized caches (`use_wide_tiles`), keyed by
# head-dim bucket; other GPUs, dtypes, caches and buckets keep ATTENTION_CONFIGS["prefill"].
# Measured (bench/gpu_probes/prefill_tile_sweep.py, H100, 2026-12-05, nineteenth session;
# 32 / 8 heads, D 128, bf16): the 30k prompt whole 16.15 vs
# 20.56 ms for the table's (128, 64, 8 warps, 2 stages), its second chunk (13,616 queries over
# 30,000 keys) 11.42 vs 14.50 ms; the sweep's best, (128, 128, 8, 4), was 15.94 / 11.87.
PREFILL_WIDE_SMEM = 220 * 1024
PREFILL_WIDE_CONFIGS: dict[int, dict[str, int]] = {
    128: {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
}
_WIDE_SMEM: dict[int, bool] = {}  # CUDA device index -> has PREFILL_WIDE_SMEM

# Decode tiles over a quantized (int8 / fp8) cache by head-dim bucket, where set; unset buckets
# keep ATTENTION_CONFIGS["decode"]. A 1-byte code makes the table's 64-key tile half a bf16
# tile's bytes, and the kernel is then bound by its loop trips, not HBM: at the offline
# benchmark's batch-256 decode step (ctx 384, 32 / 8 heads, D 128; `long_decode_sweep.py
# --shapes ctx384_b256 --kv fp8`, H200, 2026-12-05) the table's (64 keys, 4 warps, 3 stages)
# took 150.9 us over an fp8 cache against 121.4 us over bf16, and (128, 4, 3) 112.5 us (bf16:
# 113.1); 256 keys or 8 warps were slower. int8 caches take it too (one byte a code; not swept).
# The end-to-end fp8 KV row with it waits for the next lease (tools/device/next_lease.sh 2).
QUANT_DECODE_CONFIGS: dict[int, dict[str, int]] = {
    128: {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
}


def wide_smem(device: torch.device) -> bool:
    """Whether a CUDA device has PREFILL_WIDE_SMEM of opt-in shared memory per block."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _WIDE_SMEM:
        props = torch.cuda.get_device_properties(idx)
        _WIDE_SMEM[idx] = getattr(props, "shared_memory_per_block_optin", 0) >= PREFILL_WIDE_SMEM
    return _WIDE_SMEM[idx]


def use_wide_tiles(q: torch.Tensor) -> bool:
    """Whether a prefill launch with queries q may take PREFILL_WIDE_CONFIGS: 16-bit queries
    (float32 would double the tile's shared memory) on a GPU with PREFILL_WIDE_SMEM; never in
    the CPU interpreter (`wide_smem` is False off CUDA)."""
    return q.element_size() == 2 and wide_smem(q.device)


# Long-context decode (issue 24): a decode launch with at least LONG_DECODE_MIN_SPLITS splits
# (host-known and fixed per CUDA-graph bucket, so the pick is graph safe; >= 16 splits implies
# >= 16 * MIN_KEYS_PER_SPLIT keys when auto-picked) takes wider key tiles and a deeper pipeline:
# at batch 1 each program walks many tiles serially, and more bytes in flight per program hide
# HBM latency. Keyed by head-dim bucket; a bucket absent here keeps ATTENTION_CONFIGS["decode"]
# (D=256: shared memory). Tune from bench/gpu_probes/long_decode_sweep.py's "best" lines.
# Measured (H200, CUDA-graph replays, bf16 cache, bench/RESULTS.md fifteenth session): these
# tiles beat the decode table's (64, 4 warps, 3 stages) at every shape and split count swept:
# 30k keys batch 1 56.0 vs 68.0 us (16 splits) and 45.7 vs 50.7 (32); 131k 196 vs 248 and 142
# vs 156; 8k batch 32 281 vs 310 and 292 vs 329. Quantized caches keep the decode table until
# the same sweep has run over them (`long_decode_sweep.py --kv fp8`).
LONG_DECODE_ENABLED = True
LONG_DECODE_MIN_SPLITS = 16
LONG_DECODE_CONFIGS: dict[int, dict[str, int]] = {
    64: {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4},
    128: {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4},
}

# Auto split-KV (eager decode): programs per SM to aim at. Batch-1 decode is latency bound, so
# more programs in flight per SM beat fewer longer ones (H200, 8 kv heads: 32 splits best at
# 30k, 64 at 131k; 4 per SM picks those where 2 picked 32 at both).
TARGET_PROGRAMS_PER_SM = 4

# Small tiles under the CPU interpreter: it runs every lane in numpy, so smaller is faster.
_INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}

# Split-KV: each split must cover at least this many keys to be worth its merge cost.
MIN_KEYS_PER_SPLIT = 512

# Layer caches of at least this many elements take int64 block offsets (int32 would wrap); a
# module constant so that a test can run that path on small shapes.
OFFS64_MIN_ELEMENTS = 2**31

# Causal fast path (on by default; False = the earlier kernel, for bench/long_context.py's A/B):
# key tiles wholly before a query tile's first query skip the mask (only the diagonal tiles
# build it, as FlashAttention splits its loop), and query tiles run last-first, so the longest
# (latest) tiles of a long prefill start first instead of forming the launch's tail.
CAUSAL_FAST_PATH = True


@triton.jit
def _tanh(x):
    # tanh from exp(-2|x|) in (0, 1]: no overflow for any x.
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _attend_tile(
    start_n,
    q,
    m_i,
    l_i,
    acc,
    q_pos,
    kv_end,
    seq,
    kvh,
    k_ptr,
    v_ptr,
    bt_ptr,
    ks_ptr,
    vs_ptr,
    stride_kn,
    stride_ks,
    stride_kh,
    stride_vn,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_sn,
    stride_ss,
    d,
    d_ok,
    sm_scale,
    soft_cap,
    window,
    chunk,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    QUANT: tl.constexpr,
    OFFS64: tl.constexpr,
    MASKED: tl.constexpr,
    QUANT_F16: tl.constexpr = False,
):
    """One BLOCK_N key tile starting at start_n: the online-softmax update of (m_i, l_i, acc).
    MASKED=False: every key of the tile is < kv_end and visible to every row (causal, no window
    or chunk: the caller guarantees it), so no mask is built."""
    n = start_n + tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = n < kv_end
    else:
        n_ok = n >= 0  # all true
    blk = tl.load(bt_ptr + seq * stride_bt + n // PAGE, mask=n_ok, other=0)
    if OFFS64:  # a layer cache past 2^31 elements: int32 element offsets would wrap
        blk = blk.to(tl.int64)
    slot = n % PAGE
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(
        k_ptr + blk[:, None] * stride_kn + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        v_ptr + blk[:, None] * stride_vn + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if QUANT:
        # Scales [N, S, Hkv] of this tile's keys; codes -> compute dtype is exact.
        s_offs = blk * stride_sn + slot * stride_ss + kvh
        k_sc = tl.load(ks_ptr + s_offs, mask=n_ok, other=0.0)
        v_sc = tl.load(vs_ptr + s_offs, mask=n_ok, other=0.0)
        if QUANT_F16:  # fp8 codes: exact in fp16, one convert per two; V scaled in fp16
            k = k.to(tl.float16)
            v = v.to(tl.float16) * v_sc.to(tl.float16)[:, None]
        else:
            k = k.to(q.dtype)
            v = (v.to(tl.float32) * v_sc[:, None]).to(q.dtype)
    elif UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
    # Scores in log2 space (exp2 is the fast path): one multiply by sm_scale * log2(e) unless
    # the soft-cap needs the plain scaled score first.
    if USE_SOFTCAP:
        s = s * sm_scale
        if QUANT:
            s = s * k_sc[None, :]
        s = soft_cap * _tanh(s / soft_cap) * 1.4426950408889634
    else:
        s = s * (sm_scale * 1.4426950408889634)
        if QUANT:
            s = s * k_sc[None, :]
    if MASKED:
        mask = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            mask = mask & (n[None, :] > q_pos[:, None] - window)
        if USE_CHUNK:
            mask = mask & (n[None, :] // chunk == q_pos[:, None] // chunk)
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Fully masked rows (padding) keep m = -inf; shift by 0 there to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new  # every score is finite
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


# Per-step ints are not specialized (Triton would otherwise compile a variant per "== 1" /
# "divisible by 16" combination of them, in the middle of serving).
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_tiles"])
def _unified_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    ks_ptr,
    vs_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kn,
    stride_ks,
    stride_kh,
    stride_vn,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_sn,
    stride_ss,
    num_seqs,
    num_tokens,
    num_tiles,
    sm_scale,
    soft_cap,
    window,
    chunk,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    QUANT: tl.constexpr,
    QUANT_F16: tl.constexpr,
    ZERO_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
    FAST_CAUSAL: tl.constexpr,
    OFFS64: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    if ZERO_PAD:
        if pid >= num_tiles:
            # Zero-fill program: rows of BLOCK_Q tokens x this kv head's G query heads (the
            # attention tile's shape), only tokens past query_start_loc[B] (padding).
            zr = tl.arange(0, BLOCK_M)
            z_tok = (pid - num_tiles) * BLOCK_Q + zr // G
            z_ok = (
                (zr // G < BLOCK_Q) & (z_tok >= tl.load(qsl_ptr + num_seqs)) & (z_tok < num_tokens)
            )
            zd = tl.arange(0, BLOCK_D)
            z_offs = (
                z_tok[:, None] * stride_ot + (kvh * G + zr % G)[:, None] * stride_oh + zd[None, :]
            )
            zeros = tl.zeros([BLOCK_M, BLOCK_D], dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + z_offs, zeros, mask=z_ok[:, None] & (zd < HEAD_DIM)[None, :])
            return

    if FAST_CAUSAL:  # last tile first: the longest tiles of a causal prefill lead
        pid = num_tiles - 1 - pid
    # Binary search: the last sequence whose first program index <= pid.
    lo = pid * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        take = first <= pid
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid)
    seq = lo

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    qblk = pid - (q_start // BLOCK_Q + seq)
    if qblk * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    q_local = qblk * BLOCK_Q + rows // G
    head = kvh * G + rows % G
    row_ok = (rows // G < BLOCK_Q) & (q_local < q_len)
    q_pos = ctx_len - q_len + q_local  # [BLOCK_M]
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q_offs = (q_start + q_local)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if QUANT_F16:  # the dots run in fp16 (see `_attend_tile`): q once, here
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Key range of this tile: causal end after its last query, window start before its first.
    q_first = ctx_len - q_len + qblk * BLOCK_Q
    kv_end = tl.minimum(q_first + BLOCK_Q, ctx_len)
    kv_begin = q_first * 0
    if USE_WINDOW:
        kv_begin = tl.maximum(q_first - window + 1, 0)
    if USE_CHUNK:  # no key before the chunk of the tile's first query
        kv_begin = tl.maximum(kv_begin, (q_first // chunk) * chunk)
    kv_begin = (kv_begin // BLOCK_N) * BLOCK_N
    if NUM_SPLITS > 1:
        # Split-KV (flash-decoding): this program covers one contiguous span of whole tiles.
        # (`span`, not `chunk`: that is the attention chunk size of the chunk mask.)
        split = tl.program_id(2)
        span = tl.cdiv(tl.cdiv(kv_end - kv_begin, BLOCK_N), NUM_SPLITS) * BLOCK_N
        kv_begin = kv_begin + split * span
        kv_end = tl.minimum(kv_begin + span, kv_end)

    # Tiles wholly before the tile's first query (aligned down; kv_begin, span are aligned)
    # are visible to every row: no mask there when only the causal rule applies.
    kv_mid = kv_begin
    if FAST_CAUSAL and not USE_WINDOW and not USE_CHUNK:
        kv_mid = tl.maximum(tl.minimum((q_first // BLOCK_N) * BLOCK_N, kv_end), kv_begin)
    for start_n in range(kv_begin, kv_mid, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            start_n, q, m_i, l_i, acc, q_pos, kv_end, seq, kvh,
            k_ptr, v_ptr, bt_ptr, ks_ptr, vs_ptr,
            stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
            stride_bt, stride_sn, stride_ss, d, d_ok, sm_scale, soft_cap, window, chunk,
            PAGE, BLOCK_N, USE_WINDOW, USE_CHUNK, USE_SOFTCAP, UPCAST, DOT_PREC, QUANT, OFFS64,
            MASKED=False, QUANT_F16=QUANT_F16,
        )  # fmt: skip
    for start_n in range(kv_mid, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            start_n, q, m_i, l_i, acc, q_pos, kv_end, seq, kvh,
            k_ptr, v_ptr, bt_ptr, ks_ptr, vs_ptr,
            stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
            stride_bt, stride_sn, stride_ss, d, d_ok, sm_scale, soft_cap, window, chunk,
            PAGE, BLOCK_N, USE_WINDOW, USE_CHUNK, USE_SOFTCAP, UPCAST, DOT_PREC, QUANT, OFFS64,
            MASKED=True, QUANT_F16=QUANT_F16,
        )  # fmt: skip

    row_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS > 1:
        # Unnormalised partials [T, Hq, NUM_SPLITS, (D | 2)], merged by _merge_splits_kernel.
        part = ((q_start + q_local) * (tl.num_programs(1) * G) + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        o_offs = (q_start + q_local)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit(do_not_specialize=["num_seqs"])
def _merge_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    qsl_ptr,
    num_seqs,
    stride_ot,
    stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ZERO_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    # One program per (token, q head): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
    tok = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    if tok >= tl.load(qsl_ptr + num_seqs):  # padding row: zeros, or left untouched
        if ZERO_PAD:
            zeros = tl.zeros([BLOCK_D], dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, zeros, mask=d < HEAD_DIM)
        return
    sp = tl.arange(0, NUM_SPLITS)
    base = (tok * num_heads + head) * NUM_SPLITS
    m = tl.load(part_ml_ptr + (base + sp) * 2)
    l_s = tl.load(part_ml_ptr + (base + sp) * 2 + 1)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)  # empty splits: m = -inf -> weight 0
    acc = tl.load(part_acc_ptr + (base + sp)[:, None] * BLOCK_D + d[None, :])
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l_s * w, 0)
    den = tl.where(den == 0.0, 1.0, den)
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + d,
        (num / den).to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def _check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[int, int, int, int, int]:
    """Validate shapes/dtypes; return (T, Hq, Hkv, D, B)."""
    name = "unified_attention"
    if q.ndim != 3:
        raise ValueError(f"{name}: q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.ndim != 4:
        raise ValueError(
            f"{name}: k_cache must be [N, S, Hkv, D], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{name}: v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    t, hq, d = q.shape
    _, _, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"{name}: head_dim of q ({d}) != head_dim of k_cache ({dk})")
    if d > 256:
        raise ValueError(f"{name}: head_dim {d} > 256 is not supported")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{name}: Hq ({hq}) must be a multiple of Hkv ({hkv})")
    check_dtype(f"{name} q", q, FLOAT_DTYPES)
    check_kv_scales(name, k_cache, v_cache, k_scale, v_scale)
    if k_scale is not None:
        if v_cache.dtype != k_cache.dtype:
            raise ValueError(
                f"{name}: k_cache and v_cache dtypes must match, got {k_cache.dtype}, "
                f"{v_cache.dtype}"
            )
    elif k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"{name}: q, k_cache, v_cache dtypes must match, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if out is not None:
        if out.shape != q.shape:
            raise ValueError(f"{name}: out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
        if out.dtype != q.dtype:
            raise ValueError(f"{name}: out dtype {out.dtype} != q dtype {q.dtype}")
    for label, tensor, ndim in (
        ("query_start_loc", query_start_loc, 1),
        ("seq_lens", seq_lens, 1),
        ("block_tables", block_tables, 2),
    ):
        if tensor.dtype != torch.int32:
            raise ValueError(f"{name}: {label} must be int32, got {tensor.dtype}")
        if tensor.ndim != ndim:
            raise ValueError(f"{name}: {label} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    b = seq_lens.shape[0]
    if query_start_loc.shape[0] != b + 1:
        raise ValueError(
            f"{name}: query_start_loc must be [B+1] = [{b + 1}], got {tuple(query_start_loc.shape)}"
        )
    if block_tables.shape[0] != b:
        raise ValueError(
            f"{name}: block_tables must be [B={b}, M], got {tuple(block_tables.shape)}"
        )
    if max_query_len < 0:
        raise ValueError(f"{name}: max_query_len must be >= 0, got {max_query_len}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"{name}: sliding_window must be None or > 0, got {sliding_window}")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"{name}: chunk_size must be None or > 0, got {chunk_size}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"{name}: soft_cap must be None or > 0, got {soft_cap}")
    return t, hq, hkv, d, b


def attention_launch_config(
    max_query_len: int,
    num_queries_per_kv: int,
    head_dim: int,
    interpret: bool,
    num_kv_splits: int = 1,
    override: dict[str, int] | None = None,
    quant: bool = False,
    wide: bool = False,
) -> dict[str, int]:
    """Pick BLOCK_M/BLOCK_N/num_warps/num_stages (+ derived BLOCK_Q) for one launch.

    Decode launches with >= LONG_DECODE_MIN_SPLITS splits over an unquantized cache (quant
    False) take LONG_DECODE_CONFIGS; other decode launches over a quantized cache take
    QUANT_DECODE_CONFIGS where it has the bucket; prefill launches over an unquantized cache
    with wide (`use_wide_tiles(q)`) take PREFILL_WIDE_CONFIGS; override (tests, bench sweeps)
    replaces the table pick, keys BLOCK_M/BLOCK_N/num_warps/num_stages.
    """
    kind = "decode" if max_query_len <= 1 else "prefill"
    bucket = 64 if head_dim <= 64 else (128 if head_dim <= 128 else 256)
    if override is not None:
        missing = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} - set(override)
        if missing:
            raise ValueError(f"attention_launch_config: override lacks {sorted(missing)}")
        cfg = dict(override)
    elif interpret:
        cfg = dict(_INTERPRET_CONFIG)
    elif (
        LONG_DECODE_ENABLED
        and not quant
        and kind == "decode"
        and num_kv_splits >= LONG_DECODE_MIN_SPLITS
        and bucket in LONG_DECODE_CONFIGS
    ):
        cfg = dict(LONG_DECODE_CONFIGS[bucket])
    elif quant and kind == "decode" and bucket in QUANT_DECODE_CONFIGS:
        cfg = dict(QUANT_DECODE_CONFIGS[bucket])
    elif wide and not quant and kind == "prefill" and bucket in PREFILL_WIDE_CONFIGS:
        cfg = dict(PREFILL_WIDE_CONFIGS[bucket])
    else:
        cfg = dict(ATTENTION_CONFIGS[kind][bucket])
    cfg["BLOCK_M"] = max(cfg["BLOCK_M"], next_pow2(num_queries_per_kv))
    cfg["BLOCK_Q"] = cfg["BLOCK_M"] // num_queries_per_kv
    return cfg


# fp8 caches with 16-bit queries: the attention dots run in fp16 (QUANT_F16). An e4m3 code is
# exact in fp16 and converts two at a time (one instruction), where bf16 dots need fp8 -> f16 ->
# f32 -> bf16 per element, plus V's fp32 scale multiply; the sm_90 PTX of a decode tile (BLOCK_N
# 128) has ~3x fewer converts and multiplies this way. Scores are unchanged (q and k take the
# same values in fp16 as in bf16 unless |q| leaves fp16's range, 6e-5 .. 65504); P and the
# scaled V round to fp16's 11 mantissa bits instead of bf16's 8.
QUANT_F16_DOTS = True


def quant_f16_dots(cache_dtype: torch.dtype, q_dtype: torch.dtype) -> bool:
    """Whether a quantized cache's attention dots run in fp16 (see QUANT_F16_DOTS)."""
    return (
        QUANT_F16_DOTS
        and cache_dtype == torch.float8_e4m3fn
        and q_dtype in (torch.bfloat16, torch.float16)
    )


class PagedBatch(Protocol):
    """The ragged paged batch one attention launch reads, as one struct (backends_torch's
    AttentionMetadata / TritonAttentionMetadata are such structs): see `unified_attention` for
    each field's shape. num_kv_splits (optional attribute): the split-KV factor, None = auto."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    sm_scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    kernels: KernelConfig | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """`unified_attention` with the batch layout passed as one struct (`PagedBatch`): q
    [T, Hq, D] over caches [N, S, Hkv, D] -> [T, Hq, D]; the per-layer arguments as there."""
    return unified_attention(
        q, k_cache, v_cache, out,
        batch.query_start_loc, batch.seq_lens, batch.block_tables,
        batch.max_query_len, batch.max_seq_len, sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap,
        num_kv_splits=getattr(batch, "num_kv_splits", None),
        k_scale=k_scale, v_scale=v_scale, kernels=kernels, chunk_size=chunk_size,
    )  # fmt: skip


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_kv_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    zero_padding: bool | None = None,
    *,
    kernels: KernelConfig | None = None,
    chunk_size: int | None = None,
    launch_config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Paged causal attention over a ragged batch of prefill chunks and decodes, one launch.

    Args:
        q: [T, Hq, D] queries (fp16/bf16/fp32; last dim contiguous). T may include trailing
            padding rows past ``query_start_loc[B]`` (see zero_padding).
        k_cache, v_cache: [N, S, Hkv, D], same dtype as q; Hq % Hkv == 0 (GQA); D <= 256.
        out: [T, Hq, D] same dtype as q, or None to allocate (then padding rows are zeros).
        query_start_loc: int32 [B+1], cumulative query counts (query_start_loc[0] == 0).
        seq_lens: int32 [B], context length including this step's queries.
        block_tables: int32 [B, M], physical block per logical block (M >= cdiv(seq_len, S)).
        max_query_len: host int, max q_len over the batch (picks the decode or prefill tiling).
        max_seq_len: host int, max seq_len (sizes the split-KV heuristic).
        sm_scale: softmax scale, usually D ** -0.5.
        sliding_window: w or None; key allowed iff key_pos > q_pos - w.
        chunk_size: C or None (Llama 4 chunked attention); key allowed iff
            key_pos // C == q_pos // C (chunks aligned to position 0).
        soft_cap: cap or None; score = cap * tanh(score / cap).
        num_kv_splits: split-KV (flash-decoding) factor, a power of 2 <= 64. None picks one on
            GPU for decode-only batches too small to fill the SMs (1 under the interpreter).
            Each split covers a chunk of every tile's key range; a merge kernel combines them.
            Pass a fixed value when capturing CUDA graphs whose seq_lens change on replay.
        k_scale, v_scale: None, or float32 [N, S, Hkv] when k_cache / v_cache hold int8 /
            float8_e4m3fn codes (quantized KV cache; dequantized on read).
        zero_padding: whether the kernels write zeros into the padding rows of out; None (the
            default): iff out is None (so an allocated out is zeros there, a given one untouched).
        launch_config: None (the tuned tables), or BLOCK_M/BLOCK_N/num_warps/num_stages to
            launch with (tests and bench sweeps; BLOCK_N a power of 2 >= 16).

    Returns:
        out: [T, Hq, D].

    No device->host synchronisation: safe to capture in a CUDA graph for fixed (T, B, M).
    """
    t, hq, hkv, d, b = _check_attention_args(
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, max_query_len,
        sliding_window, soft_cap, k_scale, v_scale, chunk_size,
    )  # fmt: skip
    quant = k_scale is not None
    check_device(
        "unified_attention", q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
        *(() if out is None else (out,)), *((k_scale, v_scale) if quant else ()),
    )  # fmt: skip
    for label, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(f"unified_attention {label}", tensor)
    if zero_padding is None:
        zero_padding = out is None
    if out is None:
        out = torch.empty_like(q)  # padding rows: zeroed by the kernels (no fill launch)
    else:
        check_last_dim_contiguous("unified_attention out", out)
    if t == 0:
        return out
    if b == 0:  # every row is padding
        if zero_padding:
            out.zero_()
        return out

    g = hq // hkv
    interpret = q.device.type == "cpu"
    # BLOCK_Q (hence the tile count the split heuristic sees) depends only on G and BLOCK_M,
    # which no table changes by split count: size the grid first, then pick the tiles.
    wide = use_wide_tiles(q)
    cfg = attention_launch_config(
        max(max_query_len, 1), g, d, interpret, 1, launch_config, quant, wide
    )
    num_tiles = t // cfg["BLOCK_Q"] + b
    if num_kv_splits is None:
        num_kv_splits = 1 if interpret else _auto_kv_splits(num_tiles * hkv, max_query_len,
                                                             max_seq_len, q.device)  # fmt: skip
    if num_kv_splits < 1 or num_kv_splits > 64 or num_kv_splits & (num_kv_splits - 1):
        raise ValueError(
            f"unified_attention: num_kv_splits must be a power of 2 in [1, 64], got {num_kv_splits}"
        )
    cfg = attention_launch_config(
        max(max_query_len, 1), g, d, interpret, num_kv_splits, launch_config, quant, wide
    )
    block_q = cfg["BLOCK_Q"]
    if num_tiles != t // block_q + b:
        raise ValueError("unified_attention: launch_config changed BLOCK_Q with the split count")
    block_d = max(16, next_pow2(d))
    if num_kv_splits > 1:
        part_acc = torch.empty(
            (t, hq, num_kv_splits, block_d), dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty((t, hq, num_kv_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    # One split: cdiv(T, BLOCK_Q) zero-fill programs past the tiles (their rows past
    # query_start_loc[B]); split-KV: the merge kernel, whose grid covers every row, zeroes.
    zero_main = zero_padding and num_kv_splits == 1
    grid = (num_tiles + (triton.cdiv(t, block_q) if zero_main else 0), hkv, num_kv_splits)
    ks, vs = (k_scale, v_scale) if quant else (seq_lens, seq_lens)  # unused when float
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_ml, query_start_loc, seq_lens, block_tables,
        ks, vs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        ks.stride(0) if quant else 0, ks.stride(1) if quant else 0,
        b, t, num_tiles, float(sm_scale), float(soft_cap or 0.0), int(sliding_window or 0),
        int(chunk_size or 1),
        G=g,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        PAGE=k_cache.shape[1],
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_Q=block_q,
        BLOCK_N=cfg["BLOCK_N"],
        USE_WINDOW=sliding_window is not None,
        USE_CHUNK=chunk_size is not None,
        USE_SOFTCAP=soft_cap is not None,
        UPCAST=upcast_dot(q.dtype),
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_SPLITS=num_kv_splits,
        QUANT=quant,
        QUANT_F16=quant_f16_dots(k_cache.dtype, q.dtype),
        ZERO_PAD=zero_main,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        USE_PDL=(pdl := use_pdl(q, kernels)),
        FAST_CAUSAL=CAUSAL_FAST_PATH,
        # int64 block offsets only where a layer cache needs them (the KV write kernel
        # addresses slots in int64 always); int32 keeps the address math of the common case.
        OFFS64=max(k_cache.numel(), v_cache.numel()) >= OFFS64_MIN_ELEMENTS,
        **pdl_kwargs(pdl),
    )  # fmt: skip
    if num_kv_splits > 1:
        _merge_splits_kernel[(t, hq)](
            part_acc, part_ml, out, query_start_loc, b, out.stride(0), out.stride(1), hq,
            HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=num_kv_splits, ZERO_PAD=zero_padding,
            num_warps=4, USE_PDL=pdl, **pdl_kwargs(pdl),
        )  # fmt: skip
    return out


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _auto_kv_splits(
    programs: int, max_query_len: int, max_seq_len: int, device: torch.device
) -> int:
    """Splits for decode-only batches whose (tiles x kv heads) grid leaves SMs idle: aim at
    ~TARGET_PROGRAMS_PER_SM programs per SM, each split covering >= MIN_KEYS_PER_SPLIT keys."""
    if max_query_len > 1 or max_seq_len < 2 * MIN_KEYS_PER_SPLIT:
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    want = min(
        TARGET_PROGRAMS_PER_SM * sms // max(programs, 1), max_seq_len // MIN_KEYS_PER_SPLIT, 64
    )
    return 1 << (max(want, 1).bit_length() - 1)  # floor to a power of 2


def unified_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_kv_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    zero_padding: bool | None = None,
    *,
    kernels: KernelConfig | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Plain torch reference of :func:`unified_attention` (same arguments, fp32 math;
    ``num_kv_splits`` is accepted and ignored; a quantized cache is dequantized first).

    Loops over sequences in Python and syncs (``tolist``): for tests, not for serving.
    """
    _check_attention_args(
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, max_query_len,
        sliding_window, soft_cap, k_scale, v_scale, chunk_size,
    )  # fmt: skip
    if out is None:
        out = torch.zeros_like(q)
    elif zero_padding:
        out[int(query_start_loc[-1]) :] = 0
    if k_scale is not None:
        k_cache, v_cache = dequantize_kv(k_cache, k_scale), dequantize_kv(v_cache, v_scale)
    _, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    g = hq // hkv
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, ctx_len in enumerate(lens):
        q_lo, q_hi = qsl[i], qsl[i + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        nblk = math.ceil(ctx_len / page)
        blocks = block_tables[i, :nblk].long()
        # [L, Hkv, D] -> [Hq, L, D]: gather pages, drop the tail, repeat kv heads for GQA.
        k = k_cache[blocks].reshape(nblk * page, hkv, d)[:ctx_len].float()
        v = v_cache[blocks].reshape(nblk * page, hkv, d)[:ctx_len].float()
        k = k.repeat_interleave(g, dim=1).transpose(0, 1)
        v = v.repeat_interleave(g, dim=1).transpose(0, 1)
        qi = q[q_lo:q_hi].float().transpose(0, 1)  # [Hq, q_len, D]
        s = torch.matmul(qi, k.transpose(1, 2)) * sm_scale  # [Hq, q_len, L]
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
        k_pos = torch.arange(ctx_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        if chunk_size is not None:
            allowed &= k_pos // chunk_size == q_pos // chunk_size
        s = s.masked_fill(~allowed, float("-inf"))
        o = torch.matmul(torch.softmax(s, dim=-1), v)  # [Hq, q_len, D]
        out[q_lo:q_hi] = o.transpose(0, 1).to(out.dtype)
    return out
