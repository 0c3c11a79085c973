"""Ragged paged attention for GPUs: a Pallas kernel lowered through Triton.

Same contract as `ragged_paged_attention` (kernels_pallas/ragged_paged_attention.py): q [T, Hq, D]
(T padded); k_cache, v_cache [N, S, Hkv, D] already holding this step's K/V; kv_lens int32 [B];
block_tables int32 [B, M]; cu_q_lens int32 [B+1]; num_seqs int32 [1]. The queries of sequence i
are the LAST q_len_i positions of its kv_len_i context (causal). Output [T, Hq, D] in q's dtype,
zeros for padding rows. GQA, sliding window (keys in (p - w, p]), attention chunks (Llama 4:
keys with k // C == p // C), soft cap (before masking),
float32 softmax and accumulators. Mixed batches (prefill chunks + decodes) run in one call.

Design
------
Grid: (query tiles, Hkv[, KV splits]). A query tile is up to BQ consecutive query tokens of ONE
sequence (tiles never straddle sequences, so a program has one kv_len, one block-table row and
one causal frontier). The number of tiles is data-dependent; the grid uses the static upper
bound ceil(T / BQ) + min(B, T) (each non-empty sequence adds at most one partial tile) and the
jitted wrapper builds the tile -> (sequence, first query) map with jnp (a cumsum of
ceil(q_len / BQ) and a searchsorted); tiles past the real count have sequence -1 and exit.

A program takes the tile's BQ tokens x Gp query heads of one KV head as one [R = BQ * Gp, D]
block (Gp = G padded to a power of two, R >= 16 so the dots are tensor-core shaped; q is handed
over as [T + BQ, Hkv, Gp, D] so the block load never leaves the array and needs no mask). It
walks the sequence's KV in steps of P pages (BK = P * S keys): from the sliding-window start
of the tile's first row to the causal end of its last row, only. Each step reads the P page ids
from the block table and gathers K and V as [BK, D] (the cache viewed as [N * S * Hkv, D], one
row per (page, slot, KV head): a free reshape), masked past kv_len so partial pages read nothing
beyond the context, with page ids clamped into [0, N) so a garbage table entry cannot fault;
then it does one online-softmax update in float32 with exp2 of
log2(e)-scaled logits. Masked logits get a large finite negative value and masked
probabilities are forced to 0, so a row whose keys are all masked in one step never computes
-inf - (-inf) and never counts masked keys. Steps whose every key is visible to every row of
the tile (past the window edge, before the causal diagonal) run a copy of the step with no
masks and unmasked loads; only the edge steps pay for masking. The output store is masked to the tile's rows;
rows no tile owns (padding tokens) are zeroed by the wrapper.

Split KV (flash decoding): with few programs (small decode batches) the KV range of a tile is
cut into `kv_splits` contiguous chunks on a third grid axis; each program writes unnormalized
float32 (acc, m, l) and the wrapper merges the chunks (log-sum-exp rescale). Used when the grid
would have fewer than `_FEW_PROGRAMS` programs and the block sizes ask for splits.

Block sizes are data: `TUNED_GPU_BLOCK_SIZES[(head_dim, page_size, dtype)]` holds a decode and a
prefill `GpuBlockSizes`; the wrapper picks "decode" when T <= B (every padded token could be
one sequence's decode), else "prefill" (only a performance choice: both are exact).

Triton rules: every block dimension must be a power of two, so page size, P, BQ and Gp are; the
dots need M, N, K >= 16 (R >= 16, BK >= 16, D >= 16). Any head_dim up to 256 runs: q and the
output are padded to `padded_head_dim` columns (q with zeros) and the cache's rows are read with
the padding columns' addresses clamped into the row (Phi's 80 / 96, StableLM's 80 heads), so the
cache keeps its own layout.

Quantized caches (int8 / float8_e4m3fn codes + float32 scales [N, S, Hkv]): each K / V tile
loads its BK scales with it and is dequantized in registers (codes -> f32 * scale -> q's dtype)
right before the dots, as the TPU kernel does in VMEM: D + 4 bytes a token and head instead of
2 * D.

On CPU the same kernel runs under Pallas' interpreter (`interpret=True`, the default whenever
JAX's backend is not a GPU) so the tests check the kernel body itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from xlaserve.kernels_pallas import compat

# Large finite negative logit for masked keys (see the module docstring).
MASK_VALUE: float = -0.7 * float(np.finfo(np.float32).max)
_LOG2E: float = math.log2(math.e)
GPU_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Quantized cache codes the kernel dequantizes (kv_cache_dtype "int8" / "fp8").
QUANT_CODE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
# Below this many (tile, head) programs the grid cannot fill an H200 (132 SMs, ~2 programs per
# SM resident): split the KV range of each tile (when the block sizes allow splits).
_FEW_PROGRAMS = 264


def _is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


# Largest head_dim the kernel takes (its padded [rows, D] tiles must fit the SM's registers
# and shared memory; 256 is Gemma's).
MAX_HEAD_DIM = 256


def padded_head_dim(d: int) -> int:
    """The kernel's column count for head_dim d: a power of 2 >= 16 (Triton's block and dot
    rules); d itself when it already is one (no padding, no clamped columns)."""
    return max(16, _next_pow2(d))


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


# ------------------------------------------------------------------------------------------
# Block sizes (data, not code)
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """Tile shape and Triton launch parameters of the GPU kernel.

    rows_per_block: R, rows of the [R, D] query block (BQ tokens x Gp heads); power of 2, >= 16.
        BQ = max(1, R // Gp); R is raised to Gp * BQ when Gp > R.
    pages_per_block: P, pages per online-softmax step (BK = P * S keys); power of 2. Raised so
        BK >= 16 (dot shape rule).
    num_warps, num_stages: Triton launch / software-pipelining parameters.
    kv_splits: KV chunks per tile on a third grid axis (flash decoding); power of 2. Used only
        when the grid is small (< _FEW_PROGRAMS programs) unless `force_splits`.
    force_splits: use kv_splits whatever the grid size (tests and tuning).
    """

    rows_per_block: int
    pages_per_block: int
    num_warps: int = 4
    num_stages: int = 2
    kv_splits: int = 1
    force_splits: bool = False

    def __post_init__(self) -> None:
        for name in ("rows_per_block", "pages_per_block", "kv_splits"):
            val = getattr(self, name)
            if not _is_pow2(val):
                raise ValueError(f"{name} must be a power of 2 (Triton block rule), got {val}")
        if self.rows_per_block < 16:
            raise ValueError(f"rows_per_block must be >= 16 (dot M), got {self.rows_per_block}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


@dataclasses.dataclass(frozen=True)
class GpuTuning:
    """Block sizes per batch shape: decode (T <= B) and prefill / mixed (T > B)."""

    decode: GpuBlockSizes
    prefill: GpuBlockSizes


def default_gpu_tuning(head_dim: int, page_size: int, dtype: jnp.dtype) -> GpuTuning:
    """No table entry: ~64-128 keys per step, 16 rows for decode, 64 rows for prefill."""
    del dtype
    big_d = head_dim > 128
    return GpuTuning(
        decode=GpuBlockSizes(16, max(1, 128 // page_size), num_warps=4, num_stages=2, kv_splits=4),
        prefill=GpuBlockSizes(
            32 if big_d else 64, max(1, 64 // page_size), num_warps=4, num_stages=2
        ),
    )


# (head_dim, page_size, dtype name) -> GpuTuning. (128, 16, bf16) is measured on the H200
# (`rpa_gpu --sweep`, 2026-12-03, Llama-8B heads; median us of blocking calls): decode at
# batch 1 (433 keys) 255.6 with the starting point (16, 8 pages, 4 warps, 2 stages, up to 4 KV
# splits) -> 173.8 with 3 stages and no split; batch 256 (~495 keys each) 638 -> 633 (a forced
# 4-way split measured 557 there, but splitting only when the grid is small is what hurt batch
# 1); prefill 1 x 2048: the starting point (64, 4, 4, 2) within 1 us of the best (317.8). The
# other entries are unmeasured starting points (flash-attention-like tiles).
TUNED_GPU_BLOCK_SIZES: dict[tuple[int, int, str], GpuTuning] = {
    (128, 16, "bfloat16"): GpuTuning(
        decode=GpuBlockSizes(16, 8, num_warps=4, num_stages=3, kv_splits=1),
        prefill=GpuBlockSizes(64, 4, num_warps=4, num_stages=2),
    ),
    (128, 32, "bfloat16"): GpuTuning(
        decode=GpuBlockSizes(16, 4, num_warps=4, num_stages=2, kv_splits=4),
        prefill=GpuBlockSizes(64, 2, num_warps=4, num_stages=2),
    ),
    (64, 16, "bfloat16"): GpuTuning(
        decode=GpuBlockSizes(16, 8, num_warps=4, num_stages=2, kv_splits=4),
        prefill=GpuBlockSizes(64, 4, num_warps=4, num_stages=2),
    ),
}


def get_gpu_tuning(head_dim: int, page_size: int, dtype: jnp.dtype) -> GpuTuning:
    """Table lookup with `default_gpu_tuning` as fallback."""
    key = (int(head_dim), int(page_size), jnp.dtype(dtype).name)
    return TUNED_GPU_BLOCK_SIZES.get(key) or default_gpu_tuning(head_dim, page_size, dtype)


# ------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------


def gpu_kernel_supports(q: jax.Array, k_cache: jax.Array, extended: bool = True) -> bool:
    """Whether the kernel takes these shapes / dtypes (what impl="auto" asks before picking it;
    an explicit impl="pallas_gpu" raises the reason instead, see check_gpu_kernel_inputs). A
    cache of int8 / float8_e4m3fn codes is a quantized one (its scales come with the call).
    extended=False: not those caches nor head dims that are not a power of 2 (the shapes the
    kernel learned last; `ragged_paged_attention.GPU_AUTO_EXTENDED`)."""
    quantized = jnp.dtype(k_cache.dtype) in QUANT_CODE_DTYPES
    if not extended and (quantized or padded_head_dim(q.shape[-1]) != q.shape[-1]):
        return False
    try:
        check_gpu_kernel_inputs(q, k_cache, quantized=quantized)
    except ValueError:
        return False
    return True


def check_gpu_kernel_inputs(q: jax.Array, k_cache: jax.Array, quantized: bool = False) -> None:
    """Kernel-specific rules (the shared contract is checked by the public wrapper)."""
    if jnp.dtype(q.dtype) not in GPU_KERNEL_DTYPES:
        raise ValueError(f"pallas_gpu supports float32, bfloat16, float16 q; got {q.dtype}")
    if quantized and jnp.dtype(k_cache.dtype) not in QUANT_CODE_DTYPES:
        raise ValueError(f"pallas_gpu reads int8 / float8_e4m3fn codes, got {k_cache.dtype}")
    if not quantized and k_cache.dtype != q.dtype:
        raise ValueError(
            f"pallas_gpu needs a cache of q's dtype ({q.dtype}) or int8 / fp8 codes with "
            f"scales, got {k_cache.dtype}"
        )
    d = q.shape[-1]
    s = k_cache.shape[1]
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(
            f"pallas_gpu takes head_dim 1-{MAX_HEAD_DIM} (padded to a power of 2 >= 16 inside), "
            f'got {d}; use impl="reference"'
        )
    if not _is_pow2(s):
        raise ValueError(
            f"pallas_gpu needs a power-of-2 page size (Triton block rule), got {s}; "
            'use impl="reference"'
        )


# ------------------------------------------------------------------------------------------
# The kernel
# ------------------------------------------------------------------------------------------


def _rpa_gpu_kernel(
    tile_seq_ref,  # [NT] int32: sequence of each query tile, -1 = no work
    tile_off_ref,  # [NT] int32: first query of the tile, relative to its sequence's first
    kv_lens_ref,  # [B]
    block_tables_ref,  # [B, Mp] (Mp = M rounded up to a multiple of P)
    cu_q_lens_ref,  # [B + 1]
    q_ref,  # [T + BQ, Hkv, Gp, D]
    k_ref,  # [N * S * Hkv, D]: the cache viewed as one row per (page, slot, KV head)
    v_ref,  # [N * S * Hkv, D]
    *refs,  # quantized: ks, vs [N * S * Hkv] f32 first; then the outputs: split == 1: o
    # [T + BQ, Hkv, Gp, D] (q dtype); else o, m, l per split (f32)
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    bq: int,
    chunk_size: int | None = None,
    pages_per_block: int,
    page_size: int,
    num_kv_heads: int,
    num_pages: int,
    kv_splits: int,
    head_dim: int,
    quantized: bool = False,
) -> None:
    ks_ref = vs_ref = None
    out_refs = refs
    if quantized:
        ks_ref, vs_ref, *out_refs = refs
    tile = pl.program_id(0)
    h = pl.program_id(1)
    split = pl.program_id(2) if kv_splits > 1 else 0
    _, _, gp, d = q_ref.shape  # d: head_dim padded to a power of 2 (q's zero columns)
    s = page_size
    p = pages_per_block
    bk = p * s
    rows = bq * gp
    seq = tile_seq_ref[tile]

    @pl.when(seq >= 0)
    def _work() -> None:
        q_start = cu_q_lens_ref[seq]
        q_len = cu_q_lens_ref[seq + 1] - q_start
        kv_len = kv_lens_ref[seq]
        off = tile_off_ref[tile]
        q0 = q_start + off
        n_rows = jnp.minimum(bq, q_len - off)  # real query tokens in this tile
        pos0 = kv_len - q_len + off  # context position of the tile's first query
        k_hi = pos0 + n_rows  # causal end (exclusive) of the tile's last row
        k_lo = 0 if sliding_window is None else jnp.maximum(0, pos0 - sliding_window + 1)
        if chunk_size is not None:  # nothing before the chunk of the tile's first row
            k_lo = jnp.maximum(k_lo, (pos0 // chunk_size) * chunk_size)
        blk_lo = k_lo // bk
        blk_hi = (k_hi + bk - 1) // bk
        if kv_splits > 1:  # this program's contiguous share of the tile's KV steps
            chunk = (blk_hi - blk_lo + kv_splits - 1) // kv_splits
            blk_lo = blk_lo + split * chunk
            blk_hi = jnp.minimum(blk_hi, blk_lo + chunk)

        # q rows: token-major [BQ, Gp, D] -> [R, D]; row r is token r // Gp of the tile.
        q = q_ref[pl.ds(q0, bq), h, :, :].reshape(rows, d)
        row_pos = pos0 + lax.broadcasted_iota(jnp.int32, (bq, gp), 0).reshape(rows, 1)
        key_iota = lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        slot_iota = lax.broadcasted_iota(jnp.int32, (p, s), 1)
        col_iota = lax.broadcasted_iota(jnp.int32, (1, d), 1)
        # A head_dim that is not a power of 2 is read as d columns whose padding addresses are
        # clamped to the row's last column (in bounds, no mask: the interior loads stay plain).
        # q's padding columns are zeros, so q . k is that of the real columns; the output's
        # padding columns (copies of the last V column) are sliced off by the wrapper.
        cols = jnp.minimum(col_iota, head_dim - 1) if d != head_dim else col_iota
        # The masked loads' fill value: a float for fp8 codes (JAX's Triton lowering casts no
        # integer to float8), 0 otherwise.
        zero = 0.0 if k_ref.dtype == jnp.float8_e4m3fn else 0

        def body(blk, carry, masked: bool):  # noqa: ANN001, ANN202
            acc, m_prev, l_prev = carry
            pages = block_tables_ref[seq, pl.ds(blk * p, p)]  # [P]
            pages = jnp.clip(pages, 0, num_pages - 1)
            # Gather rows (page * S + slot) * Hkv + h as [BK, 1] x columns [1, D]: an all-array
            # index (a pointer tensor in Triton; the interpreter supports only all-array or
            # all-slice indexing, not a mix).
            rows_kv = ((pages[:, None] * s + slot_iota) * num_kv_heads + h).reshape(bk, 1)
            # Keys past kv_len are not read (masked load, zero fill): no NaN from stale slots.
            kpos = blk * bk + key_iota  # [1, BK]
            kv_mask = None
            if masked:  # interior steps lie inside kv_len: plain (vectorizable) loads
                kv_mask = jnp.broadcast_to(kpos.reshape(bk, 1) < kv_len, (bk, d))
            k = compat.gpu_load(k_ref.at[rows_kv, cols], mask=kv_mask, other=zero)  # [BK, D]
            v = compat.gpu_load(v_ref.at[rows_kv, cols], mask=kv_mask, other=zero)
            if quantized:  # codes -> f32 * per-(token, head) scale -> q's dtype, in registers
                sc_mask = None if kv_mask is None else kpos.reshape(bk, 1) < kv_len
                col0 = jnp.zeros((1, 1), jnp.int32)  # scales [N * S * Hkv, 1]: one column
                ksc = compat.gpu_load(ks_ref.at[rows_kv, col0], mask=sc_mask, other=0)  # [BK, 1]
                vsc = compat.gpu_load(vs_ref.at[rows_kv, col0], mask=sc_mask, other=0)
                k = (k.astype(jnp.float32) * ksc).astype(q.dtype)
                v = (v.astype(jnp.float32) * vsc).astype(q.dtype)
            logits = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )  # [R, BK]
            if soft_cap is None:
                logits = logits * (sm_scale * _LOG2E)
            else:  # cap * tanh(x / cap), in log2 units
                logits = (soft_cap * _LOG2E) * jnp.tanh(logits * (sm_scale / soft_cap))
            if masked:  # causal (which also bounds keys by kv_len for real rows) + window
                mask = kpos <= row_pos
                if sliding_window is not None:
                    mask &= kpos > row_pos - sliding_window
                if chunk_size is not None:
                    mask &= kpos // chunk_size == row_pos // chunk_size
                logits = jnp.where(mask, logits, MASK_VALUE)
            m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
            alpha = jnp.exp2(m_prev - m_new)
            probs = jnp.exp2(logits - m_new)
            if masked:
                probs = jnp.where(mask, probs, 0.0)
            l_new = alpha * l_prev + jnp.sum(probs, axis=1, keepdims=True)
            pv = lax.dot_general(
                probs.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )  # fmt: skip
            return acc * alpha + pv, m_new, l_new

        init = (
            jnp.zeros((rows, d), jnp.float32),
            jnp.full((rows, 1), MASK_VALUE, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32),
        )
        # Steps whose every key is visible to every real row of the tile need no mask: keys
        # <= the first row's position (causal), > the last row's position - window and in the
        # last row's chunk (a tile crossing a chunk boundary has no unmasked step). The
        # walk is [blk_lo, full_lo) masked, [full_lo, full_hi) unmasked, [full_hi, blk_hi)
        # masked (the window edge, then the causal diagonal / kv_len edge).
        full_hi = jnp.clip((pos0 + 1) // bk, blk_lo, blk_hi)
        full_lo = blk_lo
        if sliding_window is not None:
            pos_last = pos0 + n_rows - 1
            full_lo = (pos_last - sliding_window + 1 + bk - 1) // bk
        if chunk_size is not None:
            last_chunk = ((pos0 + n_rows - 1) // chunk_size) * chunk_size
            full_lo = jnp.maximum(full_lo, (last_chunk + bk - 1) // bk)
        full_lo = jnp.clip(full_lo, blk_lo, full_hi)
        masked_body = functools.partial(body, masked=True)
        carry = lax.fori_loop(blk_lo, full_lo, masked_body, init)
        carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
        acc, m_i, l_i = lax.fori_loop(full_hi, blk_hi, masked_body, carry)

        tok_ok = lax.broadcasted_iota(jnp.int32, (bq, gp, d), 0) < n_rows
        if kv_splits == 1:
            (o_ref,) = out_refs
            out = jnp.where(l_i > 0, acc / jnp.where(l_i > 0, l_i, 1.0), 0.0)
            compat.gpu_store(
                o_ref.at[pl.ds(q0, bq), h, :, :],
                out.reshape(bq, gp, d).astype(o_ref.dtype),
                mask=tok_ok,
            )
        else:  # unnormalized partials; m in log2 units (merged by the wrapper)
            o_ref, m_ref, l_ref = out_refs
            tok_ok2 = lax.broadcasted_iota(jnp.int32, (bq, gp), 0) < n_rows
            compat.gpu_store(o_ref.at[split, pl.ds(q0, bq), h, :, :], acc.reshape(bq, gp, d),
                             mask=tok_ok)  # fmt: skip
            compat.gpu_store(m_ref.at[split, pl.ds(q0, bq), h, :], m_i.reshape(bq, gp),
                             mask=tok_ok2)  # fmt: skip
            compat.gpu_store(l_ref.at[split, pl.ds(q0, bq), h, :], l_i.reshape(bq, gp),
                             mask=tok_ok2)  # fmt: skip


# ------------------------------------------------------------------------------------------
# Wrapper
# ------------------------------------------------------------------------------------------


def _tile_map(
    cu_q_lens: jax.Array, num_seqs: jax.Array, bq: int, num_tiles: int
) -> tuple[jax.Array, jax.Array]:
    """tile -> (sequence or -1, first query offset within the sequence), int32 [num_tiles].

    Live tiles come in REVERSE token order (the last sequence's last tile first): a mixed batch
    usually ends with its prefill chunks and a chunk's later tiles have the longest causal
    range, so the heaviest programs start first (shorter tail). Dead tiles are at the end."""
    b = cu_q_lens.shape[0] - 1
    n = jnp.clip(num_seqs[0], 0, b)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    q_lens = jnp.where(jnp.arange(b) < n, jnp.maximum(q_lens, 0), 0)
    tiles = (q_lens + bq - 1) // bq  # [B]
    ends = jnp.cumsum(tiles)  # tiles of sequences 0..i
    total = ends[-1]
    idx = jnp.arange(num_tiles, dtype=jnp.int32)
    live = idx < total
    idx = jnp.where(live, total - 1 - idx, idx)
    seq = jnp.searchsorted(ends, idx, side="right").astype(jnp.int32)
    seq_c = jnp.minimum(seq, b - 1)
    off = (idx - (ends[seq_c] - tiles[seq_c])) * bq
    return jnp.where(live, seq_c, -1).astype(jnp.int32), jnp.where(live, off, 0).astype(jnp.int32)


def resolve_gpu_block_sizes(
    t: int, b: int, hkv: int, g: int, d: int, s: int, dtype: jnp.dtype,
    block_sizes: GpuBlockSizes | None = None,
) -> tuple[GpuBlockSizes, int, int, int, int]:  # fmt: skip
    """Pick block sizes; returns (block sizes, BQ, P, number of tiles, KV splits used)."""
    if block_sizes is None:
        tuning = get_gpu_tuning(d, s, dtype)
        bs = tuning.decode if t <= b else tuning.prefill
    else:
        bs = block_sizes
    gp = _next_pow2(g)
    bq = max(1, bs.rows_per_block // gp)
    # No tile needs more tokens than T (keeps small cases small); stays a power of 2.
    bq = min(bq, _next_pow2(t))
    while bq * gp < 16:
        bq *= 2
    p = max(bs.pages_per_block, _next_pow2(-(-16 // s)))  # BK = P * S >= 16
    num_tiles = -(-t // bq) + min(b, t)
    # Live tiles: a decode-shaped batch (T <= B) has about T of them (one per sequence); the
    # static bound above counts a partial tile for every sequence slot.
    live_tiles = min(t, b) if t <= b else num_tiles
    splits = bs.kv_splits
    if not bs.force_splits and live_tiles * hkv >= _FEW_PROGRAMS:
        splits = 1
    return bs, bq, p, num_tiles, splits


def ragged_paged_attention_gpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_sizes: GpuBlockSizes | None = None,
    interpret: bool | None = None,
    chunk_size: int | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """The Pallas GPU (Triton) kernel; shapes and rules as in the module docstring.

    Expects inputs already checked against the shared contract (`ragged_paged_attention` does
    that); checks the kernel's own rules (dtypes, powers of two). interpret: None = run under
    Pallas' interpreter whenever JAX's default backend is not a GPU. Trace it under jit.
    k_scale, v_scale: float32 [N, S, Hkv] when the caches hold int8 / float8_e4m3fn codes.
    """
    check_gpu_kernel_inputs(q, k_cache, quantized=k_scale is not None)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    t, hq, d = q.shape
    n, s, hkv, _ = k_cache.shape
    b, m = block_tables.shape
    g = hq // hkv
    gp = _next_pow2(g)
    dp = padded_head_dim(d)  # Triton blocks are powers of 2: q and out carry zero columns
    bs, bq, p, num_tiles, splits = resolve_gpu_block_sizes(
        t, b, hkv, g, dp, s, q.dtype, block_sizes
    )

    tile_seq, tile_off = _tile_map(cu_q_lens, num_seqs, bq, num_tiles)
    # q as [T + BQ, Hkv, Gp, Dp]: a tile's [BQ, Gp, Dp] block load never leaves the array.
    q4 = q.reshape(t, hkv, g, d)
    q4 = jnp.pad(q4, ((0, bq), (0, 0), (0, gp - g), (0, dp - d)))
    m_pad = -(-m // p) * p
    bt = block_tables if m_pad == m else jnp.pad(block_tables, ((0, 0), (0, m_pad - m)))

    kernel = functools.partial(
        _rpa_gpu_kernel,
        sm_scale=float(sm_scale),
        sliding_window=None if sliding_window is None else int(sliding_window),
        soft_cap=None if soft_cap is None else float(soft_cap),
        bq=bq,
        chunk_size=None if chunk_size is None else int(chunk_size),
        pages_per_block=p,
        page_size=s,
        num_kv_heads=hkv,
        num_pages=n,
        kv_splits=splits,
        head_dim=d,
        quantized=k_scale is not None,
    )
    t_rows = t + bq
    if splits == 1:
        grid: tuple[int, ...] = (num_tiles, hkv)
        out_shape: object = jax.ShapeDtypeStruct((t_rows, hkv, gp, dp), q.dtype)
    else:
        grid = (num_tiles, hkv, splits)
        out_shape = [
            jax.ShapeDtypeStruct((splits, t_rows, hkv, gp, dp), jnp.float32),
            jax.ShapeDtypeStruct((splits, t_rows, hkv, gp), jnp.float32),
            jax.ShapeDtypeStruct((splits, t_rows, hkv, gp), jnp.float32),
        ]
    res = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        compiler_params=compat.gpu_compiler_params(bs.num_warps, bs.num_stages),
        interpret=interpret,
        name=f"xlaserve_rpa_gpu_r{bq * gp}_p{p}_s{splits}",
    )(
        tile_seq, tile_off, kv_lens, bt, cu_q_lens, q4,
        k_cache.reshape(n * s * hkv, d), v_cache.reshape(n * s * hkv, d),
        *(() if k_scale is None else (k_scale.reshape(n * s * hkv, 1).astype(jnp.float32),
                                      v_scale.reshape(n * s * hkv, 1).astype(jnp.float32))),
    )  # fmt: skip

    if splits == 1:
        out = res
    else:  # merge the KV chunks: rescale each by 2^(m_i - m_max)
        o_part, m_part, l_part = res
        # Every split of a live tile writes its rows (an empty chunk writes acc 0, l 0,
        # m MASK_VALUE: weight 0). Rows no tile owns hold garbage and are zeroed below.
        m_max = jnp.max(m_part, axis=0)
        w = jnp.exp2(m_part - m_max[None])
        l_sum = jnp.sum(w * l_part, axis=0)
        o_sum = jnp.sum(w[..., None] * o_part, axis=0)
        out = jnp.where(l_sum[..., None] > 0, o_sum / jnp.where(l_sum > 0, l_sum, 1.0)[..., None],
                        0.0)  # fmt: skip
    out = out[:t, :, :g, :d].reshape(t, hq, d)
    # Rows no tile owns (padding tokens) were never written: zero them.
    nseq = jnp.clip(num_seqs[0], 0, b)
    tok = jnp.arange(t)
    valid = (tok >= cu_q_lens[0]) & (tok < cu_q_lens[nseq])
    return jnp.where(valid[:, None, None], out, jnp.zeros((), out.dtype)).astype(q.dtype)
