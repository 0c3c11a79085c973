"""LLMEngine.step(final_only=True): only finished requests' outputs, identical to the final
outputs of the default step loop (mixed sampling params, n > 1, stop strings, logprobs)."""

from __future__ import annotations

from xlaserve import LLM, SamplingParams


def _run(llm: LLM, final_only: bool) -> tuple[dict[str, object], int]:
    engine = llm.llm_engine
    params = [
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=5, n=2, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=9, stop=["e"], repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=4, min_tokens=3),
    ]
    prompts = [[5, 6, 7, 8], [40, 41, 42], [7] * 12, [200, 3]]
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    finals: dict[str, object] = {}
    unfinished_seen = 0
    while engine.has_unfinished_requests():
        for out in engine.step(final_only=final_only):
            if out.finished:
                finals[out.request_id] = out
            else:
                unfinished_seen += 1
    return finals, unfinished_seen


def _key(out) -> tuple:  # noqa: ANN001
    return (
        out.prompt_token_ids,
        [
            (o.index, o.text, o.token_ids, o.cumulative_logprob, o.logprobs, o.finish_reason)
            for o in out.outputs
        ],
        out.error,
    )


def test_final_only_outputs_equal_default(tiny_model_dir) -> None:
    llm = LLM(tiny_model_dir("llama"), backend="torch", max_num_seqs=8, seed=0)
    default, n_unfinished = _run(llm, final_only=False)
    final, n_unfinished_final = _run(llm, final_only=True)
    assert n_unfinished > 0 and n_unfinished_final == 0
    assert sorted(default) == sorted(final) == ["r0", "r1", "r2", "r3"]
    for rid in default:
        assert _key(default[rid]) == _key(final[rid])
