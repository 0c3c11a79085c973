"""`LLM(..., engine_process=True)`: the engine core in a child process, the output processor
here; the same outputs as in-process for greedy, n > 1, logprobs, stop strings, priorities,
speculative decoding (n-gram) and prefix caching, with the core's counters reaching get_stats."""

from __future__ import annotations

import os

import psutil
import pytest

from xlaserve import LLM, SamplingParams

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],
    [20, 21, 22, 23, 20, 21, 22],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 40, 41, 42],
    [100, 37, 250, 12, 99],
]
ENGINE = dict(num_kv_blocks=96, block_size=4, max_num_batched_tokens=64, backend="torch")
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


def _flat(outs) -> list:  # noqa: ANN001
    rows = []
    for o in outs:
        for c in o.outputs:
            lps = None
            if c.logprobs is not None:
                lps = [sorted((t, round(p.logprob, 4), p.rank) for t, p in pos.items())
                       for pos in c.logprobs]  # fmt: skip
            rows.append((o.request_id, c.index, c.token_ids, c.text, c.finish_reason,
                         c.stop_reason, lps))  # fmt: skip
    return rows


def _run(llm: LLM) -> tuple[list, object]:
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    text = outs[0].outputs[0].text
    stop = text[len(text) // 2 :][:2] or "x"
    mixed = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2, seed=1),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=7, n=2),
    ]
    outs2 = llm.generate(PROMPTS, mixed, use_tqdm=False, priority=[0, 1, 2, 3])
    return _flat(outs) + _flat(outs2), llm.llm_engine.get_stats()


@pytest.mark.parametrize("spec", [None, SPEC], ids=["plain", "ngram"])
def test_engine_process_matches_in_process(tiny_model_dir, spec) -> None:  # noqa: ANN001
    kw = dict(ENGINE, speculative_config=spec) if spec else ENGINE
    ref = LLM(model=tiny_model_dir("llama"), **kw)
    want, want_st = _run(ref)
    ref.llm_engine.shutdown()
    llm = LLM(model=tiny_model_dir("llama"), engine_process=True, **kw)
    try:
        core = psutil.Process(llm.llm_engine.core.pid)
        assert core.ppid() == os.getpid()
        got, st = _run(llm)
        assert got == want
        assert any(r[4] == "stop" and isinstance(r[5], str) for r in got)  # a stop string hit
        # The core's counters cross the process boundary.
        # The core may run a few steps past a stop string before the front's abort lands (up
        # to 1 + 3 drafts tokens a step with n-gram drafts); never fewer tokens than in-process.
        extra = st.generation_tokens_total - want_st.generation_tokens_total
        assert 0 <= extra <= 16, extra
        assert st.prompt_tokens_total == want_st.prompt_tokens_total
        assert st.prefix_cache_hits == want_st.prefix_cache_hits
        assert st.num_free_blocks == st.num_total_blocks
        if spec:  # the steps past a stop string may verify drafts too
            assert st.spec_num_draft_tokens >= want_st.spec_num_draft_tokens > 0
            assert st.spec_num_accepted_tokens >= want_st.spec_num_accepted_tokens > 0
            assert st.spec_num_accepted_tokens <= st.spec_num_draft_tokens
    finally:
        llm.llm_engine.shutdown()
    assert not core.is_running() or core.status() == psutil.STATUS_ZOMBIE


def test_wait_compiled_round_trip_keeps_outputs_in_flight(tiny_model_dir) -> None:  # noqa: ANN001
    """`wait_compiled` through the core process (the benchmarks' steady-state barrier) answers
    while requests run, and the outputs that arrive meanwhile reach the next steps intact."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(model=tiny_model_dir("llama"), engine_process=True, **ENGINE)
    eng = llm.llm_engine
    try:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"w{i}", {"prompt_token_ids": p}, greedy)
        got: dict[str, list[int]] = {}
        eng.step()
        eng.wait_compiled(timeout=60)
        eng.wait_compiled(timeout=60)  # answers again (each call waits for its own answer)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    got[out.request_id] = out.outputs[0].token_ids
        assert [got[f"w{i}"] for i in range(len(PROMPTS))] == want
    finally:
        eng.shutdown()


def test_engine_process_constrained_batch_one_ack_wait(tiny_model_dir) -> None:  # noqa: ANN001
    """Constrained requests through the core process: the batch's adds are acked in one wait
    (not one round trip each), the outputs equal in-process ones; a batch holding one invalid
    schema raises its ValueError with nothing left running, and the engine goes on."""
    from xlaserve.engine.core_client import MPLLMEngine
    from xlaserve.sampling_params import StructuredOutputsParams as SO

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cons = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=SO(json=schema))
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    params = [cons, plain, cons, cons]
    kw = dict(ENGINE, compile_workers=0)
    ref = LLM(model=tiny_model_dir("llama"), **kw)
    want = _flat(ref.generate(PROMPTS, params, use_tqdm=False))
    ref.llm_engine.shutdown()
    llm = LLM(model=tiny_model_dir("llama"), engine_process=True, **kw)
    eng = llm.llm_engine
    assert isinstance(eng, MPLLMEngine)
    waits: list[list[str]] = []
    check = eng._check_acks
    eng._check_acks = lambda ids: (waits.append(list(ids)), check(ids))[1]
    try:
        assert _flat(llm.generate(PROMPTS, params, use_tqdm=False)) == want
        assert [len(w) for w in waits] == [3]  # the three constrained adds, one wait
        bad = SamplingParams(max_tokens=4, structured_outputs=SO(json='{"type": "object"'))
        with pytest.raises(ValueError, match="not valid JSON"):
            llm.generate(PROMPTS, [cons, bad, plain, cons], use_tqdm=False)
        assert not eng.has_unfinished_requests()
        again = _flat(llm.generate(PROMPTS, params, use_tqdm=False))
        assert [r[1:] for r in again] == [r[1:] for r in want]  # (new request ids)
        st = eng.get_stats()
        assert st.num_running == 0 and st.num_free_blocks == st.num_total_blocks
    finally:
        eng.shutdown()
