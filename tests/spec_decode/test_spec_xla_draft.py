"""Draft-model speculative decoding on the XLA backend, CPU (backends_xla/draft.py): greedy
outputs equal plain XLA and torch draft_model (demo model + its trained draft), drafts are really
accepted, a mixed batch runs with no program compiled after start-up, prefix caching and
preemption keep the draft's KV right (a self-draft accepts every draft), and sampled outputs keep
the target's distribution (chi-square at temperature 1 on a 24-token vocabulary)."""

from __future__ import annotations

import numpy as np
import pytest
from test_spec_engine import _exact_marginals, assert_follows_target

from xlaserve import LLM, SamplingParams
from xlaserve.demo import DEMO_DRAFT_DIR, DEMO_MODEL_DIR

DEMO_PROMPTS = [
    "And God said, Let there be light: and there was light. And God said, Let there be",
    "In the beginning God created the heaven and the earth. In the beginning God created",
    "And it came to pass, when",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
DEMO_ENGINE = dict(num_kv_blocks=64, block_size=16, max_num_batched_tokens=16, max_num_seqs=2)
K = 3


def _ids(outs) -> list[list[int]]:  # noqa: ANN001
    return [o.outputs[0].token_ids for o in outs]


def _draft(model: str, k: int = K) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("spec-xla-draft-jax-cache"))


def test_demo_draft_greedy_equals_plain_and_torch_mixed_batch(cache_dir: str) -> None:
    plain = _ids(
        LLM(model=DEMO_MODEL_DIR, backend="xla", compilation_cache_dir=cache_dir, **DEMO_ENGINE)
        .generate(DEMO_PROMPTS, GREEDY, use_tqdm=False)
    )  # fmt: skip
    torch_llm = LLM(model=DEMO_MODEL_DIR, speculative_config=_draft(DEMO_DRAFT_DIR), **DEMO_ENGINE)
    torch_out = _ids(torch_llm.generate(DEMO_PROMPTS, GREEDY, use_tqdm=False))
    llm = LLM(
        model=DEMO_MODEL_DIR,
        backend="xla",
        compilation_cache_dir=cache_dir,
        speculative_config=_draft(DEMO_DRAFT_DIR),
        **DEMO_ENGINE,
    )
    runner = llm.llm_engine.runner
    # Start-up programs: forward + draft catch-up per token bucket (1, 16: the CPU's auto
    # buckets); sample (general and all-greedy), verify and draft proposal per request bucket
    # (1, 2): all compiled already.
    assert runner.token_buckets == [1, 16]
    assert len(runner.startup_programs()) == 2 * 2 + 4 * 2 == 12
    assert set(runner.startup_programs()) <= set(runner.programs)
    assert ("draft_prefill", 16) in runner.programs and ("draft_decode", 2) in runner.programs

    outs = llm.generate(DEMO_PROMPTS, GREEDY, use_tqdm=False)
    assert _ids(outs) == plain == torch_out
    st = llm.llm_engine.get_stats()
    assert 0 < st.spec_num_accepted_tokens <= st.spec_num_draft_tokens
    # Measured here: 80 drafts, 40 accepted in 28 verification steps, mean acceptance length
    # 1 + 40 / 28 = 2.43 (torch: the same numbers; its greedy drafts are the same tokens).
    mean_len = 1 + st.spec_num_accepted_tokens / st.spec_num_drafts
    assert mean_len > 2.0
    ts = torch_llm.llm_engine.get_stats()
    assert abs(ts.spec_num_accepted_tokens - st.spec_num_accepted_tokens) <= 2

    # Mixed batch: greedy speculating requests next to a seeded sampled one (it speculates too),
    # one with max_tokens=1 (never gets drafts) and one asking for logprobs; the batch buckets
    # change step to step, yet nothing is compiled after start-up.
    sampled = SamplingParams(temperature=0.8, top_k=30, seed=3, max_tokens=20, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    lp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [*DEMO_PROMPTS, DEMO_PROMPTS[2]]
    params = [GREEDY, sampled, one, lp]
    a = llm.generate(prompts, params, use_tqdm=False)
    b = llm.generate(prompts, params, use_tqdm=False)
    assert _ids(a) == _ids(b)  # seeded + speculative is reproducible
    assert [len(x) for x in _ids(a)] == [24, 20, 1, 12]
    assert _ids(a)[0] == plain[0] and _ids(a)[2] == plain[2][:1] and _ids(a)[3] == plain[2][:12]
    assert len(a[3].outputs[0].logprobs) == 12
    assert a[1].metrics.spec_num_draft_tokens > 0 and a[2].metrics.spec_num_draft_tokens == 0
    assert runner.lazy_compiles == []


def test_prefix_cache_and_preemption_keep_draft_kv(tiny_model_dir, cache_dir: str) -> None:  # noqa: ANN001
    """The target as its own draft: every draft is the target's argmax as long as the draft's
    KV is right, also for prefix-cache hits (blocks computed by an earlier request) and for
    requests preempted (recompute) with drafts in flight."""
    target = tiny_model_dir("llama")
    prompts = [
        [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],
        [20, 21, 22, 23, 20, 21, 22],
        [100, 37, 250, 12, 99],
    ]
    engine = dict(num_kv_blocks=14, block_size=4, max_model_len=48, max_num_batched_tokens=16,
                  max_num_seqs=2)  # fmt: skip
    ref = _ids(LLM(model=target, **engine).generate(prompts, GREEDY, use_tqdm=False))  # torch
    llm = LLM(
        model=target,
        backend="xla",
        compilation_cache_dir=cache_dir,
        speculative_config=_draft(target),
        **engine,
    )
    first = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    s1 = llm.llm_engine.get_stats()
    assert s1.num_preemptions_total > 0
    assert first == ref
    assert 0 < s1.spec_num_accepted_tokens == s1.spec_num_draft_tokens
    second = _ids(llm.generate(prompts[:2], GREEDY, use_tqdm=False))
    s2 = llm.llm_engine.get_stats()
    assert second == ref[:2]
    assert s2.prefix_cache_hits > s1.prefix_cache_hits
    drafted = s2.spec_num_draft_tokens - s1.spec_num_draft_tokens
    assert drafted > 0
    assert s2.spec_num_accepted_tokens - s1.spec_num_accepted_tokens == drafted
    assert llm.llm_engine.runner.lazy_compiles == []


def test_sampled_draft_model_keeps_the_distribution(small_vocab_dirs) -> None:  # noqa: ANN001
    """Chi-square of output tokens 2 and 3 (verified against greedy self-drafts, accepted or
    rejected) over 1000 seeded samples vs the exact marginals at temperature 1; the same samples
    fail against the marginals at temperature 0.6 (the test has power)."""
    target, _ = small_vocab_dirs
    prompt = [3, 7, 1, 12, 5, 9]
    exact = _exact_marginals(target, prompt, 1.0)
    llm = LLM(
        model=target,
        backend="xla",
        speculative_config=_draft(target, 2),
        num_kv_blocks=600,
        block_size=4,
        max_num_seqs=64,
        max_num_batched_tokens=256,
        enforce_eager=True,  # compile only the buckets this run uses
    )
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=1000, seed=1234)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    toks = np.array([c.token_ids for c in out.outputs])
    st = llm.llm_engine.get_stats()
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens  # both branches ran
    assert_follows_target(toks, exact, target, prompt)


def test_draft_vocab_larger_than_target_fails(tiny_model_dir, small_vocab_dirs) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="vocab"):
        LLM(
            model=small_vocab_dirs[0],
            backend="xla",
            speculative_config=_draft(tiny_model_dir("llama")),
            num_kv_blocks=16,
        )
