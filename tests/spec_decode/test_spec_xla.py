"""Speculative decoding (n-gram drafts) on the XLA backend, CPU: greedy output equals the
non-speculative XLA run and the torch run, drafts are really accepted, no program is compiled
while serving; seeded sampled requests with drafts run, are reproducible and return the asked
number of tokens; the on-device `verify` follows the rejection contract on hand-made logits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from xlaserve import LLM, SamplingParams

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],
    [20, 21, 22, 23, 20, 21, 22],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 40, 41, 42],
    [100, 37, 250, 12, 99],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
ENGINE = dict(num_kv_blocks=96, block_size=4, max_num_batched_tokens=32, max_num_seqs=4)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def _ids(outs) -> list[list[int]]:  # noqa: ANN001
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("spec-xla-jax-cache"))


@pytest.fixture(scope="module")
def plain(tiny_model_dir, cache_dir) -> dict:  # noqa: ANN001
    path = tiny_model_dir("llama")
    torch_llm = LLM(model=path, backend="torch", **ENGINE)
    xla_llm = LLM(model=path, backend="xla", compilation_cache_dir=cache_dir, **ENGINE)
    lp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    return {
        "torch": _ids(torch_llm.generate(PROMPTS, GREEDY, use_tqdm=False)),
        "xla": _ids(xla_llm.generate(PROMPTS, GREEDY, use_tqdm=False)),
        "xla_lp": xla_llm.generate(PROMPTS[:2], lp, use_tqdm=False),
    }


@pytest.fixture(scope="module")
def spec_llm(tiny_model_dir, cache_dir) -> LLM:  # noqa: ANN001
    return LLM(
        model=tiny_model_dir("llama"),
        backend="xla",
        compilation_cache_dir=cache_dir,
        speculative_config=NGRAM,
        **ENGINE,
    )


def test_ngram_greedy_equals_plain_and_torch(spec_llm, plain) -> None:  # noqa: ANN001
    runner = spec_llm.llm_engine.runner
    assert ("verify", 4) in runner.programs  # compiled at start-up
    lazy = len(runner.lazy_compiles)
    outs = spec_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _ids(outs) == plain["xla"] == plain["torch"]
    st = spec_llm.llm_engine.get_stats()
    assert st.spec_num_draft_tokens > 0 and st.spec_num_accepted_tokens > 0
    assert st.spec_num_accepted_tokens <= st.spec_num_draft_tokens
    assert outs[0].metrics.spec_num_accepted_tokens > 0
    assert runner.lazy_compiles[lazy:] == []  # verification reused start-up programs

    # Logprobs: one entry per returned token, equal to the plain XLA run's.
    lp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    got = spec_llm.generate(PROMPTS[:2], lp, use_tqdm=False)
    for g, r in zip(got, plain["xla_lp"], strict=True):
        g, r = g.outputs[0], r.outputs[0]
        assert g.token_ids == r.token_ids and len(g.logprobs) == len(g.token_ids)
        for gp, rp in zip(g.logprobs, r.logprobs, strict=True):
            assert gp.keys() == rp.keys()
            for t in gp:
                assert gp[t].logprob == pytest.approx(rp[t].logprob, abs=1e-4)
    assert runner.lazy_compiles[lazy:] == []


def test_seeded_sampled_with_drafts(spec_llm, plain) -> None:  # noqa: ANN001
    runner = spec_llm.llm_engine.runner
    lazy = len(runner.lazy_compiles)
    before = spec_llm.llm_engine.get_stats().spec_num_draft_tokens
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=16, ignore_eos=True)
    params = [GREEDY, sampled, GREEDY, sampled]
    a = _ids(spec_llm.generate(PROMPTS, params, use_tqdm=False))
    b = _ids(spec_llm.generate(PROMPTS, params, use_tqdm=False))
    assert a == b  # seeded requests are reproducible
    assert [len(x) for x in a] == [20, 16, 20, 16]
    assert all(0 <= t < runner.vocab for x in a for t in x)
    # Greedy requests batched with sampled ones still match plain greedy decoding.
    assert a[0] == plain["xla"][0] and a[2] == plain["xla"][2]
    assert spec_llm.llm_engine.get_stats().spec_num_draft_tokens > before
    assert runner.lazy_compiles[lazy:] == []


def test_eagle_refused_on_xla(tiny_model_dir) -> None:  # noqa: ANN001
    # draft_model runs on XLA too (tests/spec_decode/test_spec_xla_draft.py); eagle nowhere yet.
    path = tiny_model_dir("llama")
    with pytest.raises(NotImplementedError, match="eagle"):
        LLM(model=path, backend="xla", speculative_config={"method": "eagle", "model": path})


def _tensors(n: int, v: int, temperature: float):  # noqa: ANN202
    from xlaserve.backends_xla.sampler import SamplingTensors, host_tensors

    h = host_tensors(n, v, True)
    h["temperature"][:] = temperature
    h["seeds"][:] = np.arange(n, dtype=np.uint32)
    return SamplingTensors(**{k: jnp.asarray(x) for k, x in h.items()})


def test_verify_rules_on_hand_made_logits() -> None:
    from xlaserve.backends_xla.sampler import verify

    v, k = 8, 3
    # Request 0: argmax per position 1, 2, 3, 4; drafts 1, 2, 5 -> accept 2, then correction 3.
    # Request 1: no drafts -> just the argmax of row 0 (6); padding rows are ignored.
    lg = np.full((2, k + 1, v), -5.0, np.float32)
    for j, t in enumerate([1, 2, 3, 4]):
        lg[0, j, t] = 5.0
    lg[1, :, 6] = 5.0
    drafts = jnp.asarray([[1, 2, 5], [0, 0, 0]], jnp.int32)
    nd = jnp.asarray([3, 0], jnp.int32)
    out = verify(jnp.asarray(lg.reshape(-1, v)), _tensors(8, v, 0.0), drafts, nd)
    assert out.num_tokens.tolist() == [3, 1]
    assert out.token_ids[0, :3].tolist() == [1, 2, 3] and int(out.token_ids[1, 0]) == 6
    # All drafts accepted -> bonus token from the last row.
    out = verify(jnp.asarray(lg.reshape(-1, v)), _tensors(8, v, 0.0), drafts.at[0, 2].set(3), nd)
    assert out.token_ids[0].tolist() == [1, 2, 3, 4] and int(out.num_tokens[0]) == 4

    # Sampled: p puts (almost) all mass on the draft -> accepted; zero mass -> rejected, and the
    # recovered token is never the draft.
    lg = np.full((2, k + 1, v), -30.0, np.float32)
    lg[0, :, 2] = 30.0  # request 0: drafts 2, 2, 2 certain
    lg[1, :, :] = 0.0
    lg[1, :, 4] = -np.inf  # request 1: draft 4 impossible
    drafts = jnp.asarray([[2, 2, 2], [4, 4, 4]], jnp.int32)
    nd = jnp.asarray([3, 3], jnp.int32)
    for seed in range(5):
        st = _tensors(8, v, 1.0)
        st = type(st)(**{**st.__dict__, "seeds": st.seeds + seed})
        out = verify(jnp.asarray(lg.reshape(-1, v)), st, drafts, nd)
        assert out.num_tokens.tolist() == [4, 1]
        assert out.token_ids[0].tolist() == [2, 2, 2, 2]
        assert int(out.token_ids[1, 0]) != 4


def test_verify_sampled_is_lossless() -> None:
    """With one one-hot draft, the first emitted token (draft if accepted, else the residual
    sample) is distributed as p, and the bonus token after an accepted draft as p_1."""
    from test_spec_rejection_sampler import chi_square_pvalue

    from xlaserve.backends_xla.sampler import verify

    v, b = 6, 4000
    rng = np.random.default_rng(0)
    rows = rng.normal(0.0, 1.0, (2, v)).astype(np.float32)
    p = np.exp(rows) / np.exp(rows).sum(-1, keepdims=True)
    lg = np.broadcast_to(rows, (b, 2, v)).reshape(-1, v)
    drafts = jnp.full((b, 1), int(np.argsort(p[0])[-2]), jnp.int32)  # not the mode: real rejections
    out = verify(jnp.asarray(lg), _tensors(2 * b, v, 1.0), drafts, jnp.ones(b, jnp.int32))
    toks, n = np.asarray(out.token_ids), np.asarray(out.num_tokens)
    first = np.bincount(toks[:, 0], minlength=v)
    assert 0 < (n == 2).sum() < b  # both outcomes happen
    assert chi_square_pvalue(first, p[0]) > 1e-3
    bonus = np.bincount(toks[n == 2, 1], minlength=v)
    assert chi_square_pvalue(bonus, p[1]) > 1e-3


def test_verify_multi_draft_resamples_at_the_rejected_row() -> None:
    """2 and 3 drafts, sampled, on peaked rows with exact outcomes (the torch sampler's cases,
    test_spec_rejection_sampler.MULTI_DRAFT_CASES): a rejection at draft k resamples from row
    k's residual, an all-accepted run takes its bonus token from row d. All cases in one call
    (each eager `verify` call traces and compiles its conds again: few calls)."""
    from test_spec_rejection_sampler import MAINS, MULTI_DRAFT_CASES, SECONDS, V, peaked_rows

    from xlaserve.backends_xla.sampler import verify

    k = 3
    b = len(MULTI_DRAFT_CASES)
    lg = np.zeros((b, k + 1, V), np.float32)
    drafts = np.zeros((b, k), np.int32)
    for i, (ds, _) in enumerate(MULTI_DRAFT_CASES):
        rows = peaked_rows(MAINS[: len(ds) + 1], SECONDS[: len(ds) + 1]).numpy()
        lg[i, : len(ds) + 1] = rows
        lg[i, len(ds) + 1 :] = rows[-1]  # padding rows copy row d (the contract)
        drafts[i, : len(ds)] = ds
    nd = jnp.asarray([len(ds) for ds, _ in MULTI_DRAFT_CASES], jnp.int32)
    for seed in range(2):
        st = _tensors(b * (k + 1), V, 1.0)
        st = type(st)(**{**st.__dict__, "seeds": st.seeds + seed})
        out = verify(jnp.asarray(lg.reshape(-1, V)), st, jnp.asarray(drafts), nd)
        n = np.asarray(out.num_tokens)
        got = [np.asarray(out.token_ids)[i, : n[i]].tolist() for i in range(b)]
        assert got == [want for _, want in MULTI_DRAFT_CASES], f"seed {seed}"
