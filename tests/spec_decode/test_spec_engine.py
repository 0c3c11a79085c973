"""Speculative decoding end to end through LLM (torch backend, CPU): greedy outputs equal the
non-speculative ones (n-gram, draft model), drafts are really accepted, mixed batches, prefix
caching, preemption, logprobs, metrics; sampled outputs keep the target distribution."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_spec_rejection_sampler import chi_square_pvalue

from xlaserve import LLM, SamplingParams
from xlaserve.demo import DEMO_DRAFT_DIR, DEMO_MODEL_DIR

# Prompts with repetition (n-gram lookup finds matches) and one without.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],
    [20, 21, 22, 23, 20, 21, 22],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 40, 41, 42],
    [100, 37, 250, 12, 99],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ENGINE = dict(num_kv_blocks=96, block_size=4, max_num_batched_tokens=64)


def _ids(outs) -> list[list[int]]:  # noqa: ANN001
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict:  # noqa: ANN001
    llm = LLM(model=tiny_model_dir("llama"), **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    lp = llm.generate(PROMPTS[:2], _with(GREEDY, logprobs=2), use_tqdm=False)
    return {"greedy": _ids(outs), "logprobs": lp}


def _with(p: SamplingParams, **kw) -> SamplingParams:
    q = p.clone()
    for k, v in kw.items():
        setattr(q, k, v)
    return q


def test_ngram_greedy_equals_plain_and_accepts_drafts(tiny_model_dir, reference) -> None:
    llm = LLM(
        model=tiny_model_dir("llama"),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        **ENGINE,
    )
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _ids(outs) == reference["greedy"]
    st = llm.llm_engine.get_stats()
    assert st.spec_num_draft_tokens > 0 and 0 < st.spec_num_accepted_tokens
    assert st.spec_num_accepted_tokens <= st.spec_num_draft_tokens
    assert st.spec_num_drafts > 0
    # Per-request metrics add up to the engine totals; the repetitive prompt got drafts accepted.
    assert sum(o.metrics.spec_num_draft_tokens for o in outs) == st.spec_num_draft_tokens
    assert sum(o.metrics.spec_num_accepted_tokens for o in outs) == st.spec_num_accepted_tokens
    assert outs[0].metrics.spec_num_accepted_tokens > 0
    # Fewer steps than tokens: several tokens per step for some requests.
    assert st.generation_tokens_total == 24 * len(PROMPTS)

    # Logprobs: one entry per returned token, equal to the plain run's.
    lp = llm.generate(PROMPTS[:2], _with(GREEDY, logprobs=2), use_tqdm=False)
    for got, ref in zip(lp, reference["logprobs"], strict=True):
        g, r = got.outputs[0], ref.outputs[0]
        assert g.token_ids == r.token_ids and len(g.logprobs) == len(g.token_ids)
        for gp, rp in zip(g.logprobs, r.logprobs, strict=True):
            assert gp.keys() == rp.keys()
            for t in gp:
                assert gp[t].logprob == pytest.approx(rp[t].logprob, abs=1e-4)

    # Stop token inside an accepted run of drafts: output ends exactly there.
    ref0 = reference["greedy"][0]
    stop_at = next(i for i in range(3, 24) if ref0[i] not in ref0[:i])
    out = llm.generate([PROMPTS[0]], _with(GREEDY, stop_token_ids=[ref0[stop_at]]), use_tqdm=False)[
        0
    ]
    assert out.outputs[0].token_ids == ref0[: stop_at + 1]
    assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("self_draft", [False, True])
def test_draft_model_greedy_equals_plain(
    tiny_model_dir, draft_model_dir, reference, self_draft: bool
) -> None:
    target = tiny_model_dir("llama")
    llm = LLM(
        model=target,
        speculative_config={
            "method": "draft_model",
            "model": target if self_draft else draft_model_dir,
            "num_speculative_tokens": 3,
        },
        **ENGINE,
    )
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _ids(outs) == reference["greedy"]
    st = llm.llm_engine.get_stats()
    assert st.spec_num_draft_tokens > 0
    if self_draft:
        # The target as its own draft: every draft is the target's argmax (its KV is right).
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens
    # Max tokens is never exceeded even with drafts in flight.
    assert all(len(t) == 24 for t in _ids(outs))


def test_prefix_cache_rerun_and_preemption_with_drafts(tiny_model_dir, reference) -> None:
    target = tiny_model_dir("llama")
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    llm = LLM(model=target, speculative_config=spec, **ENGINE)
    first = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    before = llm.llm_engine.get_stats()
    second = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    after = llm.llm_engine.get_stats()
    assert first == second == reference["greedy"]
    assert after.prefix_cache_hits > before.prefix_cache_hits
    # The draft's KV in the shared blocks is right too: every draft still accepted.
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert drafted > 0
    assert after.spec_num_accepted_tokens - before.spec_num_accepted_tokens == drafted

    # Few blocks: requests get preempted (recompute) while they have drafts in flight.
    for cfg in (spec, {"method": "ngram", "num_speculative_tokens": 4}):
        small = LLM(
            model=target,
            speculative_config=cfg,
            num_kv_blocks=16,
            block_size=4,
            max_model_len=64,
            max_num_batched_tokens=64,
        )
        outs = _ids(small.generate(PROMPTS, GREEDY, use_tqdm=False))
        st = small.llm_engine.get_stats()
        assert st.num_preemptions_total > 0 and st.spec_num_accepted_tokens > 0
        assert outs == reference["greedy"]


def test_mixed_batch_greedy_and_sampled(tiny_model_dir, reference) -> None:
    """Greedy requests that speculate next to seeded sampled ones: greedy outputs are exact;
    a sampled request that never got drafts gives exactly its plain seeded output."""
    target = tiny_model_dir("llama")
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    plain = LLM(model=target, **ENGINE)
    ref_sampled = _ids(plain.generate([PROMPTS[3]], sampled, use_tqdm=False))[0]
    llm = LLM(
        model=target,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 3},
        **ENGINE,
    )
    # Nearly greedy but on the sampling path: follows the repetitive greedy text, gets drafts.
    cold = _with(sampled, seed=9, temperature=0.05)
    params = [GREEDY, GREEDY, cold, sampled]
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[3]], params, use_tqdm=False)
    assert _ids(outs)[:2] == reference["greedy"][:2]
    assert outs[0].metrics.spec_num_accepted_tokens > 0
    assert outs[2].metrics.spec_num_draft_tokens > 0  # a sampled request that speculated
    assert len(outs[2].outputs[0].token_ids) == 12
    assert outs[3].metrics.spec_num_draft_tokens == 0
    assert outs[3].outputs[0].token_ids == ref_sampled
    # Seeded + speculative is reproducible run to run.
    again = llm.generate([PROMPTS[0]], cold, use_tqdm=False)
    assert again[0].outputs[0].token_ids == outs[2].outputs[0].token_ids


def _exact_marginals(model_dir: str, prompt: list[int], temperature: float) -> list[np.ndarray]:
    """Exact marginals of output tokens 2 and 3 under the target (transformers, float64)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(prefixes).logits[:, -1].double()
        return torch.softmax(logits / temperature, -1)

    base = torch.tensor([prompt])
    v = model.config.vocab_size
    p1 = next_probs(base)[0]  # [V]
    pre2 = torch.cat([base.repeat(v, 1), torch.arange(v)[:, None]], 1)
    p2 = next_probs(pre2)  # [V(t1), V(t2)]
    joint12 = p1[:, None] * p2
    pre3 = torch.cat([pre2.repeat_interleave(v, 0), torch.arange(v).repeat(v)[:, None]], 1)
    p3 = next_probs(pre3).reshape(v, v, v)
    m3 = (joint12[:, :, None] * p3).sum((0, 1))
    return [joint12.sum(0).numpy(), m3.numpy()]


def assert_follows_target(
    toks: np.ndarray, exact: list[np.ndarray], target: str, prompt: list[int], power: bool = True
) -> None:
    """Sampled outputs `toks` [N, 3] at temperature 1: output tokens 2 and 3 pass a chi-square test
    against the exact marginals `exact` (p > 1e-3); with `power`, the same token-2 samples fail
    against the marginals at temperature 0.6 (p < 1e-4), so the test can tell distributions apart."""
    for pos, probs in ((1, exact[0]), (2, exact[1])):
        pv = chi_square_pvalue(np.bincount(toks[:, pos], minlength=len(probs)), probs)
        assert pv > 1e-3, (pos, pv)
    if power:
        other = _exact_marginals(target, prompt, 0.6)[0]
        assert chi_square_pvalue(np.bincount(toks[:, 1], minlength=len(other)), other) < 1e-4


def test_sampled_speculation_keeps_the_distribution(small_vocab_dirs) -> None:
    """Chi-square of output tokens 2 and 3 (both verified against drafts) over 1500 seeded
    samples vs the exact marginals; the test rejects a visibly different distribution."""
    target, draft = small_vocab_dirs
    prompt = [3, 7, 1, 12, 5, 9]
    temperature = 1.0
    exact = _exact_marginals(target, prompt, temperature)
    for method in ("draft_model", "ngram"):
        cfg = {"method": method, "num_speculative_tokens": 2}
        if method == "draft_model":
            cfg["model"] = target  # greedy self-draft: often right, often wrong
        else:
            cfg.update(prompt_lookup_min=1, prompt_lookup_max=2)
        llm = LLM(
            model=target,
            speculative_config=cfg,
            num_kv_blocks=1200,
            block_size=4,
            max_num_seqs=256,
            max_num_batched_tokens=2048,
        )
        n = 1500 if method == "draft_model" else 1000
        params = SamplingParams(
            temperature=temperature, max_tokens=3, ignore_eos=True, n=n, seed=1234
        )
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        toks = np.array([c.token_ids for c in out.outputs])
        st = llm.llm_engine.get_stats()
        if method == "draft_model":  # both branches ran (accepted and rejected drafts)
            assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
        else:  # n-gram drafts here (t1 repeats a prompt token) are mostly rejected
            assert st.spec_num_draft_tokens > 10
        # Power (the samples fail against another temperature) checked once, with the draft model.
        assert_follows_target(toks, exact, target, prompt, power=method == "draft_model")


@pytest.mark.skipif(
    not os.path.isfile(os.path.join(DEMO_DRAFT_DIR, "config.json")),
    reason="the demo model's draft (src/xlaserve/assets/demo-kjv-draft) is not built",
)
def test_demo_model_with_its_draft() -> None:
    prompts = [
        "And God said, Let there be light: and there was light. And God said, Let there be",
        "And it came to pass, when",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ref = _ids(
        LLM(model=DEMO_MODEL_DIR, num_kv_blocks=256).generate(prompts, params, use_tqdm=False)
    )
    for spec in (
        {"method": "draft_model", "model": DEMO_DRAFT_DIR, "num_speculative_tokens": 3},
        {"method": "ngram", "num_speculative_tokens": 3},
    ):
        llm = LLM(model=DEMO_MODEL_DIR, num_kv_blocks=256, speculative_config=spec)
        assert _ids(llm.generate(prompts, params, use_tqdm=False)) == ref, spec["method"]
        st = llm.llm_engine.get_stats()
        # A trained draft agrees with its target often (n-gram: on the repeated verse).
        assert st.spec_num_accepted_tokens >= 0.2 * st.spec_num_draft_tokens > 0, spec["method"]


def test_eagle_fails_clearly(tiny_model_dir) -> None:
    # A plain model is no EAGLE head (EAGLE itself: test_eagle.py).
    with pytest.raises(ValueError, match="not an EAGLE head"):
        LLM(
            model=tiny_model_dir("llama"),
            speculative_config={"method": "eagle", "model": tiny_model_dir("llama")},
            **ENGINE,
        )


def test_metrics_expose_acceptance(tiny_model_dir) -> None:
    from prometheus_client import generate_latest

    from xlaserve.metrics import ServerMetrics

    llm = LLM(
        model=tiny_model_dir("llama"),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        **ENGINE,
    )
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    st = llm.llm_engine.get_stats()
    m = ServerMetrics(lambda: st, "tiny")
    text = generate_latest(m.registry).decode()
    vals = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("xlaserve:spec_decode")
    }
    assert vals["xlaserve:spec_decode_num_draft_tokens_total"] == st.spec_num_draft_tokens
    assert vals["xlaserve:spec_decode_num_accepted_tokens_total"] == st.spec_num_accepted_tokens
    assert vals["xlaserve:spec_decode_num_drafts_total"] == st.spec_num_drafts
    assert vals["xlaserve:spec_decode_acceptance_rate"] == pytest.approx(
        st.spec_num_accepted_tokens / st.spec_num_draft_tokens
    )
    assert vals["xlaserve:spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + st.spec_num_accepted_tokens / st.spec_num_drafts
    )


def test_structured_output_with_drafts(tiny_model_dir) -> None:
    """Grammar bitmask rows apply per verified position: constrained greedy output with drafts
    (self-draft: unconstrained proposals that the grammar often rejects) equals the plain one."""
    import re

    from xlaserve.sampling_params import StructuredOutputsParams as SO

    target = tiny_model_dir("llama")
    regex = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(regex=regex)),
        SamplingParams(
            temperature=0.0, max_tokens=40, structured_outputs=SO(choice=["light", "darkness"])
        ),
        GREEDY,
    ]
    prompts = ["In the beginning", "And God said", PROMPTS[0]]
    ref = LLM(model=target, **ENGINE).generate(prompts, params, use_tqdm=False)
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    llm = LLM(model=target, speculative_config=spec, **ENGINE)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _ids(outs) == _ids(ref)
    assert re.fullmatch(regex, outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in ("light", "darkness")
    assert sum(o.metrics.spec_num_draft_tokens for o in outs[:2]) > 0
