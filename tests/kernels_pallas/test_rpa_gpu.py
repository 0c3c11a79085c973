"""Ragged paged attention, the Pallas GPU (Triton) kernel, run on CPU under Pallas' interpreter.

On a GPU backend the same file runs the real Triton kernel (interpret mode is only the CPU
default). Tier 1: tiny cases worked out by hand. Tier 2: a sweep against the float64 numpy oracle and the
jnp reference over page sizes, GQA ratios (incl. a non-power-of-2 G), head dims, dtypes,
raggedness (decode-only, prefill-only, mixed, partial pages, query tiles splitting a sequence),
sliding window, soft cap and split KV. Unused cache slots hold NaN, so a read past kv_len or
through an unused block-table entry fails the test. Each sweep config compiles once (fixed
padded shapes) and runs every scenario through that executable. Plus: the Triton lowering
(to the TTIR module XLA compiles on a GPU) checked on CPU, "auto" dispatch, clear errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _rpa_testlib import make_case, np_attention
from optional_deps import import_or_skip
from test_rpa_sweep import (
    BATCH,
    MAX_KV,
    NUM_TOKENS,
    SCENARIOS,
    TOLERANCE,
    _check_all_scenarios,
    _jit_ref,
)
from triton_ptx import sm90_ptx

from xlaserve.kernels_pallas import BlockSizes, ragged_paged_attention
from xlaserve.kernels_pallas.ragged_paged_attention import write_kv_quant
from xlaserve.kernels_pallas.ragged_paged_attention_gpu import (
    GpuBlockSizes,
    ragged_paged_attention_gpu,
    resolve_gpu_block_sizes,
)

GPU_SCENARIOS: dict[str, tuple[list[int], list[int]]] = {
    **SCENARIOS,
    # Three fresh prompts and a chunk over a cached prefix; 32 tokens, no padding token.
    "prefill_only": ([13, 8, 3, 8], [13, 8, 30, MAX_KV]),
}


def _attend(case, impl: str = "pallas_gpu", **kw) -> np.ndarray:  # noqa: ANN001
    out = ragged_paged_attention(*case.args(), impl=impl, **kw)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    return np.asarray(out.astype(jnp.float32))


# ------------------------------------------------------------------------------------------
# Tier 1: by hand. D 16, S 8, one KV head; q = 0 makes every visible key weigh the same, so
# each row's output is the mean of the V rows it may see.
# ------------------------------------------------------------------------------------------

D, S = 16, 8


def _hand_case(kv_len: int, q_len: int, q: np.ndarray | None = None, k_row0: float = 0.0):  # noqa: ANN202
    """One sequence over pages [2, 0] (non-contiguous) of a 3-page cache; v[i] = (i + 1) * 1.
    NaN everywhere else; T padded to q_len + 2 (two padding rows), B = 2 (one padded)."""
    k = np.full((3, S, 1, D), np.nan, np.float32)
    v = np.full((3, S, 1, D), np.nan, np.float32)
    for i in range(kv_len):
        page, slot = (2, 0)[i // S], i % S
        k[page, slot, 0] = 0.0
        v[page, slot, 0] = i + 1.0
    k[2, 0, 0, 0] = k_row0
    t = q_len + 2
    qq = np.zeros((t, 1, D), np.float32) if q is None else q
    args = (
        jnp.asarray(qq), jnp.asarray(k), jnp.asarray(v),
        jnp.asarray([kv_len, 0], jnp.int32), jnp.asarray([[2, 0], [1, 1]], jnp.int32),
        jnp.asarray([0, q_len, q_len], jnp.int32), jnp.asarray([1], jnp.int32),
    )  # fmt: skip
    return args


def test_hand_prefill_is_causal_mean() -> None:
    """A fresh 10-token prompt (spans two pages): row i sees keys 0..i, mean = (i + 2) / 2."""
    args = _hand_case(kv_len=10, q_len=10)
    out = np.asarray(ragged_paged_attention(*args, sm_scale=1.0, impl="pallas_gpu"))
    want = np.array([(i + 2) / 2 for i in range(10)])
    np.testing.assert_allclose(out[:10, 0, :], np.repeat(want[:, None], D, 1), rtol=1e-6)
    np.testing.assert_array_equal(out[10:], 0.0)  # padding rows


def test_hand_chunk_with_window() -> None:
    """The last 3 of 12 positions (a chunk over a cached prefix of 9), window 4: position p sees
    p-3..p, mean of v = p - 0.5 (positions 9, 10, 11 -> 8.5, 9.5, 10.5)."""
    args = _hand_case(kv_len=12, q_len=3)
    out = np.asarray(
        ragged_paged_attention(*args, sm_scale=1.0, sliding_window=4, impl="pallas_gpu")
    )
    np.testing.assert_allclose(out[:3, 0, 0], [8.5, 9.5, 10.5], rtol=1e-6)
    np.testing.assert_array_equal(out[3:], 0.0)


def test_hand_decode_peaked_and_soft_capped() -> None:
    """A decode at kv_len 5 whose q . k_0 = 20 (q_0 = 1, k_0[0] = 20): without a cap key 0
    dominates (~v_0 = 1); cap 1 squashes that logit to tanh(20) ~ 1, so the weights are
    (e, 1, 1, 1, 1) / (e + 4)."""
    q = np.zeros((3, 1, D), np.float32)
    q[0, 0, 0] = 1.0
    args = _hand_case(kv_len=5, q_len=1, q=q, k_row0=20.0)
    out = np.asarray(ragged_paged_attention(*args, sm_scale=1.0, impl="pallas_gpu"))
    np.testing.assert_allclose(out[0, 0, 0], 1.0, atol=1e-6)
    capped = np.asarray(
        ragged_paged_attention(*args, sm_scale=1.0, soft_cap=1.0, impl="pallas_gpu")
    )
    e = np.exp(np.tanh(20.0))
    _, rtol = TOLERANCE[jnp.float32]
    np.testing.assert_allclose(capped[0, 0, 0], (e * 1 + 2 + 3 + 4 + 5) / (e + 4), rtol=rtol)
    np.testing.assert_array_equal(capped[1:], 0.0)


# ------------------------------------------------------------------------------------------
# Tier 2: sweep
# ------------------------------------------------------------------------------------------


# (page_size, hq, hkv, d, dtype, block_sizes, sliding_window, soft_cap): the sweep axes are
# covered by their pairs rather than their product (one interpret compile per line).
CONFIGS = [
    (8, 2, 2, 64, jnp.float32, None, None, None),  # G 1, table default (prefill tiles)
    # G 2, BQ 8 tokens, one 16-slot page per step: the 9- and 13-token sequences span tiles.
    (16, 4, 2, 128, jnp.float32, GpuBlockSizes(16, 1), None, None),
    (8, 8, 2, 64, jnp.bfloat16, GpuBlockSizes(16, 2), None, None),  # G 4, BQ 4
    (16, 4, 1, 128, jnp.bfloat16, None, None, None),  # G 4, table default
    (8, 6, 2, 64, jnp.float32, GpuBlockSizes(32, 4), None, None),  # G 3 (padded to 4), BQ 8
    (8, 4, 2, 64, jnp.float32, GpuBlockSizes(16, 2), 5, None),  # window shorter than a page
    (16, 4, 2, 64, jnp.bfloat16, GpuBlockSizes(16, 1), 19, 30.0),  # window over pages + cap
    (8, 8, 2, 128, jnp.float32, GpuBlockSizes(64, 4), None, 5.0),  # soft cap
    # Split KV (flash decoding): 4 chunks, some empty for short contexts; then with a window.
    (16, 4, 2, 64, jnp.float32, GpuBlockSizes(16, 1, kv_splits=4, force_splits=True), None, None),
    (8, 4, 1, 64, jnp.bfloat16, GpuBlockSizes(16, 2, kv_splits=2, force_splits=True), 19, 30.0),
    # head_dim not a power of 2 (Phi's 80; 48), read through the column mask: plain, with a
    # window + cap, and with split KV.
    (16, 4, 2, 80, jnp.float32, None, None, None),
    (8, 4, 2, 48, jnp.bfloat16, GpuBlockSizes(16, 2), 19, 30.0),
    (16, 4, 1, 80, jnp.float32, GpuBlockSizes(16, 1, kv_splits=4, force_splits=True), None, None),
]


def _config_id(c: tuple) -> str:
    s, hq, hkv, d, dtype, bs, w, cap = c
    name = f"S{s}-hq{hq}-hkv{hkv}-d{d}-{jnp.dtype(dtype).name}"
    name += "-table" if bs is None else f"-r{bs.rows_per_block}p{bs.pages_per_block}k{bs.kv_splits}"
    return name + (f"-w{w}" if w else "") + (f"-cap{cap:g}" if cap else "")


@pytest.mark.parametrize(
    "page_size,hq,hkv,d,dtype,block_sizes,sliding_window,soft_cap",
    CONFIGS,
    ids=[_config_id(c) for c in CONFIGS],
)
def test_kernel_matches_reference(
    page_size, hq, hkv, d, dtype, block_sizes, sliding_window, soft_cap
) -> None:  # noqa: ANN001
    _check_all_scenarios(
        page_size=page_size, hq=hq, hkv=hkv, d=d, dtype=dtype, block_sizes=block_sizes,
        sliding_window=sliding_window, soft_cap=soft_cap, impl="pallas_gpu",
        scenarios=GPU_SCENARIOS,
    )  # fmt: skip


def test_decode_batch_uses_decode_tiles_and_split_kv() -> None:
    """T <= B picks the table's decode block sizes; the small grid turns split KV on."""
    bs, bq, _, num_tiles, splits = resolve_gpu_block_sizes(8, 8, 2, 2, 64, 16, jnp.bfloat16)
    assert bs.rows_per_block == 16 and bq == 8 and splits == bs.kv_splits > 1
    assert num_tiles == 1 + 8
    # A big grid (here 256 tiles x 8 KV heads) never splits.
    assert resolve_gpu_block_sizes(256, 256, 8, 4, 128, 16, jnp.bfloat16)[4] == 1
    rng = np.random.default_rng(3)
    kv_lens = [1, 16, 17, 40, 33, 9]
    case = make_case(
        rng, [1] * 6, kv_lens, page_size=16, hq=4, hkv=2, d=64, dtype=jnp.bfloat16,
        batch=8, num_tokens=8,
    )  # fmt: skip
    out = _attend(case, sm_scale=0.125)
    atol, rtol = TOLERANCE[jnp.bfloat16]
    np.testing.assert_allclose(out, np_attention(case, 0.125), atol=atol, rtol=rtol)
    np.testing.assert_array_equal(out[6:], 0.0)


def test_num_seqs_below_batch_ignores_later_sequences() -> None:
    """num_seqs = 2 of 5 described sequences: only the first two sequences' rows are real."""
    rng = np.random.default_rng(7)
    q_lens, kv_lens = GPU_SCENARIOS["mixed"]
    case = make_case(
        rng, q_lens, kv_lens, page_size=8, hq=2, hkv=2, d=64, batch=BATCH,
        num_tokens=NUM_TOKENS, max_pages=-(-MAX_KV // 8) + 1, num_pages=5 * -(-MAX_KV // 8) + 3,
    )  # fmt: skip
    case.num_seqs = jnp.asarray([2], jnp.int32)
    kw = dict(sm_scale=0.125)
    out = _attend(case, **kw)
    ref = np.asarray(_jit_ref(*case.args(), **kw))
    atol, rtol = TOLERANCE[jnp.float32]
    np.testing.assert_allclose(out, ref, atol=atol, rtol=rtol)
    n_real = q_lens[0] + q_lens[1]
    assert np.abs(out[:n_real]).max() > 0
    np.testing.assert_array_equal(out[n_real:], 0.0)


# ------------------------------------------------------------------------------------------
# Triton lowering (runs the Pallas -> Triton IR lowering on CPU; PTX compilation is GPU-only)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hq,d,block_sizes,kw",
    [
        (32, 128, None, dict(sliding_window=7, soft_cap=30.0)),  # Llama-like GQA 4, prefill
        (24, 128, GpuBlockSizes(16, 8, kv_splits=4, force_splits=True), {}),  # G 3 + split KV
        (40, 128, None, dict(chunk_size=8)),  # Llama 4 Scout heads, chunked attention
        (32, 96, None, {}),  # Phi-3 heads: 96 columns read as 128 (clamped addresses)
    ],
    ids=["gqa4-window-cap", "g3-split", "g5-chunk", "d96"],
)
def test_lowers_to_triton(hq, d, block_sizes, kw) -> None:  # noqa: ANN001
    export = import_or_skip("jax.export")
    case = make_case(
        np.random.default_rng(0), [1, 9, 13], [23, 20, 13], page_size=16, hq=hq, hkv=8, d=d,
        dtype=jnp.bfloat16, batch=4, num_tokens=32,
    )  # fmt: skip

    def f(*args):  # noqa: ANN002, ANN202
        return ragged_paged_attention_gpu(
            *args, sm_scale=0.125, block_sizes=block_sizes, interpret=False, **kw
        )

    exported = export.export(
        jax.jit(f),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*case.args())
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("d", [128, 96])
def test_compiles_to_ptx_with_triton(d, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The Llama-shaped prefill tile (and Phi-3's 96-column heads, read as 128) through pip
    Triton (the torch backend's) down to sm_90 PTX/cubin (tests/triton_ptx.py)."""
    case = make_case(
        np.random.default_rng(0), [1, 9, 13], [23, 20, 13], page_size=16, hq=32, hkv=8, d=d,
        dtype=jnp.bfloat16, batch=4, num_tokens=32,
    )  # fmt: skip
    fn = lambda *a: ragged_paged_attention_gpu(*a, sm_scale=0.125, interpret=False)  # noqa: E731
    ptx = sm90_ptx(fn, case.args(), tmp_path, monkeypatch)
    assert "wgmma" in ptx or "mma" in ptx


@pytest.mark.parametrize("code", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantized_cache_compiles_to_ptx_with_triton(code, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The quantized-cache kernel (codes + scale loads, dequantized in registers), Llama
    shape, to sm_90 PTX as above."""
    case = make_case(
        np.random.default_rng(0), [1, 9, 13], [23, 20, 13], page_size=16, hq=32, hkv=8, d=128,
        dtype=jnp.bfloat16, batch=4, num_tokens=32,
    )  # fmt: skip
    q, k, v, *meta = case.args()
    scales = jnp.ones(k.shape[:3], jnp.float32)
    args = (q, k.astype(code), v.astype(code), *meta, scales, scales)

    def f(q, k, v, kv_lens, bt, cu, ns, ks, vs):  # noqa: ANN001, ANN202
        return ragged_paged_attention_gpu(
            q, k, v, kv_lens, bt, cu, ns, sm_scale=0.125, interpret=False, k_scale=ks, v_scale=vs
        )

    assert "mma" in sm90_ptx(f, args, tmp_path, monkeypatch)


# ------------------------------------------------------------------------------------------
# Dispatch and errors
# ------------------------------------------------------------------------------------------


def test_auto_is_reference_on_cpu_and_pallas_gpu_is_one_kernel() -> None:
    case = make_case(np.random.default_rng(5), [1, 4], [9, 4], page_size=8, hq=2, hkv=1, d=16)

    def jaxpr(impl: str) -> str:
        fn = lambda *a: ragged_paged_attention(*a, sm_scale=0.25, impl=impl)  # noqa: E731
        return str(jax.make_jaxpr(fn)(*case.args()))

    if jax.default_backend() != "cpu":  # on a GPU "auto" is GPU_AUTO_IMPL, as measured
        pytest.skip("checks the CPU dispatch")
    assert "pallas_call" not in jaxpr("auto")
    assert jaxpr("pallas_gpu").count("pallas_call[") == 1


def test_auto_on_a_gpu_backend_picks_the_kernel_only_where_it_applies(monkeypatch) -> None:
    """impl="auto" on a GPU backend is GPU_AUTO_IMPL (the kernel), except for shapes the kernel
    does not take (page size 12: not a power of 2), which run the jnp path instead of failing;
    a head_dim that is not a power of 2 takes the kernel with GPU_AUTO_EXTENDED (the default
    since its GPU run), the jnp path without."""
    import importlib

    # (the package re-exports the function under the module's name)
    rpa_mod = importlib.import_module("xlaserve.kernels_pallas.ragged_paged_attention")

    monkeypatch.setattr(rpa_mod, "GPU_AUTO_IMPL", "pallas_gpu")
    monkeypatch.setattr(rpa_mod.jax, "default_backend", lambda: "gpu")

    def jaxpr(d: int, page_size: int = 8) -> str:
        rng = np.random.default_rng(d)
        case = make_case(rng, [1, 3], [7, 3], page_size=page_size, hq=2, hkv=1, d=d)
        fn = lambda *a: ragged_paged_attention(*a, sm_scale=0.25, impl="auto")  # noqa: E731
        return str(jax.make_jaxpr(fn)(*case.args()))

    assert "pallas_call" not in jaxpr(32, page_size=12)
    assert jaxpr(32).count("pallas_call[") == 1
    assert rpa_mod.GPU_AUTO_EXTENDED
    assert jaxpr(80).count("pallas_call[") == 1
    monkeypatch.setattr(rpa_mod, "GPU_AUTO_EXTENDED", False)
    assert "pallas_call" not in jaxpr(48)  # (a new shape: jit traces are cached)


@pytest.mark.parametrize("code", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantized_cache_dequantized_in_the_kernel(code, dtype) -> None:  # noqa: ANN001
    """int8 / fp8 codes with per-(token, head) scales: the kernel dequantizes each tile in
    registers and matches the reference (which dequantizes the gathered pages) on a mixed
    batch (decodes, a fresh prompt, a chunk over a cached prefix, partial pages), GQA 2, with
    split KV and without; unused slots hold codes whose scales are NaN, so reading past kv_len
    fails the test."""
    rng = np.random.default_rng(8)
    q_lens, kv_lens = [1, 9, 1, 5], [23, 9, 40, 29]
    n, s, hkv, hq, d = 24, 8, 2, 4, 48
    k = np.zeros((n, s, hkv, d), np.float32)
    v = np.zeros((n, s, hkv, d), np.float32)
    ks = np.full((n, s, hkv), np.nan, np.float32)
    vs = np.full((n, s, hkv), np.nan, np.float32)
    k, v, ks, vs = (jnp.asarray(a) for a in (k, v, ks, vs))
    k, v = k.astype(code), v.astype(code)
    pages = rng.permutation(n)[: 4 * 6].reshape(4, 6).astype(np.int32)
    slots = np.concatenate(
        [pages[b][np.arange(kv) // s] * s + np.arange(kv) % s for b, kv in enumerate(kv_lens)]
    ).astype(np.int32)
    new = jnp.asarray(rng.normal(size=(2, len(slots), hkv, d)) * 2, jnp.float32)
    k, v, ks, vs = write_kv_quant(k, v, ks, vs, new[0], new[1], jnp.asarray(slots))
    t = sum(q_lens) + 3  # padding tokens
    q = jnp.asarray(rng.normal(size=(t, hq, d)), dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = (jnp.asarray(kv_lens, jnp.int32), jnp.asarray(pages), jnp.asarray(cu),
            jnp.asarray([4], jnp.int32))  # fmt: skip

    def run(impl: str, bs: GpuBlockSizes | None = None) -> np.ndarray:
        out = ragged_paged_attention(
            q, k, v, *meta, ks, vs, sm_scale=0.2, impl=impl, block_sizes=bs
        )
        return np.asarray(out.astype(jnp.float32))

    ref = run("reference")
    atol, rtol = TOLERANCE[dtype]
    split = GpuBlockSizes(16, 1, kv_splits=4, force_splits=True)
    for bs in (None, split):
        out = run("pallas_gpu", bs)
        np.testing.assert_allclose(out, ref, atol=atol, rtol=rtol)
        np.testing.assert_array_equal(out[sum(q_lens) :], 0.0)
    fn = lambda *a: ragged_paged_attention(*a, ks, vs, sm_scale=0.2, impl="pallas_gpu")  # noqa: E731
    assert str(jax.make_jaxpr(fn)(q, k, v, *meta)).count("pallas_call[") == 1  # no fallback


@pytest.mark.parametrize(
    "d,page_size,dtype,block_sizes,match",
    [
        (320, 8, jnp.float32, None, "head_dim 1-256"),
        (64, 12, jnp.float32, None, "power-of-2 page size"),
        (64, 8, jnp.int32, None, "floating point"),
        (64, 8, jnp.float32, BlockSizes(2, 8), "takes GpuBlockSizes"),
    ],
)
def test_bad_inputs_give_clear_errors(d, page_size, dtype, block_sizes, match) -> None:  # noqa: ANN001
    q = jnp.zeros((4, 2, d), dtype)
    kv = jnp.zeros((3, page_size, 1, d), dtype)
    meta = (jnp.asarray([3], jnp.int32), jnp.asarray([[0]], jnp.int32),
            jnp.asarray([0, 1], jnp.int32), jnp.asarray([1], jnp.int32))  # fmt: skip
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(
            q, kv, kv, *meta, sm_scale=1.0, impl="pallas_gpu", block_sizes=block_sizes
        )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rows_per_block=24, pages_per_block=1), "power of 2"),
        (dict(rows_per_block=8, pages_per_block=1), ">= 16"),
        (dict(rows_per_block=16, pages_per_block=3), "power of 2"),
        (dict(rows_per_block=16, pages_per_block=1, num_warps=3), "num_warps"),
    ],
)
def test_bad_block_sizes(kwargs, match) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        GpuBlockSizes(**kwargs)
