"""`chunked_ragged_paged_attention` (impl "chunked_xla", the CPU path and GPU fallback): the
float64 numpy oracle over ragged batches at several chunk sizes (one page, several pages, chunks
that do not divide the block table, one chunk for everything = the reference path), with sliding
window, soft cap, Llama 4 chunked attention, bf16, and a quantized cache. Unused cache slots hold
NaN, so a chunk that reads past kv_len (or a padded block-table column) fails the test."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _rpa_testlib import make_case, np_attention

from xlaserve.kernels_pallas import ragged_paged_attention
from xlaserve.kernels_pallas.ragged_paged_attention import chunked_ragged_paged_attention
from xlaserve.quantization.kv_quant import dequantize_kv_ref, quantize_kv_ref

NUM_TOKENS, BATCH, MAX_KV = 32, 6, 40
SCENARIOS = {
    # decodes at 23, 1 and the longest context; a 9-token chunk over an 11-token prefix; a fresh
    # 13-token prompt; 7 padding tokens and a padding sequence.
    "mixed": ([1, 9, 1, 13, 1], [23, 20, 1, 13, MAX_KV]),
    "decode_only": ([1, 1, 1, 1, 1], [1, 8, 17, MAX_KV, 3]),
}


def _check(page_size: int, keys: int, dtype: jnp.dtype, seed: int, **kw: object) -> None:
    rng = np.random.default_rng(seed)
    max_pages = -(-MAX_KV // page_size) + 1  # one spare column (random pages: masked)
    fn = jax.jit(functools.partial(chunked_ragged_paged_attention, keys_per_step=keys, **kw))
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    for name, (q_lens, kv_lens) in SCENARIOS.items():
        case = make_case(
            rng, q_lens, kv_lens, page_size=page_size, hq=4, hkv=2, d=16, dtype=dtype,
            batch=BATCH, num_tokens=NUM_TOKENS, max_pages=max_pages,
            num_pages=5 * (max_pages - 1) + 3,
        )  # fmt: skip
        out = np.asarray(fn(*case.args()).astype(jnp.float32))
        np.testing.assert_allclose(out, np_attention(case, **kw), atol=tol, rtol=tol, err_msg=name)
        np.testing.assert_array_equal(out[sum(q_lens) :], 0.0)


@pytest.mark.parametrize(
    "page_size,keys,dtype,kw",
    [
        (8, 8, jnp.float32, {}),  # one page a step, 6 steps at the longest context
        (
            8,
            16,
            jnp.float32,
            dict(sliding_window=5),
        ),  # window shorter than a page: early chunks skipped
        (8, 24, jnp.bfloat16, dict(soft_cap=5.0)),  # 3 pages a step: does not divide M = 6
        (16, 16, jnp.float32, dict(sliding_window=19, soft_cap=2.0)),
        (8, 16, jnp.float32, dict(chunk_size=12)),  # Llama 4 chunks across loop chunks
        (16, 32, jnp.bfloat16, dict(sliding_window=7, chunk_size=16)),
        (8, 1024, jnp.float32, dict(sliding_window=9)),  # one chunk for all: the reference path
    ],
)
def test_matches_numpy(page_size: int, keys: int, dtype: jnp.dtype, kw: dict) -> None:
    _check(page_size, keys, dtype, seed=page_size + keys, sm_scale=0.25, **kw)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_cache(kv: str) -> None:
    """Codes + scales read through the loop equal the oracle on the dequantized cache (NaN scales
    on unowned slots)."""
    rng = np.random.default_rng(3)
    page_size, max_pages = 8, -(-MAX_KV // 8) + 1
    q_lens, kv_lens = SCENARIOS["mixed"]
    case = make_case(
        rng, q_lens, kv_lens, page_size=page_size, hq=4, hkv=2, d=16, batch=BATCH,
        num_tokens=NUM_TOKENS, max_pages=max_pages, num_pages=5 * (max_pages - 1) + 3,
        unused_fill=0.0,
    )  # fmt: skip
    kq, ks = quantize_kv_ref(np.asarray(case.k_cache), kv)
    vq, vs = quantize_kv_ref(np.asarray(case.v_cache), kv)
    tables, owned = np.asarray(case.block_tables), np.zeros(ks.shape[:2], bool)
    k_seqs, v_seqs = [], []
    for i, kl in enumerate(kv_lens):
        rows = np.arange(kl)
        slot = (tables[i, rows // page_size], rows % page_size)
        owned[slot] = True
        k_seqs.append(dequantize_kv_ref(kq[slot], ks[slot]).astype(np.float64))
        v_seqs.append(dequantize_kv_ref(vq[slot], vs[slot]).astype(np.float64))
    ks[~owned], vs[~owned] = np.nan, np.nan
    meta = (case.kv_lens, case.block_tables, case.cu_q_lens, case.num_seqs)
    out = chunked_ragged_paged_attention(
        case.q, jnp.asarray(kq), jnp.asarray(vq), *meta, sm_scale=0.25,
        k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs), keys_per_step=16,
    )  # fmt: skip
    want = np_attention(dataclasses.replace(case, k_seqs=k_seqs, v_seqs=v_seqs), sm_scale=0.25)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)


def test_auto_runs_it_on_the_cpu() -> None:
    """impl "auto" on a CPU backend traces the chunked loop (a while with a data-dependent trip
    count), not the all-pages reference."""
    assert jax.default_backend() == "cpu"
    case = make_case(np.random.default_rng(5), [1, 4], [90, 4], page_size=8, hq=2, hkv=1, d=16)

    def jaxpr(impl: str) -> str:
        return str(jax.make_jaxpr(lambda *a: ragged_paged_attention(*a, sm_scale=0.25, impl=impl))(
            *case.args()))  # fmt: skip

    assert "while[" in jaxpr("auto") and "while[" in jaxpr("chunked_xla")
    assert "while[" not in jaxpr("reference")
