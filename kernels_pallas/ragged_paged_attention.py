"""Ragged paged attention: one call for a batch that mixes prefill chunks and decodes.

Shapes (axis letters as in the glossary): q [T, Hq, D]; KV cache [N, S, Hkv, D] (N pages of S
slots); kv_lens [B]; block_tables [B, M] (M = max pages per sequence); cu_q_lens [B+1];
num_seqs [1]. The queries of sequence i are the LAST q_len_i positions of its kv_len_i context
(causal), so a decode is q_len 1 and a prefill chunk is q_len > 1 over an already-cached prefix.

Three entry points:
- `write_kv`: scatter this step's K/V into the cache (slot = page * S + offset; slot < 0 is
  padding and writes nothing). It is a *companion*, not fused into the kernel: an XLA scatter
  under jit with the cache donated updates the cache in place, costs one HBM write of the new
  tokens only, and lets the attention kernel treat the cache as read-only (no aliasing, so
  both grid axes stay "parallel").
- `ref_ragged_paged_attention`: plain jnp, vectorized and jit-able with static shapes; it
  gathers every token's pages (memory O(T * M * S * Hkv * D): the reference).
- `chunked_ragged_paged_attention`: plain jnp, an online softmax over page chunks in a loop
  whose trip count follows the live context lengths (the CPU path and the GPU fallback).
- `ragged_paged_attention(impl=...)`: "reference", "chunked_xla", "pallas_tpu" (the Mosaic
  kernel below; runs on CPU under TPU interpret mode), "pallas_gpu" (the Pallas Triton kernel in
  ragged_paged_attention_gpu.py; runs on CPU under Pallas' interpreter) or "auto" (pallas_tpu
  when JAX's backend is TPU, `GPU_AUTO_IMPL` on a GPU where its kernel takes the shape, else
  chunked_xla).

The Mosaic kernel
-----------------
Algorithm: flash attention with online softmax over KV blocks of P pages (bk = P * S keys).
Float32 accumulators (running max m, running sum l, output acc) live in VMEM scratch.

Grid: (Hkv / hb, T_pad / tq), both "parallel" (every grid step is self-contained).
- axis 0: a block of hb KV heads (default all of them, so one page DMA is one contiguous
  [S, Hkv, D] slab). Query heads of the block: hb * G with G = Hq / Hkv.
- axis 1: a block of tq query tokens. A token block can straddle several sequences; inside
  the step a loop walks the sequences overlapping it (found by binary search on cu_q_lens)
  and, per sequence, only the KV blocks some query row of this block can see: from the
  sliding-window start of its first row to the causal end of its last row. The KV axis is an
  in-kernel loop rather than a grid axis because its trip count is ragged (data-dependent).
Scalar prefetch (SMEM): kv_lens, block_tables (flattened to [B * M]), cu_q_lens, num_seqs.

Memory traffic: q is handed to the kernel as [Hkv, G, T, D] (the wrapper transposes; one extra
pass over q/out, small next to KV) so a query block [hb, G, tq, D] arrives by the normal
BlockSpec pipeline and each head's rows are a leading-axis index. K and V stay in HBM
(memory space ANY); for each KV block the kernel starts one async DMA per page
(`make_async_copy(cache.at[page, :, heads], buf.at[slot, p])`), double-buffered: the copies of
the next (sequence, KV block) are started before computing on the current one, and pages that
hold no key the block's rows need (past kv_len, before the window) are not fetched at all.
Each cached page is read once per (head block, query block) that needs it: a decode reads its
context once; a prefill chunk of q_len tokens reads it ceil(q_len / tq) times.

No `Ref.reshape` anywhere (the TPU interpreter lacks it): refs are only indexed
(`.at[...]`, `pl.ds`); the [P, S, D] -> [P * S, D] and [G, tq, D] -> [G * tq, D] merges are
value reshapes of leading axes into the sublane axis (S and tq are multiples of 8).

Masking: a key at position k is visible to a query at position p iff k < kv_len, k <= p and,
with a sliding window w, k > p - w (HF Mistral semantics), and, with an attention chunk C
(Llama 4 chunked attention), k // C == p // C (chunks aligned to position 0). Soft cap: cap * tanh(s / cap) before
masking. Masked logits get a large finite negative value (never -inf - -inf = NaN); rows of
other sequences keep their state; padding rows end with l = 0 and are written as zeros.

Quantized cache (kv_cache_dtype "int8" / "fp8", contract in xlaserve.quantization.kv_quant):
the K/V pages hold int8 / float8_e4m3fn codes and two more HBM arrays k_scale, v_scale
[N, S, Hkv] float32 hold one scale per (token, KV head). `write_kv_quant` quantizes and
scatters; the reference dequantizes the gathered pages; the kernel DMAs each scale page next to
its code page (same slot, same double buffering; 4 semaphores per slot) and dequantizes in VMEM
(codes -> f32 * scale -> q's dtype) right before the dots. Page traffic per token and head is
D + 4 bytes instead of 2 * D (bf16). Not yet run on a real TPU: int8 pages tile as (32, 128)
in VMEM, so pages of 32+ slots are the safe choice there.

Tuning table: `TUNED_BLOCK_SIZES[(head_dim, page_size, dtype name)] -> BlockSizes` (pages per
KV block, query tokens per block, KV heads per block), default `BlockSizes.default_for`. The
entries are starting points picked for the MXU/VMEM shape (a KV block of >= 128 keys, queries
per block a multiple of 16), NOT yet measured on a TPU: re-tune there and edit the table.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from xlaserve.kernels_pallas import compat
from xlaserve.kernels_pallas.kv_cache_quant import dequantize_kv, kv_cache_dtype_of, quantize_kv
from xlaserve.kernels_pallas.ragged_paged_attention_gpu import (
    GpuBlockSizes,
    gpu_kernel_supports,
    ragged_paged_attention_gpu,
)

# A large finite negative logit for masked keys: exp(MASK - m) underflows to 0, and a row whose
# keys are all masked in one block never computes -inf - (-inf).
MASK_VALUE: float = -0.7 * float(np.finfo(np.float32).max)
# What impl="auto" runs on a GPU backend: whichever of "reference" / "pallas_gpu" is faster.
# Measured on the H200 (python -m xlaserve.bench.kernels.rpa_gpu, Llama-8B heads, bf16,
# median us, reference -> pallas_gpu with the starting tiles): decode batch 1 239 -> 256 (174
# with the tuned decode tiles now in TUNED_GPU_BLOCK_SIZES), batch 32 440 -> 364, batch 256
# 1,329 -> 638, mixed 4 x 256 prefill + 200 decodes 4,588 -> 679, prefill 1 x 2048 331 (the
# reference needs ~53 GB of temporaries there and was not run). So the kernel.
GPU_AUTO_IMPL: str = "pallas_gpu"
# Whether impl="auto" also gives the GPU kernel the shapes it learned last (int8 / fp8 caches,
# head dims that are not a power of 2). Run by XLA's Triton on the H200 (2026-12-05,
# `pytest tests/kernels_pallas/test_rpa_gpu.py`): head_dim 48 (bf16, window + soft cap) and 80
# (f32), int8 and fp8 caches (bf16 and f32) compile and match the float64 oracle (f32 at TF32
# precision, as XLA's own dots on a GPU). False sends them to the jnp path (chunked_xla).
GPU_AUTO_EXTENDED: bool = True
_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Lane width used for the replicated m/l scratch (TPU vregs are [8, 128]).
_LANES = 128


# ------------------------------------------------------------------------------------------
# Block sizes (data, not code)
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Block sizes of the Mosaic kernel.

    pages_per_block: P, pages per KV block (bk = P * S keys per online-softmax step).
    queries_per_block: tq, query tokens per grid step (multiple of 8).
    kv_heads_per_block: hb, KV heads per grid step (divides Hkv); None = all heads.
    """

    pages_per_block: int
    queries_per_block: int
    kv_heads_per_block: int | None = None

    def __post_init__(self) -> None:
        if self.pages_per_block < 1:
            raise ValueError(f"pages_per_block must be >= 1, got {self.pages_per_block}")
        if self.queries_per_block < 8 or self.queries_per_block % 8:
            raise ValueError(
                f"queries_per_block must be a positive multiple of 8, got {self.queries_per_block}"
            )
        if self.kv_heads_per_block is not None and self.kv_heads_per_block < 1:
            raise ValueError(f"kv_heads_per_block must be >= 1, got {self.kv_heads_per_block}")

    @staticmethod
    def default_for(head_dim: int, page_size: int, dtype: jnp.dtype) -> BlockSizes:
        """No table entry: a KV block of ~128 keys (one MXU-wide tile), 32 queries per block."""
        del head_dim, dtype
        return BlockSizes(pages_per_block=max(1, 128 // page_size), queries_per_block=32)


# (head_dim, page_size, dtype name) -> BlockSizes. Starting points, not TPU-measured yet.
TUNED_BLOCK_SIZES: dict[tuple[int, int, str], BlockSizes] = {
    (128, 16, "bfloat16"): BlockSizes(pages_per_block=16, queries_per_block=32),
    (128, 32, "bfloat16"): BlockSizes(pages_per_block=8, queries_per_block=32),
    (128, 64, "bfloat16"): BlockSizes(pages_per_block=4, queries_per_block=32),
    (128, 128, "bfloat16"): BlockSizes(pages_per_block=2, queries_per_block=32),
    (64, 16, "bfloat16"): BlockSizes(pages_per_block=16, queries_per_block=64),
    (64, 32, "bfloat16"): BlockSizes(pages_per_block=8, queries_per_block=64),
    (128, 16, "float32"): BlockSizes(pages_per_block=8, queries_per_block=32),
    (128, 32, "float32"): BlockSizes(pages_per_block=4, queries_per_block=32),
    (64, 16, "float32"): BlockSizes(pages_per_block=8, queries_per_block=32),
}

# Keep the double-buffered K/V pages + q/out blocks + scratch under this (v5e has 16 MiB of
# scoped VMEM by default; leave room for the pipeline's own buffers).
_VMEM_BUDGET_BYTES = 12 * 1024 * 1024


def get_block_sizes(head_dim: int, page_size: int, dtype: jnp.dtype) -> BlockSizes:
    """Table lookup with the default as fallback."""
    key = (int(head_dim), int(page_size), jnp.dtype(dtype).name)
    return TUNED_BLOCK_SIZES.get(key) or BlockSizes.default_for(head_dim, page_size, dtype)


def _vmem_bytes(
    p: int, s: int, hb: int, g: int, tq: int, d: int, itemsize: int, kv_itemsize: int = 0,
    quantized: bool = False,
) -> int:  # fmt: skip
    kv_bufs = 2 * 2 * p * s * hb * d * (kv_itemsize or itemsize)  # K and V, two slots
    if quantized:  # f32 scale pages [P, S, hb], lane-padded to 128
        kv_bufs += 2 * 2 * p * s * (-(-hb // _LANES) * _LANES) * 4
    q_out = 2 * 2 * hb * g * tq * d * itemsize  # q and out blocks, pipelined (two buffers)
    scratch = hb * g * tq * (d + 2 * _LANES) * 4  # acc, m, l in f32
    return kv_bufs + q_out + scratch


# ------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------


def _check_inputs(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    sliding_window: int | None,
    soft_cap: float | None,
    impl: str,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    chunk_size: int | None = None,
) -> None:
    if impl != "auto" and impl not in RPA_IMPLS:
        raise ValueError(f"impl must be one of {('auto', *RPA_IMPLS)}, got {impl!r}")
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}")
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must be [N, S, Hkv, D], got shape {k_cache.shape}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ in shape")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) dtypes differ")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale must be given together (a quantized cache)")
    if k_scale is None:
        if kv_cache_dtype_of(k_cache.dtype) is not None:
            raise ValueError(f"a {k_cache.dtype} kv cache needs k_scale and v_scale")
        if q.dtype != k_cache.dtype:
            raise ValueError(f"q dtype {q.dtype} != kv cache dtype {k_cache.dtype}")
    else:
        if kv_cache_dtype_of(k_cache.dtype) is None:
            raise ValueError(
                f"scales given but the kv cache dtype {k_cache.dtype} is not int8 / float8_e4m3fn"
            )
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc.shape != k_cache.shape[:3] or sc.dtype != jnp.float32:
                raise ValueError(
                    f"{name} must be float32 [N, S, Hkv] = {k_cache.shape[:3]}, "
                    f"got {sc.dtype} {sc.shape}"
                )
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q/k/v must be floating point, got {q.dtype}")
    _, hq, d = q.shape
    _, _, hkv, dk = k_cache.shape
    if d != dk:
        raise ValueError(f"head_dim of q ({d}) != head_dim of the kv cache ({dk})")
    if hq % hkv:
        raise ValueError(f"Hq ({hq}) must be a multiple of Hkv ({hkv})")
    if kv_lens.ndim != 1:
        raise ValueError(f"kv_lens must be [B], got shape {kv_lens.shape}")
    b = kv_lens.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be [B={b}, M], got shape {block_tables.shape}")
    if cu_q_lens.shape != (b + 1,):
        raise ValueError(f"cu_q_lens must be [B+1={b + 1}], got shape {cu_q_lens.shape}")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must be [1], got shape {num_seqs.shape}")
    for name, arr in (
        ("kv_lens", kv_lens),
        ("block_tables", block_tables),
        ("cu_q_lens", cu_q_lens),
        ("num_seqs", num_seqs),
    ):
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {arr.dtype}")
    if sliding_window is not None and (int(sliding_window) != sliding_window or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    if chunk_size is not None and (int(chunk_size) != chunk_size or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")


def _check_kernel_inputs(q: jax.Array, k_cache: jax.Array, bs: BlockSizes) -> None:
    if jnp.dtype(q.dtype) not in _KERNEL_DTYPES:
        raise ValueError(f"pallas_tpu supports float32 and bfloat16, got {q.dtype}")
    d = q.shape[-1]
    s = k_cache.shape[1]
    if d % 8:
        raise ValueError(f"pallas_tpu needs head_dim % 8 == 0, got {d}")
    if s % 8:
        raise ValueError(f"pallas_tpu needs page size % 8 == 0 (sublane tiling), got {s}")
    hkv = k_cache.shape[2]
    if bs.kv_heads_per_block is not None and hkv % bs.kv_heads_per_block:
        raise ValueError(f"kv_heads_per_block {bs.kv_heads_per_block} must divide Hkv {hkv}")


# ------------------------------------------------------------------------------------------
# write_kv
# ------------------------------------------------------------------------------------------


@jax.jit
def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V rows into the paged cache.

    k_cache, v_cache: [N, S, Hkv, D]; k_new, v_new: [T, Hkv, D]; slot_mapping: int32 [T] with
    slot = page * S + offset. Slots < 0 are padding: they are routed to page N (out of range)
    and dropped, so they write nowhere (a negative index would otherwise wrap around). Returns
    the updated (k_cache, v_cache); donate the caches under jit to update them in place.
    """
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must both be [N, S, Hkv, D]: {k_cache.shape}, {v_cache.shape}")
    n, s, hkv, d = k_cache.shape
    t = slot_mapping.shape[0]
    if slot_mapping.ndim != 1:
        raise ValueError(f"slot_mapping must be [T], got {slot_mapping.shape}")
    if k_new.shape != (t, hkv, d) or v_new.shape != (t, hkv, d):
        raise ValueError(
            f"k_new/v_new must be [T={t}, Hkv={hkv}, D={d}], got {k_new.shape}, {v_new.shape}"
        )
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(f"slot_mapping must be an integer array, got {slot_mapping.dtype}")
    slots = slot_mapping.astype(jnp.int32)
    page = jnp.where(slots < 0, n, slots // s)
    offset = jnp.where(slots < 0, 0, slots % s)
    k_cache = k_cache.at[page, offset].set(k_new.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[page, offset].set(v_new.astype(v_cache.dtype), mode="drop")
    return k_cache, v_cache


@jax.jit
def write_kv_quant(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_scale: jax.Array,
    v_scale: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Quantize new K/V rows (per token, per KV head; xlaserve.quantization.kv_quant) and
    scatter codes and scales into a quantized paged cache.

    k_cache, v_cache: [N, S, Hkv, D] int8 or float8_e4m3fn (the dtype picks the format);
    k_scale, v_scale: float32 [N, S, Hkv]; k_new, v_new: [T, Hkv, D] float; slot_mapping as in
    `write_kv` (< 0: padding, writes nothing). Returns the updated (k, v, k_scale, v_scale).
    """
    name = kv_cache_dtype_of(k_cache.dtype)
    if name is None or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"quantized caches must be int8 or float8_e4m3fn, got {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_scale.shape != k_cache.shape[:3] or v_scale.shape != k_cache.shape[:3]:
        raise ValueError(
            f"scales must be [N, S, Hkv] = {k_cache.shape[:3]}, got {k_scale.shape}, {v_scale.shape}"
        )
    kq, ks = quantize_kv(k_new, name)
    vq, vs = quantize_kv(v_new, name)
    k_cache, v_cache = write_kv(k_cache, v_cache, kq, vq, slot_mapping)
    # Scales [N, S, Hkv] scattered as [N, S, Hkv, 1] pages by the same routine.
    k_scale, v_scale = write_kv(k_scale[..., None], v_scale[..., None], ks[..., None], vs[..., None],
                                slot_mapping)  # fmt: skip
    return k_cache, v_cache, k_scale[..., 0], v_scale[..., 0]


# ------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------


def _token_metadata(
    t: int, kv_lens: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token: its sequence, its absolute position, and whether it is a real token."""
    b = kv_lens.shape[0]
    tok = jnp.arange(t, dtype=jnp.int32)
    n = jnp.clip(num_seqs[0], 0, b)
    # seq of token t = number of sequences ending at or before t (cu_q_lens is non-decreasing).
    seq = jnp.searchsorted(cu_q_lens[1:], tok, side="right").astype(jnp.int32)
    seq = jnp.clip(seq, 0, b - 1)
    valid = (tok < cu_q_lens[n]) & (tok >= cu_q_lens[0])
    q_start = cu_q_lens[seq]
    q_len = cu_q_lens[seq + 1] - q_start
    pos = kv_lens[seq] - q_len + (tok - q_start)
    return seq, pos, valid


def _gather_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_scale: jax.Array | None,
    v_scale: jax.Array | None,
    pages: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """K and V of pages [T, P] as float32 [T, P * S, Hkv, D] (int8 / fp8 codes dequantized)."""
    t, p = pages.shape
    _, s, hkv, d = k_cache.shape
    if k_scale is None:
        k, v = k_cache[pages].astype(jnp.float32), v_cache[pages].astype(jnp.float32)
    else:
        k = dequantize_kv(k_cache[pages], k_scale[pages])
        v = dequantize_kv(v_cache[pages], v_scale[pages])
    return k.reshape(t, p * s, hkv, d), v.reshape(t, p * s, hkv, d)


def _key_mask(
    kpos: jax.Array,
    kv_len: jax.Array,
    pos: jax.Array,
    valid: jax.Array,
    sliding_window: int | None,
    chunk_size: int | None,
) -> jax.Array:
    """bool [T, L]: token t (at position pos[t], context kv_len[t]) sees key position kpos
    [1, L]: causal, inside its context, in its window and its Llama 4 chunk; padding sees none."""
    mask = (kpos < kv_len[:, None]) & (kpos <= pos[:, None]) & valid[:, None]
    if sliding_window is not None:
        mask &= kpos > pos[:, None] - sliding_window
    if chunk_size is not None:
        mask &= kpos // chunk_size == pos[:, None] // chunk_size
    return mask


def ref_ragged_paged_attention(
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
    impl: str = "reference",
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    sinks: jax.Array | None = None,
    chunk_size: int | None = None,
) -> jax.Array:
    """Plain jnp ragged paged attention (same contract as `ragged_paged_attention`).
    alibi_slopes: float32 [Hq] (reference only): logits += slope[h] * key position (ALiBi).
    sinks: float32 [Hq] (reference only): one more logit per head in each softmax denominator
    (gpt-oss attention sinks).

    Gathers, for every token, its sequence's M pages: k [T, M*S, Hkv, D] (dequantized to
    float32 with k_scale/v_scale [N, S, Hkv] for an int8/fp8 cache), then masks (causal,
    kv_len, window, chunk) and softmaxes in float32. Returns [T, Hq, D] in q's dtype, zeros for
    padding tokens. `impl` is accepted (and ignored) so both functions share a signature.
    """
    del impl
    t, hq, d = q.shape
    n, s, hkv, _ = k_cache.shape
    m = block_tables.shape[1]
    g = hq // hkv
    seq, pos, valid = _token_metadata(t, kv_lens, cu_q_lens, num_seqs)

    pages = jnp.clip(block_tables[seq], 0, n - 1)  # [T, M]
    k, v = _gather_kv(k_cache, v_cache, k_scale, v_scale, pages)  # [T, L, Hkv, D]
    kpos = jnp.arange(m * s, dtype=jnp.int32)[None, :]  # [1, L]
    # Slots past kv_len may hold anything (even NaN): zero V there so 0 * NaN stays out.
    v = jnp.where((kpos < kv_lens[seq][:, None])[:, :, None, None], v, 0.0)
    qf = q.astype(jnp.float32).reshape(t, hkv, g, d)
    logits = jnp.einsum("tkgd,tlkd->tkgl", qf, k) * sm_scale  # [T, Hkv, G, L]
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.astype(jnp.float32).reshape(1, hkv, g, 1)
        logits = logits + slopes * kpos.astype(jnp.float32)[:, None, None, :]
    mask = _key_mask(kpos, kv_lens[seq], pos, valid, sliding_window, chunk_size)
    mask = mask[:, None, None, :]  # [T, 1, 1, L]
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, hkv, g, 1)
    if sink is not None:
        row_max = jnp.maximum(row_max, sink)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + jnp.exp(sink - row_max)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("tkgl,tlkd->tkgd", p, v)
    return out.reshape(t, hq, d).astype(q.dtype)


# Keys per loop step of `chunked_ragged_paged_attention` (rounded down to whole pages). Chosen on
# the 2-core CPU host (demo model, batch 64 decode, ~100-token contexts): see bench/RESULTS.md.
CHUNKED_KEYS_PER_STEP: int = 32


def chunked_ragged_paged_attention(
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
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    chunk_size: int | None = None,
    keys_per_step: int = CHUNKED_KEYS_PER_STEP,
) -> jax.Array:
    """The reference's contract (no ALiBi / sinks) with work proportional to the live context.

    The reference gathers all M pages of every token's sequence (T * M * S keys) whatever the
    real context lengths are. This walks the keys in chunks of P = keys_per_step // S pages with
    a `lax.while_loop` whose trip count is data-dependent: from the chunk holding the earliest
    key any real token can see (sliding window) to the one holding the longest real context.
    Each step gathers [T, P * S, Hkv, D] and folds it into a float32 online softmax (running
    max m [T, Hkv, G], sum l, output acc [T, Hkv, G, D]), as the kernels do. Plain jnp: the CPU
    path, and the GPU fallback where the Pallas kernel does not take the shape.
    Returns [T, Hq, D] in q's dtype, zeros for padding tokens.
    """
    t, hq, d = q.shape
    n, s, hkv, _ = k_cache.shape
    b, m = block_tables.shape
    g = hq // hkv
    pages_per_step = max(1, min(m, keys_per_step // s))
    steps_max = -(-m // pages_per_step)
    if steps_max == 1:  # one chunk holds every page: the reference is the same work, no loop
        # (a one-trip loop's gather is loop-invariant; XLA hoists it next to the cache write and
        # then copies the whole cache each step)
        return ref_ragged_paged_attention(
            q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            k_scale=k_scale, v_scale=v_scale, chunk_size=chunk_size,
        )  # fmt: skip
    width = steps_max * pages_per_step
    tables = jnp.pad(block_tables, ((0, 0), (0, width - m)))  # padded pages are masked below
    keys = pages_per_step * s
    seq, pos, valid = _token_metadata(t, kv_lens, cu_q_lens, num_seqs)
    kv_len = kv_lens[seq]  # [T]
    live = jnp.arange(b) < jnp.clip(num_seqs[0], 0, b)
    hi = -(-jnp.max(jnp.where(live, kv_lens, 0)) // keys)  # chunks up to the longest context
    if sliding_window is None:
        lo = jnp.int32(0)
    else:  # the first chunk any real token's window reaches
        first = jnp.where(valid, jnp.maximum(pos - sliding_window + 1, 0), jnp.iinfo(jnp.int32).max)
        lo = jnp.minimum(jnp.min(first) // keys, hi)
    qf = q.astype(jnp.float32).reshape(t, hkv, g, d) * sm_scale

    def body(carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        c, m_i, l_i, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(tables, c * pages_per_step, pages_per_step, axis=1)
        pages = jnp.clip(pages[seq], 0, n - 1)  # [T, P]
        k, v = _gather_kv(k_cache, v_cache, k_scale, v_scale, pages)  # [T, K, Hkv, D]
        kpos = c * keys + jnp.arange(keys, dtype=jnp.int32)[None, :]  # [1, K]
        mask = _key_mask(kpos, kv_len, pos, valid, sliding_window, chunk_size)
        # Slots past kv_len may hold anything (even NaN): zero V there so 0 * NaN stays out.
        v = jnp.where(mask[:, :, None, None], v, 0.0)
        logits = jnp.einsum("tkgd,tlkd->tkgl", qf, k)  # [T, Hkv, G, K]
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        logits = jnp.where(mask[:, None, None, :], logits, MASK_VALUE)
        m_new = jnp.maximum(m_i, jnp.max(logits, axis=-1))
        alpha = jnp.exp(m_i - m_new)
        p = jnp.where(mask[:, None, None, :], jnp.exp(logits - m_new[..., None]), 0.0)
        l_new = alpha * l_i + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("tkgl,tlkd->tkgd", p, v)
        return c + 1, m_new, l_new, acc

    init = (
        lo,
        jnp.full((t, hkv, g), MASK_VALUE, jnp.float32),
        jnp.zeros((t, hkv, g), jnp.float32),
        jnp.zeros((t, hkv, g, d), jnp.float32),
    )
    _, _, l_f, acc = jax.lax.while_loop(lambda cr: cr[0] < hi, body, init)
    out = acc / jnp.where(l_f > 0, l_f, 1.0)[..., None]
    return out.reshape(t, hq, d).astype(q.dtype)


# ------------------------------------------------------------------------------------------
# The Mosaic kernel
# ------------------------------------------------------------------------------------------


def _rpa_kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [B]
    block_tables_ref,  # [B * M]
    cu_q_lens_ref,  # [B + 1]
    num_seqs_ref,  # [1]
    *refs,
    quantized: bool,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    pages_per_block: int,
    chunk_size: int | None = None,
    max_pages_per_seq: int,
    num_pages: int,
    batch: int,
) -> None:
    """refs, float cache: q_ref (VMEM block [hb, G, tq, D]), k_hbm_ref, v_hbm_ref (ANY
    [N, S, Hkv, D]), o_ref (VMEM block [hb, G, tq, D]), then scratch k_buf, v_buf (VMEM
    [2, P, S, hb, D]), sems (DMA [2 (k, v), 2 (slot)]), m_ref, l_ref (f32 [hb, G * tq, 128],
    running max / denominator, lane-replicated), acc_ref (f32 [hb, G * tq, D]).
    Quantized cache (int8 / fp8 codes): ks_hbm_ref, vs_hbm_ref (ANY f32 [N, S, Hkv]) follow
    v_hbm_ref, ks_buf, vs_buf (VMEM f32 [2, P, S, hb]) follow v_buf, and sems is [4 (k, v,
    k scale, v scale), 2]: scale pages ride the same double-buffered DMA as their code pages and
    are applied in VMEM (codes -> float32 * scale -> q's dtype) before the dots."""
    if quantized:
        (q_ref, k_hbm_ref, v_hbm_ref, ks_hbm_ref, vs_hbm_ref, o_ref,
         k_buf, v_buf, ks_buf, vs_buf, sems, m_ref, l_ref, acc_ref) = refs  # fmt: skip
    else:
        q_ref, k_hbm_ref, v_hbm_ref, o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref = refs
        ks_hbm_ref = vs_hbm_ref = ks_buf = vs_buf = None
    hb, g, tq, d = q_ref.shape
    s_page = k_buf.shape[2]
    n_kv_heads = k_hbm_ref.shape[2]
    p_blk = pages_per_block
    bk = p_blk * s_page
    rows = g * tq
    h0 = pl.program_id(0) * hb
    t0 = pl.program_id(1) * tq
    t1 = t0 + tq
    num_seqs = jnp.minimum(num_seqs_ref[0], batch)

    def first_seq_where(pred) -> jax.Array:
        """Smallest s in [0, num_seqs) with pred(s) (monotone), else num_seqs."""

        def body(_, lo_hi):
            lo, hi = lo_hi
            mid = (lo + hi) // 2
            go_left = pred(jnp.minimum(mid, batch - 1))
            active = lo < hi
            new_hi = jnp.where(active & go_left, mid, hi)
            new_lo = jnp.where(active & ~go_left, mid + 1, lo)
            return new_lo, new_hi

        n_iter = max(1, math.ceil(math.log2(batch + 1)) + 1)
        lo, _ = lax.fori_loop(0, n_iter, body, (jnp.int32(0), num_seqs))
        return lo

    # Sequences overlapping this token block: [seq_lo, seq_hi).
    seq_lo = first_seq_where(lambda s: cu_q_lens_ref[s + 1] > t0)
    seq_hi = first_seq_where(lambda s: cu_q_lens_ref[s] >= t1)

    def seq_info(s):
        """Scalars of sequence s restricted to this token block (s clamped for safe reads)."""
        s = jnp.minimum(s, batch - 1)
        q_start = cu_q_lens_ref[s]
        q_end = cu_q_lens_ref[s + 1]
        kv_len = kv_lens_ref[s]
        ctx0 = kv_len - (q_end - q_start)  # absolute position of the sequence's first query
        r_lo = jnp.maximum(q_start, t0)
        r_hi = jnp.minimum(q_end, t1)
        k_hi = jnp.minimum(ctx0 + (r_hi - q_start), kv_len)  # causal end of the last row
        if sliding_window is None:
            k_lo = jnp.int32(0)
        else:
            k_lo = jnp.maximum(ctx0 + (r_lo - q_start) - sliding_window + 1, 0)
        if chunk_size is not None:  # nothing before the chunk of the first row
            k_lo = jnp.maximum(k_lo, ((ctx0 + (r_lo - q_start)) // chunk_size) * chunk_size)
        nonempty = (r_lo < r_hi) & (k_lo < k_hi)
        return dict(
            s=s,
            q_start=q_start,
            q_end=q_end,
            kv_len=kv_len,
            ctx0=ctx0,
            k_lo=k_lo,
            k_hi=k_hi,
            blk_lo=k_lo // bk,
            blk_hi=(k_hi + bk - 1) // bk,
            nonempty=nonempty,
        )

    def next_nonempty(s):
        return lax.while_loop(lambda s: (s < seq_hi) & ~seq_info(s)["nonempty"], lambda s: s + 1, s)

    def page_copy(blk, slot, p, info):
        """(needed, [DMA copies]) of page p of KV block `blk` of the sequence of `info`."""
        page_in_seq = blk * p_blk + p
        start = page_in_seq * s_page
        # Pages holding no key this block's rows can see (past kv_len, before window / chunk).
        needed = (start < info["k_hi"]) & (start + s_page > info["k_lo"])
        idx = info["s"] * max_pages_per_seq + jnp.minimum(page_in_seq, max_pages_per_seq - 1)
        page = jnp.clip(block_tables_ref[idx], 0, num_pages - 1)
        pairs = [(k_hbm_ref, k_buf), (v_hbm_ref, v_buf)]
        if quantized:
            pairs += [(ks_hbm_ref, ks_buf), (vs_hbm_ref, vs_buf)]
        copies = []
        for i, (src, dst) in enumerate(pairs):
            if hb == n_kv_heads:  # all heads: one contiguous [S, Hkv, D] (scales [S, Hkv]) page
                src = src.at[page]
            elif i < 2:
                src = src.at[page, :, pl.ds(h0, hb), :]
            else:
                src = src.at[page, :, pl.ds(h0, hb)]
            copies.append(compat.make_async_copy(src, dst.at[slot, p], sems.at[i, slot]))
        return needed, copies

    def for_each_page(blk, slot, info, action: str) -> None:
        """Start (or wait for) the DMAs of every needed page of one KV block."""

        def body(p, carry):
            needed, copies = page_copy(blk, slot, p, info)

            @pl.when(needed)
            def _() -> None:
                for c in copies:
                    getattr(c, action)()

            return carry

        lax.fori_loop(0, p_blk, body, 0)

    def start_block(blk, slot, info) -> None:
        for_each_page(blk, slot, info, "start")

    def wait_block(blk, slot, info) -> None:
        for_each_page(blk, slot, info, "wait")

    def compute_block(blk, slot, info) -> None:
        # Row r of a head's [G * tq, D] query slab is (group g = r // tq, token t0 + r % tq).
        row = lax.broadcasted_iota(jnp.int32, (rows, bk), 0)
        col = lax.broadcasted_iota(jnp.int32, (rows, bk), 1)
        tok = t0 + row % tq
        in_seq = (tok >= info["q_start"]) & (tok < info["q_end"])
        qpos = info["ctx0"] + (tok - info["q_start"])
        kpos = blk * bk + col
        mask = in_seq & (kpos < info["kv_len"]) & (kpos <= qpos)
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
        if chunk_size is not None:
            mask &= kpos // chunk_size == qpos // chunk_size
        row_in_seq = in_seq[:, :1]  # [rows, 1]
        # Keys of pages that were not fetched hold stale VMEM (NaN in the interpreter): zero V
        # there so 0 * NaN never reaches acc. K needs nothing: its logits are masked by select.
        vpos = blk * bk + lax.broadcasted_iota(jnp.int32, (bk, d), 0)
        v_ok = (vpos >= info["k_lo"]) & (vpos < info["k_hi"])
        q_all = q_ref[...]  # [hb, G, tq, D]
        m_all, l_all, acc_all = m_ref[...], l_ref[...], acc_ref[...]
        m_out, l_out, acc_out = [], [], []
        for hh in range(hb):
            q = q_all[hh].reshape(rows, d)  # value reshape: [G, tq, D] -> [G * tq, D]
            k = k_buf[slot, :, :, hh, :]  # [P, S, D]
            v = v_buf[slot, :, :, hh, :]
            if quantized:  # scales [P, S, 1]: a size-1 lane slice of the ref, no reshape
                k = (k.astype(jnp.float32) * ks_buf[slot, :, :, pl.ds(hh, 1)]).astype(q.dtype)
                v = (v.astype(jnp.float32) * vs_buf[slot, :, :, pl.ds(hh, 1)]).astype(q.dtype)
            k = k.reshape(bk, d)  # [P, S, D] -> [P * S, D]
            v = v.reshape(bk, d)
            v = jnp.where(v_ok, v, jnp.zeros_like(v))
            logits = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            logits = logits * sm_scale
            if soft_cap is not None:
                logits = soft_cap * jnp.tanh(logits / soft_cap)
            logits = jnp.where(mask, logits, MASK_VALUE)
            m_prev = m_all[hh][:, 0:1]  # [rows, 1]
            l_prev = l_all[hh][:, 0:1]
            m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            probs = jnp.exp(logits - m_new)
            l_new = alpha * l_prev + jnp.sum(probs, axis=1, keepdims=True)
            pv = lax.dot_general(
                probs.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )  # fmt: skip
            acc_prev = acc_all[hh]
            acc_out.append(jnp.where(row_in_seq, alpha * acc_prev + pv, acc_prev))
            m_out.append(jnp.broadcast_to(jnp.where(row_in_seq, m_new, m_prev), (rows, _LANES)))
            l_out.append(jnp.broadcast_to(jnp.where(row_in_seq, l_new, l_prev), (rows, _LANES)))
        # One store per scratch array (leading-axis stack), not one per head.
        acc_ref[...] = jnp.stack(acc_out)
        m_ref[...] = jnp.stack(m_out)
        l_ref[...] = jnp.stack(l_out)

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # Software-pipelined walk over the (sequence, KV block) pairs this token block needs.
    # Iteration j starts the DMAs of pair j (into slot j % 2), then waits for and computes
    # pair j - 1 (in the other slot): the copy of the next block overlaps this block's math.
    # Iteration 0 starts from a sentinel "pair -1" (sequence seq_lo - 1, no blocks), so each
    # of advance/start/wait/compute is traced once. `info` is per sequence, carried.
    def advance(s, blk, info):
        def same_seq():
            return s, blk + 1, info

        def next_seq():
            ns = next_nonempty(s + 1)
            ninfo = seq_info(ns)
            return ns, ninfo["blk_lo"], ninfo

        return lax.cond(blk + 1 < info["blk_hi"], same_seq, next_seq)

    def loop_body(carry):
        s, blk, info, slot, step = carry
        ns, nblk, ninfo = advance(s, blk, info)
        nslot = 1 - slot

        @pl.when(ns < seq_hi)
        def _prefetch_next() -> None:
            start_block(nblk, nslot, ninfo)

        @pl.when(step > 0)
        def _consume_current() -> None:
            wait_block(blk, slot, info)
            compute_block(blk, slot, info)

        return ns, nblk, ninfo, nslot, step + 1

    zero = jnp.int32(0)
    sentinel_info = dict(
        s=zero, q_start=zero, q_end=zero, kv_len=zero, ctx0=zero, k_lo=zero, k_hi=zero,
        blk_lo=zero, blk_hi=zero, nonempty=jnp.bool_(False),
    )  # fmt: skip
    lax.while_loop(
        lambda c: c[0] < seq_hi,
        loop_body,
        (seq_lo - 1, zero, sentinel_info, jnp.int32(1), zero),
    )

    acc_all, l_all = acc_ref[...], l_ref[...]
    outs = []
    for hh in range(hb):
        l_fin = l_all[hh][:, 0:1]
        out = jnp.where(l_fin > 0, acc_all[hh] / jnp.where(l_fin > 0, l_fin, 1.0), 0.0)
        outs.append(out.reshape(g, tq, d))
    o_ref[...] = jnp.stack(outs).astype(o_ref.dtype)


def _pallas_tpu_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_sizes: BlockSizes | None,
    chunk_size: int | None = None,
) -> jax.Array:
    quantized = k_scale is not None
    t, hq, d = q.shape
    n, s, hkv, _ = k_cache.shape
    b, m = block_tables.shape
    g = hq // hkv
    bs = block_sizes or get_block_sizes(d, s, q.dtype)
    _check_kernel_inputs(q, k_cache, bs)
    p_blk = min(bs.pages_per_block, m)
    tq = min(bs.queries_per_block, max(8, -(-t // 8) * 8))
    itemsize = jnp.dtype(q.dtype).itemsize
    vm = functools.partial(
        _vmem_bytes, kv_itemsize=jnp.dtype(k_cache.dtype).itemsize, quantized=quantized
    )
    if bs.kv_heads_per_block is not None:
        hb = bs.kv_heads_per_block
    else:  # as many heads as fit (all of them keeps page DMAs contiguous)
        hb = hkv
        while hb > 1 and vm(p_blk, s, hb, g, tq, d, itemsize) > _VMEM_BUDGET_BYTES:
            hb = max(h for h in range(1, hb) if hkv % h == 0)
    t_pad = -(-t // tq) * tq

    # [T, Hq, D] -> [Hkv, G, T_pad, D]: a head's query rows are a leading-axis slice.
    qt = q.reshape(t, hkv, g, d).transpose(1, 2, 0, 3)
    if t_pad != t:
        qt = jnp.pad(qt, ((0, 0), (0, 0), (0, t_pad - t), (0, 0)))
    qo_spec = pl.BlockSpec((hb, g, tq, d), lambda h, i, *_: (h, 0, i, 0))
    kernel = functools.partial(
        _rpa_kernel,
        quantized=quantized,
        sm_scale=float(sm_scale),
        sliding_window=None if sliding_window is None else int(sliding_window),
        soft_cap=None if soft_cap is None else float(soft_cap),
        pages_per_block=p_blk,
        chunk_size=None if chunk_size is None else int(chunk_size),
        max_pages_per_seq=m,
        num_pages=n,
        batch=b,
    )
    n_kv_in = 4 if quantized else 2
    scale_bufs = [compat.VMEM((2, p_blk, s, hb), jnp.float32)] * 2 if quantized else []
    grid_spec = compat.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(hkv // hb, t_pad // tq),
        in_specs=[qo_spec] + [compat.any_blockspec() for _ in range(n_kv_in)],
        out_specs=qo_spec,
        scratch_shapes=[
            compat.VMEM((2, p_blk, s, hb, d), k_cache.dtype),
            compat.VMEM((2, p_blk, s, hb, d), v_cache.dtype),
            *scale_bufs,
            compat.dma_semaphores((n_kv_in, 2)),
            compat.VMEM((hb, g * tq, _LANES), jnp.float32),
            compat.VMEM((hb, g * tq, _LANES), jnp.float32),
            compat.VMEM((hb, g * tq, d), jnp.float32),
        ],
    )
    vmem = vm(p_blk, s, hb, g, tq, d, itemsize)
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        compiler_params=compat.compiler_params(
            ("parallel", "parallel"),
            vmem_limit_bytes=None if vmem <= _VMEM_BUDGET_BYTES else int(vmem * 1.25),
        ),
        name="xlaserve_ragged_paged_attention",
    )(
        kv_lens,
        block_tables.reshape(-1),
        cu_q_lens,
        num_seqs,
        qt,
        k_cache,
        v_cache,
        *((k_scale, v_scale) if quantized else ()),
    )
    return out[:, :, :t, :].transpose(2, 0, 1, 3).reshape(t, hq, d)


# ------------------------------------------------------------------------------------------
# Public wrapper
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RpaImpl:
    """One ragged-paged-attention implementation: the XLA attention-backend contract. Chosen by
    name (KernelConfig.rpa_impl -> models_flax AttentionMetadata.impl -> `impl`; "auto" picks
    by platform in `_resolve_impl`); the step metadata reaches it as the arrays of
    `ragged_paged_attention`'s signature."""

    name: str
    # fn(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, k_scale, v_scale, *,
    #    sm_scale, sliding_window, soft_cap, block_sizes) -> [T, Hq, D]
    fn: Callable[..., jax.Array]
    # Reads an int8 / fp8 cache with its scales; a quantized call of an impl without runs the
    # reference instead.
    quantized_cache: bool
    # The tile-config type it takes as block_sizes (None: it takes none and ignores them).
    block_sizes_type: type | None
    # Takes `chunk_size` (chunked attention, Llama 4); a chunked call of an impl without runs
    # the reference instead.
    chunked: bool = False


def _jnp_impl(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """The RpaImpl contract over a plain-jnp attention `fn` (the reference's keywords; it takes
    no tiles, so `block_sizes` is dropped)."""

    def impl(
        q: jax.Array,
        k_cache: jax.Array,
        v_cache: jax.Array,
        kv_lens: jax.Array,
        block_tables: jax.Array,
        cu_q_lens: jax.Array,
        num_seqs: jax.Array,
        k_scale: jax.Array | None,
        v_scale: jax.Array | None,
        *,
        block_sizes: BlockSizes | GpuBlockSizes | None,
        **kw: Any,
    ) -> jax.Array:
        del block_sizes  # no tiles
        return fn(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
                  k_scale=k_scale, v_scale=v_scale, **kw)  # fmt: skip

    return impl


def _pallas_gpu_impl(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    k_scale: jax.Array | None,
    v_scale: jax.Array | None,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_sizes: BlockSizes | GpuBlockSizes | None,
    chunk_size: int | None = None,
) -> jax.Array:
    return ragged_paged_attention_gpu(
        q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        block_sizes=block_sizes, chunk_size=chunk_size, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


# name -> implementation; `register_rpa_impl` adds one.
RPA_IMPLS: dict[str, RpaImpl] = {
    "reference": RpaImpl(
        "reference", _jnp_impl(ref_ragged_paged_attention), True, None, chunked=True
    ),
    "chunked_xla": RpaImpl(
        "chunked_xla", _jnp_impl(chunked_ragged_paged_attention), True, None, chunked=True
    ),
    "pallas_tpu": RpaImpl("pallas_tpu", _pallas_tpu_attention, True, BlockSizes, chunked=True),
    "pallas_gpu": RpaImpl("pallas_gpu", _pallas_gpu_impl, True, GpuBlockSizes, chunked=True),
}


def register_rpa_impl(impl: RpaImpl) -> None:
    """Make `impl` selectable by its name (KernelConfig.rpa_impl)."""
    if impl.name == "auto":
        raise ValueError('"auto" is not an implementation name')
    RPA_IMPLS[impl.name] = impl


def _resolve_impl(impl: str, q: jax.Array, k_cache: jax.Array) -> str:
    if impl != "auto":
        return impl
    # JAX's own backend (not current_platform): a TPU host running JAX on CPU must not pick
    # Mosaic; under forced TPU interpret mode the kernel runs anywhere.
    if jax.default_backend() == "tpu" or compat.is_interpret_forced():
        return "pallas_tpu"
    if jax.default_backend() == "gpu":
        if GPU_AUTO_IMPL == "pallas_gpu" and not gpu_kernel_supports(
            q, k_cache, extended=GPU_AUTO_EXTENDED
        ):
            return "chunked_xla"  # e.g. a page size of 12: jnp takes all
        return GPU_AUTO_IMPL
    return "chunked_xla"


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "sliding_window", "soft_cap", "impl", "block_sizes", "chunk_size"
    ),
)  # fmt: skip
def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    impl: str = "auto",
    block_sizes: BlockSizes | GpuBlockSizes | None = None,
    chunk_size: int | None = None,
) -> jax.Array:
    """Ragged paged attention over a batch mixing prefill chunks and decodes.

    q: [T, Hq, D] (T padded); k_cache, v_cache: [N, S, Hkv, D] already holding this step's
    K/V (see `write_kv`); kv_lens: int32 [B] context length incl. the new tokens (entries past
    num_seqs ignored); block_tables: int32 [B, M]; cu_q_lens: int32 [B+1] query start offsets
    into T (non-decreasing; padded sequences have q_len 0); num_seqs: int32 [1].
    GQA: query head h uses kv head h // (Hq // Hkv). sliding_window w: keys in (p - w, p].
    chunk_size C (Llama 4 chunked attention): only keys with k // C == p // C (every
    built-in impl; a registered impl without `chunked` runs the reference for it).
    soft_cap c: logits = c * tanh(logits / c). Softmax and accumulation in float32.
    impl: "reference" | "chunked_xla" | "pallas_tpu" | "pallas_gpu" | "auto" (pallas_tpu on a TPU
    backend or under forced TPU interpret mode, GPU_AUTO_IMPL on a GPU backend where its kernel
    takes the shape, else chunked_xla).
    block_sizes: override the tuning table (kernels only; BlockSizes for pallas_tpu,
    GpuBlockSizes for pallas_gpu).
    Quantized cache (xlaserve.quantization.kv_quant): k_cache/v_cache int8 or float8_e4m3fn
    codes with k_scale, v_scale float32 [N, S, Hkv] (one scale per token and KV head); keys and
    values are dequantized (codes * scale) where they are read.
    Returns [T, Hq, D] in q's dtype; rows of padding tokens are zeros.
    """
    _check_inputs(
        q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
        sliding_window, soft_cap, impl, k_scale, v_scale, chunk_size,
    )  # fmt: skip
    chosen = RPA_IMPLS[_resolve_impl(impl, q, k_cache)]
    if k_scale is not None and not chosen.quantized_cache:
        chosen = RPA_IMPLS["reference"]
    if chunk_size is not None and not chosen.chunked:
        chosen = RPA_IMPLS["reference"]
    # Only a chunked call passes chunk_size (registered impls without it keep their signature).
    chunk = {} if chunk_size is None else {"chunk_size": chunk_size}
    want = chosen.block_sizes_type
    if block_sizes is not None and want is not None and not isinstance(block_sizes, want):
        raise ValueError(f"{chosen.name} takes {want.__name__}, got {type(block_sizes).__name__}")
    return chosen.fn(
        q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, k_scale, v_scale,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        block_sizes=block_sizes, **chunk,
    )  # fmt: skip
