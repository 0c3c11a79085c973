"""Mamba / Mamba2 on the XLA backend: the ragged jnp ops (conv with state, token scan) equal the
per-request torch reference, and greedy tokens through the engine equal transformers' generate
(mixed-length batch; tight cache forcing chunked prefill and preemption)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ssm_zoo import SSM_ARCHS, reference_greedy

jax = pytest.importorskip("jax")
jnp = jax.numpy

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [40, 41, 42],
    list(range(100, 123)),
    [200],
]
MAX_NEW = 6
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32)  # few buckets: quick compiles


def test_ragged_ops_match_torch_reference() -> None:
    """Three rows (fresh 5-token chunk, a 3-token chunk continuing a state, a 1-token decode)
    + padding tokens and a padding row, vs backends_torch/layers/ssm_ops.py per request."""
    from xlaserve.backends_torch.layers import ssm_ops as ref
    from xlaserve.models_flax import ssm_ops

    rng = np.random.default_rng(0)
    C, K, Hs, P, N, R, T = 6, 4, 3, 2, 4, 4, 12
    lens, starts = [5, 3, 1], [0, 7, 20]
    cu = np.array([0, 5, 8, 9, 9], np.int32)  # row 3 is padding; tokens 9.. are padding
    kv_lens = np.array([s + n for s, n in zip(starts, lens, strict=True)] + [0], np.int32)
    x = rng.normal(size=(T, C)).astype(np.float32)
    w, b = rng.normal(size=(C, K)).astype(np.float32), rng.normal(size=C).astype(np.float32)
    conv0 = rng.normal(size=(R, C, K - 1)).astype(np.float32)
    lay = ssm_ops.row_layout(jnp.asarray(cu), jnp.asarray(kv_lens), T)
    conv0_rows = np.where(np.asarray(lay.fresh)[:, None, None], 0.0, conv0)
    y, new = ssm_ops.ragged_causal_conv1d(
        jnp.asarray(x),
        jnp.asarray(w),
        jnp.asarray(b),
        jnp.asarray(conv0_rows),
        lay,
        jnp.asarray(cu),
    )
    A = -np.exp(rng.normal(size=(Hs, 1, 1))).astype(np.float32)
    xs = rng.normal(size=(T, Hs, P)).astype(np.float32)
    dt = np.log1p(np.exp(rng.normal(size=(T, Hs)))).astype(np.float32)
    B, Cm = (
        rng.normal(size=(T, Hs, N)).astype(np.float32),
        rng.normal(size=(T, Hs, N)).astype(np.float32),
    )
    D = rng.normal(size=Hs).astype(np.float32)
    h0 = rng.normal(size=(R, Hs, P, N)).astype(np.float32)
    h0_rows = np.where(np.asarray(lay.fresh)[:, None, None, None], 0.0, h0)
    ys, hs = ssm_ops.ragged_selective_scan(
        *map(jnp.asarray, (xs, dt, A, B, Cm, D, h0_rows)), lay, jnp.asarray(cu)
    )
    t = torch.from_numpy
    for r in range(3):
        lo, hi = cu[r], cu[r + 1]
        yr, sr = ref.causal_conv1d(t(x[lo:hi]), t(w), t(b), t(conv0_rows[r]))
        np.testing.assert_allclose(np.asarray(y[lo:hi]), yr.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(new[r]), sr.numpy(), rtol=1e-6, atol=1e-6)
        yr, hr = ref.selective_scan(
            t(xs[lo:hi]), t(dt[lo:hi]), t(A), t(B[lo:hi]), t(Cm[lo:hi]), t(D), t(h0_rows[r])
        )
        np.testing.assert_allclose(np.asarray(ys[lo:hi]), yr.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(hs[r]), hr.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(hs[3]), h0_rows[3])  # padding row untouched
    assert np.asarray(lay.fresh)[:3].tolist() == [True, False, False]


def _generate(llm) -> list[list[int]]:  # noqa: ANN001
    from xlaserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", list(SSM_ARCHS))
def test_greedy_matches_transformers_xla(name: str, ssm_model_dir) -> None:  # noqa: ANN001
    from xlaserve import LLM

    path = ssm_model_dir(name)
    want = reference_greedy(name, path, PROMPTS, MAX_NEW)
    llm = LLM(path, backend="xla", dtype="float32", block_size=4, max_model_len=64, **SMALL)
    assert _generate(llm) == want


@pytest.mark.parametrize("name", list(SSM_ARCHS))
def test_greedy_under_pressure_xla(name: str, ssm_model_dir) -> None:  # noqa: ANN001
    """Token budget 16 (one bucket; the 23-token prompt is chunked), 3 state slots for 4
    sequences, 9 blocks of 4: admission waits for slots, running requests preempt."""
    from xlaserve import LLM

    path = ssm_model_dir(name)
    want = reference_greedy(name, path, PROMPTS, MAX_NEW)
    llm = LLM(
        path, backend="xla", dtype="float32", block_size=4, max_model_len=32, num_kv_blocks=9,
        num_state_slots=3, max_num_seqs=4, max_num_batched_tokens=16,
    )  # fmt: skip
    assert _generate(llm) == want
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.kv_cache_usage == 0.0 and stats.num_running == 0


def test_speculative_decoding_refused_xla(ssm_model_dir) -> None:  # noqa: ANN001
    from xlaserve import LLM

    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        LLM(
            ssm_model_dir("mamba"), backend="xla", max_model_len=64,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )  # fmt: skip
