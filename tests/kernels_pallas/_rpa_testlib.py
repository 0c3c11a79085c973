"""Builders and a float64 numpy oracle for the ragged paged attention tests.

A case starts from contiguous per-sequence K/V ([kv_len, Hkv, D]), scatters them into randomly
chosen, non-contiguous pages, and fills every slot no sequence owns with NaN, so an
implementation that reads past kv_len or through an unused block-table entry shows up as NaN.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Case:
    q: jnp.ndarray  # [T, Hq, D]
    k_cache: jnp.ndarray  # [N, S, Hkv, D]
    v_cache: jnp.ndarray
    kv_lens: jnp.ndarray  # int32 [B]
    block_tables: jnp.ndarray  # int32 [B, M]
    cu_q_lens: jnp.ndarray  # int32 [B+1]
    num_seqs: jnp.ndarray  # int32 [1]
    q_lens: list[int]
    kv_lens_list: list[int]
    k_seqs: list[np.ndarray]  # float64 [kv_len, Hkv, D] per sequence (dtype-rounded)
    v_seqs: list[np.ndarray]

    def args(self) -> tuple[jnp.ndarray, ...]:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.kv_lens,
            self.block_tables,
            self.cu_q_lens,
            self.num_seqs,
        )


def _round(x: np.ndarray, dtype: jnp.dtype) -> np.ndarray:
    """Values as the given dtype holds them, back in float64 (so the oracle sees bf16 inputs)."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)


def make_case(
    rng: np.random.Generator,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    page_size: int,
    hq: int,
    hkv: int,
    d: int,
    dtype: jnp.dtype = jnp.float32,
    batch: int | None = None,
    num_tokens: int | None = None,
    max_pages: int | None = None,
    num_pages: int | None = None,
    unused_fill: float = np.nan,
) -> Case:
    """Random case; batch/num_tokens/max_pages/num_pages fix the padded shapes (defaults: one
    padded sequence, no padded token, one spare block-table column, three spare pages), so
    cases with different raggedness can share one compiled kernel."""
    assert len(q_lens) == len(kv_lens) and all(
        0 < ql <= kl for ql, kl in zip(q_lens, kv_lens, strict=True)
    )
    s = page_size
    n_seq = len(q_lens)
    b = n_seq + 1 if batch is None else batch
    pages_per_seq = [-(-kl // s) for kl in kv_lens]
    m = max(pages_per_seq) + 1 if max_pages is None else max_pages
    n = sum(pages_per_seq) + 3 if num_pages is None else num_pages
    assert b >= n_seq and m >= max(pages_per_seq) and n >= sum(pages_per_seq)
    perm = rng.permutation(n)
    k_cache = np.full((n, s, hkv, d), unused_fill, np.float64)
    v_cache = np.full((n, s, hkv, d), unused_fill, np.float64)
    # Unused table entries point at random pages (some owned by other sequences).
    block_tables = rng.integers(0, n, size=(b, m)).astype(np.int32)
    k_seqs, v_seqs = [], []
    used = 0
    for i, kl in enumerate(kv_lens):
        k_seq = _round(rng.normal(size=(kl, hkv, d)), dtype)
        v_seq = _round(rng.normal(size=(kl, hkv, d)), dtype)
        k_seqs.append(k_seq)
        v_seqs.append(v_seq)
        for j in range(pages_per_seq[i]):
            page = int(perm[used])
            used += 1
            block_tables[i, j] = page
            rows = slice(j * s, min((j + 1) * s, kl))
            k_cache[page, : rows.stop - rows.start] = k_seq[rows]
            v_cache[page, : rows.stop - rows.start] = v_seq[rows]
    cu = np.zeros(b + 1, np.int32)
    cu[1 : n_seq + 1] = np.cumsum(q_lens)
    cu[n_seq + 1 :] = cu[n_seq]
    kvl = np.zeros(b, np.int32)
    kvl[:n_seq] = kv_lens
    t = int(cu[n_seq]) if num_tokens is None else num_tokens
    assert t >= cu[n_seq]
    q = _round(rng.normal(size=(t, hq, d)), dtype)
    return Case(
        q=jnp.asarray(q, dtype),
        k_cache=jnp.asarray(k_cache, dtype),
        v_cache=jnp.asarray(v_cache, dtype),
        kv_lens=jnp.asarray(kvl),
        block_tables=jnp.asarray(block_tables),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([n_seq], jnp.int32),
        q_lens=list(q_lens),
        kv_lens_list=list(kv_lens),
        k_seqs=k_seqs,
        v_seqs=v_seqs,
    )


def np_attention(
    case: Case,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    chunk_size: int | None = None,
) -> np.ndarray:
    """Float64 loop-per-sequence attention on the contiguous K/V. Padding rows are zero.
    chunk_size C: a query at p sees keys k <= p with k // C == p // C (Llama 4)."""
    q = np.asarray(case.q.astype(jnp.float32), np.float64)
    t, hq, d = q.shape
    hkv = case.k_seqs[0].shape[1]
    g = hq // hkv
    out = np.zeros((t, hq, d))
    start = 0
    for ql, kl, k, v in zip(case.q_lens, case.kv_lens_list, case.k_seqs, case.v_seqs, strict=True):
        pos = kl - ql + np.arange(ql)
        kpos = np.arange(kl)
        mask = kpos[None, :] <= pos[:, None]
        if sliding_window is not None:
            mask &= kpos[None, :] > pos[:, None] - sliding_window
        if chunk_size is not None:
            mask &= kpos[None, :] // chunk_size == pos[:, None] // chunk_size
        for h in range(hq):
            logits = q[start : start + ql, h] @ k[:, h // g].T * sm_scale
            if soft_cap is not None:
                logits = soft_cap * np.tanh(logits / soft_cap)
            logits = np.where(mask, logits, -np.inf)
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[start : start + ql, h] = p @ v[:, h // g]
        start += ql
    return out
