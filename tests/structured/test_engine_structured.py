"""Structured output end to end (LLM -> engine -> scheduler -> backend sampler) on a tiny random
Llama: a random model writes garbage, but garbage inside the constraint."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import jsonschema
import pytest

from xlaserve import LLM, SamplingParams
from xlaserve.sampling_params import StructuredOutputsParams as SO

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "pos": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -9, "maximum": 9},
                "ok": {"type": "boolean"},
            },
            "required": ["x", "ok"],
        },
    },
    "required": ["name", "age", "color", "tags", "pos"],
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["light", "darkness", "the deep 🙂"]
EBNF = 'root ::= "[" num ("," num)? ("," num)? "]"\nnum ::= [0-9] | [1-9] [0-9]'
EBNF_RE = r"\[\d{1,2}(,\d{1,2}){0,2}\]"
PROMPTS = ["In the beginning", "And God said", "the waters", "Let there be light"]


def _greedy(max_tokens: int, so: SO | None = None, **kw) -> SamplingParams:  # noqa: ANN003
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so, **kw)


def _check_schema(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def test_mixed_batch(llm: LLM) -> None:
    """Every kind of constraint in one batch next to unconstrained requests, which are
    unchanged (equal to their output when run alone)."""
    plain = [_greedy(12, ignore_eos=True), _greedy(12, ignore_eos=True)]
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    params = [
        _greedy(12, ignore_eos=True),
        _greedy(160, SO(json=SCHEMA)),
        _greedy(40, SO(regex=REGEX)),
        _greedy(30, SO(choice=CHOICES)),
        _greedy(40, SO(grammar=EBNF)),
        _greedy(12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=160, structured_outputs=SO(json=SCHEMA)),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[0].token_ids == alone[0].outputs[0].token_ids
    assert outs[5].token_ids == alone[1].outputs[0].token_ids
    for o in outs[1:5] + outs[6:]:
        assert o.finish_reason == "stop", o  # every grammar here terminates
    _check_schema(outs[1].text)
    _check_schema(outs[6].text)
    assert re.fullmatch(REGEX, outs[2].text), outs[2].text
    assert outs[3].text in CHOICES
    assert re.fullmatch(EBNF_RE, outs[4].text), outs[4].text


def test_schema_as_text_and_json_object_with_n(llm: LLM) -> None:
    schema_text = json.dumps(SCHEMA)
    params = SamplingParams(
        n=2, temperature=1.0, seed=11, max_tokens=160, structured_outputs=SO(json=schema_text)
    )
    (out,) = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    assert len(out.outputs) == 2
    for o in out.outputs:
        assert o.finish_reason == "stop"
        _check_schema(o.text)
    # Any JSON object: sampled, so some samples may run out of tokens inside a string; the
    # ones that stop are objects.
    params = SamplingParams(
        n=4, temperature=1.0, seed=5, max_tokens=120, structured_outputs=SO(json_object=True)
    )
    (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    stopped = [o for o in out.outputs if o.finish_reason == "stop"]
    assert stopped
    for o in out.outputs:
        assert o.text.startswith("{")
    for o in stopped:
        assert isinstance(json.loads(o.text), dict)


def test_grammar_termination_finishes_with_ignore_eos(llm: LLM) -> None:
    """With ignore_eos the scheduler would not stop on EOS; the terminated matcher does."""
    (out,) = llm.generate(
        [PROMPTS[2]], _greedy(30, SO(choice=CHOICES), ignore_eos=True), use_tqdm=False
    )
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.text in CHOICES
    assert o.token_ids[-1] == 0  # the stop token the grammar ended on


def test_chunked_prefill_and_preemption(tiny_model_dir) -> None:
    """Small token budget (prompt chunks: no mask until the chunk that samples) and a tiny KV
    cache (preemption by recompute: the matcher keeps its state)."""
    llm = LLM(
        tiny_model_dir("llama"),
        backend="torch",
        dtype="float32",
        block_size=4,
        num_kv_blocks=50,
        max_model_len=200,
        max_num_batched_tokens=16,
    )
    try:
        long_prompt = " ".join(PROMPTS * 3)
        params = [_greedy(120, SO(json=SCHEMA)) for _ in range(3)] + [_greedy(30, SO(regex=REGEX))]
        outs = llm.generate(
            [long_prompt, PROMPTS[0], PROMPTS[1], long_prompt], params, use_tqdm=False
        )
        assert llm.llm_engine.get_stats().num_preemptions_total > 0
        for o in outs[:3]:
            assert o.outputs[0].finish_reason == "stop"
            _check_schema(o.outputs[0].text)
        assert re.fullmatch(REGEX, outs[3].outputs[0].text)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    ("so", "needle"),
    [
        (SO(json="{oops"), "not valid JSON"),
        (SO(json={"type": "object", "properties": {"a": {"type": "nope"}}}), "nope"),
        (SO(regex="[a-"), "regex"),
        (SO(grammar="root ::= undefined_rule"), "undefined_rule"),
    ],
)
def test_bad_spec_raises_synchronously(llm: LLM, so: SO, needle: str) -> None:
    engine = llm.llm_engine
    before = engine.get_num_unfinished_requests()
    with pytest.raises(ValueError, match=needle):
        engine.add_request("bad", PROMPTS[0], _greedy(8, so))
    assert engine.get_num_unfinished_requests() == before
    assert engine.scheduler.num_waiting == 0


def test_compile_failure_fails_only_that_request(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar that parses but fails in the compiler (injected here: xgrammar has no such
    input we know of) ends its request with finish_reason "error"; the others run on."""
    engine = llm.llm_engine
    engine.add_request("warm", PROMPTS[0], _greedy(2, SO(regex="a")))  # creates the manager
    mgr = engine._structured

    def boom(grammar):  # noqa: ANN001, ANN202
        raise RuntimeError("[12:00:00] /project/cpp/compiler.cc:1: out of grammar budget")

    def boom_in_worker(grammar_json, timeout):  # noqa: ANN001, ANN202
        fut = cf.Future()  # what the compile pool returns for a worker's error
        fut.set_exception(
            RuntimeError("[12:00:00] /project/cpp/compiler.cc:1: out of grammar budget")
        )
        return fut

    monkeypatch.setattr(mgr._compiler, "compile_grammar", boom)
    if mgr._pool is not None:
        monkeypatch.setattr(mgr._pool, "submit", boom_in_worker)
    engine.add_request("doomed", PROMPTS[1], _greedy(8, SO(regex="zz[0-9]+q")))
    engine.add_request("fine", PROMPTS[2], _greedy(5, ignore_eos=True))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["doomed"].outputs[0].finish_reason == "error"
    assert final["doomed"].error == (
        "structured output grammar failed to compile: out of grammar budget"
    )
    assert final["doomed"].outputs[0].token_ids == []
    assert final["fine"].outputs[0].finish_reason == "length"
    assert len(final["fine"].outputs[0].token_ids) == 5
    assert final["warm"].error is None


def test_speculative_ngram_is_lossless_under_grammar(llm: LLM, tiny_model_dir) -> None:
    """n-gram drafts: the bitmask has a row per draft position; greedy outputs equal the
    non-speculative ones and stay valid."""
    extra = {}
    if llm.llm_engine.backend == "xla":  # few shape buckets, as the `llm` fixture
        extra = {"max_num_seqs": 8, "max_num_batched_tokens": 64}
    spec_llm = LLM(
        tiny_model_dir("llama"),
        backend=llm.llm_engine.backend,
        **extra,
        dtype="float32",
        block_size=4,
        num_kv_blocks=256,
        max_model_len=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    try:
        # Repetitive text (prompt and schema keys) gives the n-gram proposer matches.
        prompt = '{"name": "red", "age": 1, "color": "red", "tags": ["red"]}'
        params = [_greedy(120, SO(json=SCHEMA)), _greedy(40, SO(regex=REGEX))]
        want = llm.generate([prompt, prompt], params, use_tqdm=False)
        got = spec_llm.generate([prompt, prompt], params, use_tqdm=False)
        assert spec_llm.llm_engine.get_stats().spec_num_draft_tokens > 0
        for w, g in zip(want, got, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
        _check_schema(got[0].outputs[0].text)
        assert re.fullmatch(REGEX, got[1].outputs[0].text)
    finally:
        spec_llm.llm_engine.shutdown()


COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


def test_mixed_batches_compile_nothing_after_startup(llm: LLM) -> None:
    """Steps mixing constrained and plain rows, at every request bucket, greedy and sampled,
    all-constrained and all-plain: on XLA no step waits for a compile (the bitmask is a fixed
    [B, W] input of the start-up sampler program of each bucket). The only compiles are the
    runner's background sampler specializations (each compiled the first time a bucket meets
    a sampling mode, while the general program serves): every compile event is one of those,
    whatever earlier tests ran on this module's engine. On both backends the constrained
    outputs stay valid and the plain ones are unchanged."""
    is_xla = llm.llm_engine.backend == "xla"
    events: list[str] = []

    def listener(event: str, duration: float, **kwargs: object) -> None:
        if event in COMPILE_EVENTS:
            events.append(event)

    if is_xla:
        import jax

        runner = llm.llm_engine.runner
        runner.join_sample_variants()
        lazy, background = len(runner.lazy_compiles), len(runner.background_compiles)
        jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        plain = _greedy(10, ignore_eos=True)
        alone = llm.generate([PROMPTS[0]], plain, use_tqdm=False)[0].outputs[0].token_ids
        choice = SO(choice=CHOICES)
        sampled = SamplingParams(temperature=0.9, seed=7, max_tokens=30, structured_outputs=choice)
        for size in (1, 2, 3, 5, 8):  # request buckets 1, 2, 4, 8 (max_num_seqs 8)
            for mix in ("alternate", "all", "none"):
                params = [
                    plain
                    if mix == "none" or (mix == "alternate" and i % 2 == 0)
                    else (sampled if i % 3 else _greedy(30, choice))
                    for i in range(size)
                ]
                prompts = [PROMPTS[i % len(PROMPTS)] for i in range(size)]
                outs = llm.generate(prompts, params, use_tqdm=False)
                for p, o in zip(params, outs, strict=True):
                    c = o.outputs[0]
                    if p is plain:
                        if o.prompt == PROMPTS[0]:
                            assert c.token_ids == alone
                    else:
                        assert c.finish_reason == "stop" and c.text in CHOICES, c
        if is_xla:
            runner.join_sample_variants()
    finally:
        if is_xla:
            jax.monitoring.unregister_event_duration_listener(listener)
    if is_xla:
        new_background = runner.background_compiles[background:]
        # A lowering and a backend compile per background specialization, nothing else.
        assert len(events) == 2 * len(new_background), (events, new_background)
    if is_xla:
        assert runner.lazy_compiles[lazy:] == [], "a program was compiled while serving"
