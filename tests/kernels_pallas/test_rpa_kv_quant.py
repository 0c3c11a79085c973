"""Quantized KV cache (int8 / fp8 codes + float32 scale per token and KV head) in the ragged
paged attention: the jnp quantizer against the numpy contract, `write_kv_quant`, and the Pallas
TPU kernel (interpret mode) against the jnp reference and a float64 oracle on the dequantized
cache. Unowned slots get NaN scales, so reading one shows up as NaN."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _rpa_testlib import make_case, np_attention

from xlaserve.kernels_pallas import BlockSizes, compat, ragged_paged_attention
from xlaserve.kernels_pallas.kv_cache_quant import code_dtype, dequantize_kv, quantize_kv
from xlaserve.kernels_pallas.ragged_paged_attention import write_kv_quant
from xlaserve.quantization.kv_quant import dequantize_kv_ref, quantize_kv_ref

KV_DTYPES = ["int8", "fp8"]


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_quantize_matches_numpy_contract(kv: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3, 32)).astype(np.float32) * rng.uniform(0.01, 50, (64, 3, 1))
    x[0, 0] = 0.0  # all-zero vector: scale 1, codes 0
    x[1, 0, :4] = [127.0, 0.5, -0.5, 1.5]  # scale 1: exact ties round half to even
    x = x.astype(np.float32)
    q, s = jax.device_get(quantize_kv(jnp.asarray(x), kv))
    q_ref, s_ref = quantize_kv_ref(x, kv)
    assert q.dtype == q_ref.dtype == code_dtype(kv) and s.dtype == np.float32
    np.testing.assert_array_equal(s, s_ref)
    np.testing.assert_array_equal(q.view(np.uint8), q_ref.view(np.uint8))  # bit-identical codes
    # Also inside a jit (XLA's simplifier must not turn the divisions into reciprocals).
    qj, sj = jax.device_get(jax.jit(quantize_kv, static_argnums=1)(jnp.asarray(x) * 1.0, kv))
    np.testing.assert_array_equal(sj, s_ref)
    np.testing.assert_array_equal(qj.view(np.uint8), q_ref.view(np.uint8))
    assert s[0, 0] == 1.0 and not q[0, 0].astype(np.float32).any()
    deq = np.asarray(dequantize_kv(jnp.asarray(q), jnp.asarray(s)))
    np.testing.assert_array_equal(deq, dequantize_kv_ref(q_ref, s_ref))
    # Error bound of the format: int8 half a step, fp8 e4m3 a relative 2^-4 of the element.
    err = np.abs(deq - x)
    amax = np.abs(x).max(-1, keepdims=True)
    bound = amax / 254 if kv == "int8" else np.maximum(np.abs(x) / 16, amax / 448 * 2.0**-9)
    assert (err <= bound * (1 + 1e-5) + 1e-30).all()


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_write_kv_quant_scatters_codes_and_scales(kv: str) -> None:
    n, s, hkv, d = 4, 8, 2, 16
    rng = np.random.default_rng(1)
    k_new = rng.normal(size=(5, hkv, d)).astype(np.float32)
    v_new = rng.normal(size=(5, hkv, d)).astype(np.float32) * 3
    slots = np.array([9, -1, 0, 31, 17], np.int32)  # -1: padding, writes nothing
    dt = code_dtype(kv)
    caches = (jnp.zeros((n, s, hkv, d), dt), jnp.zeros((n, s, hkv, d), dt),
              jnp.full((n, s, hkv), 7.0, jnp.float32), jnp.full((n, s, hkv), 7.0, jnp.float32))  # fmt: skip
    kq, vq, ks, vs = jax.device_get(write_kv_quant(*caches, k_new, v_new, jnp.asarray(slots)))
    want_ks = np.full((n, s, hkv), 7.0, np.float32)
    for x, codes, scales in ((k_new, kq, ks), (v_new, vq, vs)):
        q_ref, s_ref = quantize_kv_ref(x, kv)
        want_q = np.zeros((n, s, hkv, d), q_ref.dtype)
        want_s = want_ks.copy()
        for i, slot in enumerate(slots):
            if slot >= 0:
                want_q[slot // s, slot % s], want_s[slot // s, slot % s] = q_ref[i], s_ref[i]
        np.testing.assert_array_equal(codes.view(np.uint8), want_q.view(np.uint8))
        np.testing.assert_array_equal(scales, want_s)


def _quantized_case(case, kv: str, page_size: int):  # noqa: ANN001, ANN202
    """(k codes, v codes, k scales, v scales) of the case's cache, NaN scales on unowned slots,
    and a copy of the case whose oracle K/V are the dequantized values."""
    k = np.asarray(case.k_cache, np.float32)
    v = np.asarray(case.v_cache, np.float32)
    kq, ks = quantize_kv_ref(k, kv)
    vq, vs = quantize_kv_ref(v, kv)
    owned = np.zeros(ks.shape[:2], bool)  # [N, S]
    tables = np.asarray(case.block_tables)
    k_seqs, v_seqs = [], []
    for i, kl in enumerate(case.kv_lens_list):
        pages = tables[i, : -(-kl // page_size)]
        rows = np.arange(kl)
        owned[pages[rows // page_size], rows % page_size] = True
        slot = (pages[rows // page_size], rows % page_size)
        k_seqs.append(dequantize_kv_ref(kq[slot], ks[slot]).astype(np.float64))
        v_seqs.append(dequantize_kv_ref(vq[slot], vs[slot]).astype(np.float64))
    ks[~owned], vs[~owned] = np.nan, np.nan
    deq_case = dataclasses.replace(case, k_seqs=k_seqs, v_seqs=v_seqs)
    arrays = tuple(jnp.asarray(a) for a in (kq, vq, ks, vs))
    return arrays, deq_case


# Padded shapes shared by all scenarios of a config, so the kernel compiles once per config.
BATCH, NUM_TOKENS, MAX_KV = 5, 32, 40
SCENARIOS = {
    "decode": ([1, 1, 1], [9, 33, 1]),
    "mixed": ([1, 6, 1, 12], [17, 6, 40, 20]),  # decodes + a fresh prefill + a chunk over a prefix
}
# (kv dtype, page size, hq, hkv, q dtype, block sizes, sliding window)
CONFIGS = [
    ("int8", 8, 4, 2, jnp.float32, BlockSizes(2, 8), None),
    ("fp8", 16, 4, 2, jnp.float32, None, None),
    ("int8", 16, 8, 2, jnp.bfloat16, BlockSizes(1, 16, kv_heads_per_block=1), 11),
    ("fp8", 8, 2, 1, jnp.bfloat16, BlockSizes(3, 8), None),
]


@pytest.mark.parametrize(
    "kv,page_size,hq,hkv,dtype,block_sizes,window",
    CONFIGS,
    ids=[f"{c[0]}-S{c[1]}-hq{c[2]}-hkv{c[3]}-{jnp.dtype(c[4]).name}" for c in CONFIGS],
)
def test_kernel_reads_quantized_cache(kv, page_size, hq, hkv, dtype, block_sizes, window) -> None:  # noqa: ANN001
    d = 32
    rng = np.random.default_rng(2)
    max_pages = -(-MAX_KV // page_size) + 1
    kw = dict(sm_scale=d**-0.5, sliding_window=window)
    # Strided-head configs run with eager DMAs (a prefetch overwriting a slot in use shows up).
    dma_mode = "eager" if block_sizes is not None and block_sizes.kv_heads_per_block else "on_wait"
    try:
        with compat.tpu_interpret_mode(dma_execution_mode=dma_mode):
            for name, (q_lens, kv_lens) in SCENARIOS.items():
                case = make_case(
                    rng, q_lens, kv_lens, page_size=page_size, hq=hq, hkv=hkv, d=d,
                    dtype=jnp.float32, batch=BATCH, num_tokens=NUM_TOKENS, max_pages=max_pages,
                    num_pages=4 * (max_pages - 1) + 3, unused_fill=0.0,
                )  # fmt: skip
                (kq, vq, ks, vs), deq_case = _quantized_case(case, kv, page_size)
                q = case.q.astype(dtype)
                deq_case.q = q
                meta = (case.kv_lens, case.block_tables, case.cu_q_lens, case.num_seqs)
                ref = ragged_paged_attention(q, kq, vq, *meta, ks, vs, impl="reference", **kw)
                out = ragged_paged_attention(
                    q, kq, vq, *meta, ks, vs, impl="pallas_tpu", block_sizes=block_sizes, **kw
                )
                ref = np.asarray(ref.astype(jnp.float32))
                out = np.asarray(out.astype(jnp.float32))
                assert np.isfinite(out).all() and np.isfinite(ref).all(), name
                want = np_attention(deq_case, **kw)  # float64 on the dequantized K/V
                tol = 1e-5 if dtype == jnp.float32 else 3e-2
                np.testing.assert_allclose(ref, want, atol=tol, rtol=tol, err_msg=f"ref {name}")
                np.testing.assert_allclose(out, want, atol=tol, rtol=tol, err_msg=f"pallas {name}")
                np.testing.assert_array_equal(out[sum(q_lens) :], 0.0)
                # And close to attention over the unquantized cache (the quantization error).
                exact = np_attention(dataclasses.replace(case, q=q), **kw)
                err = np.abs(out - exact).max()
                assert err < (0.05 if kv == "int8" else 0.2), (name, err)
    finally:
        compat.reset_interpret_state()


def test_quantized_cache_errors() -> None:
    q = jnp.zeros((8, 2, 8), jnp.float32)
    codes = jnp.zeros((2, 8, 1, 8), jnp.int8)
    sc = jnp.ones((2, 8, 1), jnp.float32)
    meta = (jnp.zeros(1, jnp.int32), jnp.zeros((1, 1), jnp.int32), jnp.zeros(2, jnp.int32),
            jnp.ones(1, jnp.int32))  # fmt: skip
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        ragged_paged_attention(q, codes, codes, *meta, sm_scale=1.0)
    with pytest.raises(ValueError, match="given together"):
        ragged_paged_attention(q, codes, codes, *meta, sc, None, sm_scale=1.0)
    with pytest.raises(ValueError, match="float32 \\[N, S, Hkv\\]"):
        ragged_paged_attention(q, codes, codes, *meta, sc[:1], sc[:1], sm_scale=1.0)
    with pytest.raises(ValueError, match="not int8"):
        f = jnp.zeros((2, 8, 1, 8), jnp.float32)
        ragged_paged_attention(q, f, f, *meta, sc, sc, sm_scale=1.0)
