"""Chunked attention (Llama 4: a query at position p sees keys k <= p with k // C == p // C) in
ragged paged attention: a case worked by hand on the jnp reference and the Pallas TPU kernel
(TPU interpret mode), then the TPU kernel, the Pallas GPU kernel (Pallas interpreter) and the
reference vs a float64 numpy oracle over ragged batches whose prompts and prefill chunks cross
chunk boundaries. Unused cache slots hold NaN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _rpa_testlib import make_case, np_attention

from xlaserve.kernels_pallas import BlockSizes, ragged_paged_attention, ref_ragged_paged_attention
from xlaserve.kernels_pallas.ragged_paged_attention_gpu import GpuBlockSizes

D, S = 8, 8


def _uniform_case() -> tuple[np.ndarray, ...]:
    """kv_len 10 over pages [4, 1]; v at position j is j * e0; k = 0 (uniform weights)."""
    k = np.zeros((6, S, 1, D), np.float32)
    v = np.zeros((6, S, 1, D), np.float32)
    for j in range(10):
        v[[4, 1][j // S], j % S, 0, 0] = float(j)
    return k, v


@pytest.mark.parametrize("impl", ["reference", "pallas_tpu"])
def test_chunk_of_four_by_hand(impl: str, tpu_interpret) -> None:  # noqa: ANN001
    # Queries at positions 6..9 (the last 4 of 10), chunk 4: 6 sees 4..6 (mean 5), 7 sees 4..7
    # (5.5), 8 starts a chunk and sees only itself (8), 9 sees 8..9 (8.5).
    k, v = _uniform_case()
    q = np.zeros((8, 2, D), np.float32)  # 4 real tokens + 4 padding, 2 query heads
    out = ragged_paged_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
        jnp.asarray([10, 0], jnp.int32), jnp.asarray([[4, 1], [0, 0]], jnp.int32),
        jnp.asarray([0, 4, 4], jnp.int32), jnp.asarray([1], jnp.int32),
        sm_scale=1.0, chunk_size=4, impl=impl,
        block_sizes=BlockSizes(pages_per_block=1, queries_per_block=8) if impl != "reference" else None,
    )  # fmt: skip
    out = np.asarray(out)
    np.testing.assert_allclose(out[:4, :, 0], np.repeat([[5.0], [5.5], [8.0], [8.5]], 2, 1))
    np.testing.assert_array_equal(out[4:], 0.0)


# (q_lens, kv_lens): a decode right after a chunk boundary, a 9-token prefill chunk over an
# 11-token prefix (crosses a boundary), a fresh 13-token prompt, a decode at the longest context.
SCENARIO = ([1, 9, 13, 1, 1], [17, 20, 13, 40, 1])


def _check_scenario(impl: str, page_size: int, chunk: int, dtype, block_sizes, seed: int) -> None:  # noqa: ANN001
    """SCENARIO through `impl` vs the float64 oracle (and, for pallas_tpu, the jnp reference
    too); padding rows must be zeros; full causal attention must differ (the mask matters)."""
    max_pages = -(-40 // page_size) + 1
    q_lens, kv_lens = SCENARIO
    case = make_case(
        np.random.default_rng(seed), q_lens, kv_lens, page_size=page_size, hq=4, hkv=2, d=64,
        dtype=dtype, batch=6, num_tokens=32, max_pages=max_pages,
        num_pages=5 * (max_pages - 1) + 3,
    )  # fmt: skip
    kw = dict(sm_scale=0.125, chunk_size=chunk)
    want = np_attention(case, **kw)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    if impl == "pallas_tpu":
        ref = jax.jit(ref_ragged_paged_attention, static_argnames=("sm_scale", "chunk_size"))
        ref_out = np.asarray(ref(*case.args(), **kw).astype(jnp.float32))
        np.testing.assert_allclose(ref_out, want, atol=tol, rtol=tol)
    out = ragged_paged_attention(*case.args(), impl=impl, block_sizes=block_sizes, **kw)
    out = np.asarray(out.astype(jnp.float32))
    np.testing.assert_allclose(out, want, atol=tol, rtol=tol)
    np.testing.assert_array_equal(out[sum(q_lens) :], 0.0)
    assert not np.allclose(np_attention(case, sm_scale=0.125), want, atol=1e-3)


@pytest.mark.parametrize(
    "page_size,chunk,dtype,block_sizes",
    [
        (8, 4, jnp.float32, BlockSizes(pages_per_block=2, queries_per_block=8)),  # chunk < page
        (8, 16, jnp.float32, BlockSizes(1, 8)),  # early pages skipped
        (16, 5, jnp.bfloat16, None),  # chunks not aligned to pages; the tuning table
    ],
)
def test_tpu_kernel_matches_reference_and_numpy(
    tpu_interpret, page_size, chunk, dtype, block_sizes
) -> None:  # noqa: ANN001
    _check_scenario("pallas_tpu", page_size, chunk, dtype, block_sizes, seed=chunk)


@pytest.mark.parametrize(
    "page_size,chunk,dtype,block_sizes",
    [
        (8, 4, jnp.float32, GpuBlockSizes(16, 2)),  # chunk < page; BQ 8 tiles cross chunks
        (16, 16, jnp.float32, GpuBlockSizes(16, 1)),  # unmasked interior steps inside a chunk
        (8, 5, jnp.bfloat16, None),  # unaligned chunks, the tuning table
        (16, 8, jnp.float32, GpuBlockSizes(16, 1, kv_splits=4, force_splits=True)),  # split KV
        # BK 16, chunk 24: the decode at position 39 (chunk from 24) starts in key block 1
        # (keys 16..31), which must stay masked; block 0 of the decode at 16 runs unmasked.
        (8, 24, jnp.float32, GpuBlockSizes(16, 2)),
    ],
)
def test_gpu_kernel_matches_numpy(page_size, chunk, dtype, block_sizes) -> None:  # noqa: ANN001
    """The Pallas GPU kernel (Pallas interpreter on CPU) on the same ragged scenario."""
    _check_scenario("pallas_gpu", page_size, chunk, dtype, block_sizes, seed=chunk + page_size)


def test_bad_chunk_size_is_a_clear_error() -> None:
    rng = np.random.default_rng(0)
    case = make_case(
        rng, [1], [3], page_size=8, hq=2, hkv=1, d=16, dtype=jnp.float32,
        batch=1, num_tokens=1, max_pages=1, num_pages=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match="chunk_size"):
        ragged_paged_attention(*case.args(), sm_scale=1.0, chunk_size=0, impl="reference")
