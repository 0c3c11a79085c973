"""Tier 2: ragged paged attention, Pallas TPU kernel (TPU interpret mode) vs the jnp reference
vs a float64 numpy oracle, over page sizes, GQA ratios, head dims, dtypes, raggedness, sliding
window and soft cap. Unused cache slots hold NaN, so reading one fails the test.

Interpret-mode compiles dominate the cost (~5 s each on an idle 2-core box), so each test
compiles once for fixed padded shapes (T 32, B 6) and runs both ragged scenarios through
that one executable; configurations cover the product of the sweep axes instead of
enumerating it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _rpa_testlib import make_case, np_attention

from xlaserve.kernels_pallas import (
    BlockSizes,
    compat,
    ragged_paged_attention,
    ref_ragged_paged_attention,
    write_kv,
)

NUM_TOKENS = 32
BATCH = 6
MAX_KV = 40
# (q_lens, kv_lens): queries are the last q_len positions of each kv_len context.
SCENARIOS: dict[str, tuple[list[int], list[int]]] = {
    # decode at kv_len 23; a chunked prefill of 9 over a cached prefix of 11; a decode at
    # kv_len 1; a fresh 13-token prompt (spans query blocks, ends mid-page); a decode at the
    # longest context. 7 padding tokens, 1 padding sequence.
    "mixed": ([1, 9, 1, 13, 1], [23, 20, 1, 13, MAX_KV]),
    # kv_len 1, exactly one page (S=8), partial pages, the longest context; 27 padding
    # tokens (whole query blocks of padding) and 1 padding sequence.
    "decode_only": ([1, 1, 1, 1, 1], [1, 8, 17, MAX_KV, 3]),
}
TOLERANCE = {  # (atol, rtol) per dtype
    # float32 off the CPU: XLA's dots (the jnp reference) and the kernel's tl.dot take TF32
    # inputs by default on a GPU (10-bit mantissa), so float32 results match the float64
    # oracle to ~1e-3, not 1e-5 (H200, 2026-12-05: largest differences 2.3e-4 .. 2.0e-3).
    jnp.float32: (2e-5, 2e-5) if jax.default_backend() == "cpu" else (5e-3, 5e-3),
    jnp.bfloat16: (3e-2, 3e-2),
}
SMALL_BLOCKS = BlockSizes(pages_per_block=2, queries_per_block=8)


_jit_ref = jax.jit(
    ref_ragged_paged_attention, static_argnames=("sm_scale", "sliding_window", "soft_cap")
)


def _check_all_scenarios(
    *,
    page_size: int,
    hq: int,
    hkv: int,
    d: int,
    dtype: jnp.dtype,
    block_sizes: BlockSizes | Any | None = SMALL_BLOCKS,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    seed: int = 0,
    impl: str = "pallas_tpu",
    scenarios: dict[str, tuple[list[int], list[int]]] | None = None,
) -> None:
    """Every scenario (default SCENARIOS) through `impl` against the numpy oracle and the jnp
    reference (which is also checked against the oracle); padding rows must be zeros. Also
    serves the Pallas GPU kernel's sweep (impl "pallas_gpu", its own scenarios and tiles)."""
    rng = np.random.default_rng(seed)
    sm_scale = d**-0.5
    max_pages = -(-MAX_KV // page_size) + 1  # one spare (garbage) block-table column
    num_pages = 5 * (max_pages - 1) + 3
    atol, rtol = TOLERANCE[dtype]
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    for name, (q_lens, kv_lens) in (scenarios or SCENARIOS).items():
        case = make_case(
            rng, q_lens, kv_lens, page_size=page_size, hq=hq, hkv=hkv, d=d, dtype=dtype,
            batch=BATCH, num_tokens=NUM_TOKENS, max_pages=max_pages, num_pages=num_pages,
        )  # fmt: skip
        want = np_attention(case, **kw)
        ref = np.asarray(_jit_ref(*case.args(), **kw).astype(jnp.float32))
        out = ragged_paged_attention(*case.args(), impl=impl, block_sizes=block_sizes, **kw)
        assert out.shape == case.q.shape and out.dtype == case.q.dtype
        out = np.asarray(out.astype(jnp.float32))
        n_real = sum(q_lens)
        assert np.isfinite(out).all(), name
        np.testing.assert_allclose(ref, want, atol=atol, rtol=rtol, err_msg=f"ref {name}")
        np.testing.assert_allclose(out, want, atol=atol, rtol=rtol, err_msg=f"kernel {name}")
        np.testing.assert_array_equal(out[n_real:], 0.0, err_msg=f"padding rows {name}")


# page size x GQA ratio x head_dim x dtype x block sizes, covered in 5 compiles.
CONFIGS = [
    # (page_size, hq, hkv, d, dtype, block_sizes)
    (8, 2, 2, 64, jnp.float32, SMALL_BLOCKS),
    (16, 4, 2, 128, jnp.float32, None),  # the tuning table: one KV and one query block
    (8, 4, 1, 128, jnp.bfloat16, SMALL_BLOCKS),
    (16, 2, 2, 64, jnp.bfloat16, SMALL_BLOCKS),
    # 3 pages per block (does not divide M = 6), 16 queries per block, one KV head per grid
    # step (the strided-head DMA path); run with eager DMAs (below).
    (8, 8, 2, 64, jnp.bfloat16, BlockSizes(3, 16, kv_heads_per_block=1)),
]


@pytest.mark.parametrize(
    "page_size,hq,hkv,d,dtype,block_sizes",
    CONFIGS,
    ids=[
        f"S{c[0]}-hq{c[1]}-hkv{c[2]}-d{c[3]}-{jnp.dtype(c[4]).name}-"
        + ("table" if c[5] is None else f"p{c[5].pages_per_block}q{c[5].queries_per_block}")
        for c in CONFIGS
    ],
)
def test_kernel_matches_reference(page_size, hq, hkv, d, dtype, block_sizes) -> None:  # noqa: ANN001
    # The head-grid config runs with DMAs that land when started rather than at wait: that
    # catches a prefetch overwriting a buffer slot that is still being read.
    dma_mode = "eager" if block_sizes is not None and block_sizes.kv_heads_per_block else "on_wait"
    try:
        with compat.tpu_interpret_mode(dma_execution_mode=dma_mode):
            _check_all_scenarios(
                page_size=page_size, hq=hq, hkv=hkv, d=d, dtype=dtype, block_sizes=block_sizes
            )
    finally:
        compat.reset_interpret_state()


@pytest.mark.parametrize(
    "page_size,dtype,sliding_window,soft_cap",
    [
        (8, jnp.float32, 5, None),  # window shorter than a page
        (16, jnp.bfloat16, 19, 30.0),  # window spanning pages (early blocks skipped) + cap
    ],
)
def test_kernel_window_and_soft_cap(
    tpu_interpret, page_size, dtype, sliding_window, soft_cap
) -> None:  # noqa: ANN001
    _check_all_scenarios(
        page_size=page_size, hq=4, hkv=2, d=64, dtype=dtype,
        sliding_window=sliding_window, soft_cap=soft_cap, seed=1,
    )  # fmt: skip


@pytest.mark.parametrize(
    "page_size,hq,hkv,dtype,sliding_window,soft_cap",
    [
        (8, 2, 2, jnp.float32, None, None),
        (16, 4, 2, jnp.float32, 7, None),
        (8, 4, 1, jnp.float32, None, 5.0),
        (16, 2, 2, jnp.float32, 3, 2.0),
        (8, 4, 2, jnp.bfloat16, None, None),
        (16, 4, 1, jnp.bfloat16, 7, 5.0),
    ],
)
def test_reference_matches_numpy(page_size, hq, hkv, dtype, sliding_window, soft_cap) -> None:  # noqa: ANN001
    """The jnp reference alone, jitted (one compile per case), against the float64 oracle."""
    rng = np.random.default_rng(4)
    atol, rtol = TOLERANCE[dtype]
    kw = dict(sm_scale=0.25, sliding_window=sliding_window, soft_cap=soft_cap)
    ref = jax.jit(ref_ragged_paged_attention, static_argnames=tuple(kw))
    max_pages = -(-MAX_KV // page_size) + 1
    for name, (q_lens, kv_lens) in SCENARIOS.items():
        case = make_case(
            rng, q_lens, kv_lens, page_size=page_size, hq=hq, hkv=hkv, d=16, dtype=dtype,
            batch=BATCH, num_tokens=NUM_TOKENS, max_pages=max_pages,
            num_pages=5 * (max_pages - 1) + 3,
        )  # fmt: skip
        got = ref(*case.args(), **kw)
        np.testing.assert_allclose(
            np.asarray(got.astype(jnp.float32)), np_attention(case, **kw),
            atol=atol, rtol=rtol, err_msg=name,
        )  # fmt: skip


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="what impl='auto' picks on a CPU backend (GPU / TPU pick the kernel)",
)
def test_auto_runs_no_kernel_on_cpu_and_the_kernel_when_asked() -> None:
    """Checked on the traced program (no compile): "auto" on a CPU backend has no pallas_call;
    "pallas_tpu" has exactly one; both agree on the output shape and dtype."""
    case = make_case(np.random.default_rng(5), [1, 4], [9, 4], page_size=8, hq=2, hkv=1, d=16)

    def jaxpr(impl: str) -> str:
        return str(
            jax.make_jaxpr(lambda *a: ragged_paged_attention(*a, sm_scale=0.25, impl=impl))(
                *case.args()
            )
        )

    assert "pallas_call" not in jaxpr("auto")
    assert jaxpr("pallas_tpu").count("pallas_call[") == 1
    for impl in ("auto", "pallas_tpu"):
        out = jax.eval_shape(
            lambda *a, impl=impl: ragged_paged_attention(*a, sm_scale=0.25, impl=impl), *case.args()
        )
        assert out.shape == case.q.shape and out.dtype == case.q.dtype


def test_write_kv_then_attend() -> None:
    """Decode step end to end: write the new tokens' K/V (with padding slots), then attend."""
    rng = np.random.default_rng(6)
    case = make_case(
        rng, [1, 3], [6, 11], page_size=8, hq=4, hkv=2, d=64, num_tokens=6,
        unused_fill=0.0,
    )  # fmt: skip
    bt = np.asarray(case.block_tables)
    # Blank the new tokens' rows in the cache, then write them back with write_kv.
    slots, k_new, v_new = [], [], []
    k_cache, v_cache = np.array(case.k_cache), np.array(case.v_cache)  # writable copies
    for i, (ql, kl) in enumerate(zip(case.q_lens, case.kv_lens_list, strict=True)):
        for pos in range(kl - ql, kl):
            page, off = bt[i, pos // 8], pos % 8
            slots.append(page * 8 + off)
            k_new.append(k_cache[page, off].copy())
            v_new.append(v_cache[page, off].copy())
            k_cache[page, off] = 0
            v_cache[page, off] = 0
    slots += [-1, -1]  # two padding tokens
    k_new += [np.full_like(k_new[0], 7.0)] * 2
    v_new += [np.full_like(v_new[0], 7.0)] * 2
    k2, v2 = write_kv(
        jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(np.stack(k_new)),
        jnp.asarray(np.stack(v_new)), jnp.asarray(slots, jnp.int32),
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(case.k_cache))
    np.testing.assert_array_equal(np.asarray(v2), np.asarray(case.v_cache))
    args = (case.q, k2, v2, *case.args()[3:])
    # The reference here: the kernel is swept above, and every interpret compile costs seconds.
    out = ragged_paged_attention(*args, sm_scale=0.125, impl="reference")
    atol, rtol = TOLERANCE[jnp.float32]  # TF32 dots off the CPU (H200, 2026-12-05)
    np.testing.assert_allclose(np.asarray(out), np_attention(case, 0.125), atol=atol, rtol=rtol)
