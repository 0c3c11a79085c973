"""SamplingParams' vLLM fields through the whole engine, on both backends: bad_words,
allowed_token_ids, logits_processors (torch; a clear error on XLA), truncate_prompt_tokens,
output_kind and max_logprobs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from optional_deps import backend_available

from xlaserve import LLM, RequestOutputKind, SamplingParams

BACKENDS = [b for b in ("torch", "xla") if backend_available(b)]
ARGS = dict(dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
            num_kv_blocks=128, max_logprobs=3)  # fmt: skip
PROMPT = "the cat sat on the"
N = 8


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request: pytest.FixtureRequest, tiny_model_dir, tmp_path_factory) -> Iterator[LLM]:  # noqa: ANN001
    cache = str(tmp_path_factory.mktemp("jax-constraints-cache"))
    engine = LLM(
        tiny_model_dir("llama"), backend=request.param, compilation_cache_dir=cache, **ARGS
    )
    yield engine
    engine.llm_engine.shutdown()


def _tokens(llm: LLM, prompt: object = PROMPT, **kw: object) -> list[int]:
    params = SamplingParams(max_tokens=N, ignore_eos=True, **{"temperature": 0.0, **kw})
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_allowed_token_ids_limit_sampling(llm: LLM) -> None:
    allowed = [11, 17, 23]
    for seed in range(3):
        got = _tokens(llm, temperature=1.0, seed=seed, allowed_token_ids=allowed)
        assert len(got) == N and set(got) <= set(allowed), got


def test_bad_words_are_never_generated(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    greedy = _tokens(llm)
    # A word the greedy output contains as tokens: one of its (with/without space) spellings.
    word, seqs = None, []
    for i in range(len(greedy) - 1):
        for j in (i + 1, i + 2):
            w = tok.decode(greedy[i:j]).strip()
            cand = [tok.encode(p + w, add_special_tokens=False) for p in ("", " ")] if w else []
            if any(c and _contains(greedy, c) for c in cand):
                word, seqs = w, [c for c in cand if c]
                break
        if word:
            break
    assert word, f"no word of the greedy output re-tokenizes to its tokens: {greedy}"
    got = _tokens(llm, bad_words=[word])
    assert got != greedy
    for s in seqs:
        assert not _contains(got, s), (word, s, got)


def test_logits_processors(llm: LLM) -> None:
    def only_7(output_ids: list[int], logits):  # noqa: ANN001, ANN202
        logits[:] = float("-inf")
        logits[7] = 0.0
        return logits

    seen: list[tuple[int, int]] = []

    def three_args(prompt_ids: list[int], output_ids: list[int], logits):  # noqa: ANN001, ANN202
        seen.append((len(prompt_ids), len(output_ids)))
        return logits

    if llm.llm_engine.backend != "torch":
        with pytest.raises(ValueError, match="torch backend only"):
            _tokens(llm, logits_processors=[only_7])
        return
    assert _tokens(llm, temperature=1.0, seed=1, logits_processors=[only_7]) == [7] * N
    assert _tokens(llm, logits_processors=[three_args]) == _tokens(llm)
    n_prompt = len(llm.get_tokenizer().encode(PROMPT))
    assert seen == [(n_prompt, i) for i in range(N)]


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    ids = list(range(30, 50))
    out = llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0.0, max_tokens=4, truncate_prompt_tokens=5),
        use_tqdm=False,
    )[0]
    assert out.prompt_token_ids == ids[-5:]
    assert out.outputs[0].token_ids == _tokens(llm, {"prompt_token_ids": ids[-5:]})[:4]


def test_output_kind_delta_and_final_only(llm: LLM) -> None:
    engine = llm.llm_engine

    def run(kind: RequestOutputKind) -> list:
        rid = engine.new_request_id()
        params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, output_kind=kind)
        engine.add_request(rid, PROMPT, params)
        outs = []
        for _ in range(200):  # bounded: N tokens take at most a few steps each
            outs += [o for o in engine.step() if o.request_id == rid]
            if not engine.has_unfinished_requests():
                break
        return outs

    full = run(RequestOutputKind.CUMULATIVE)
    delta = run(RequestOutputKind.DELTA)
    final = run(RequestOutputKind.FINAL_ONLY)
    assert len(full) > 1 and len(delta) == len(full)
    whole = full[-1].outputs[0]
    assert "".join(o.outputs[0].text for o in delta) == whole.text
    assert sum((o.outputs[0].token_ids for o in delta), []) == whole.token_ids
    assert [len(o.outputs[0].token_ids) for o in delta] != [
        len(o.outputs[0].token_ids) for o in full
    ]
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].text == whole.text


def test_max_logprobs_and_bad_values(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)[0]
    assert all(len(p) >= 3 for p in out.outputs[0].logprobs)
    with pytest.raises(ValueError, match="--max-logprobs"):
        llm.generate(PROMPT, SamplingParams(max_tokens=2, logprobs=4), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids must be in"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[10**9]), use_tqdm=False)
    for bad in (
        dict(allowed_token_ids=[]),
        dict(bad_words=[""]),
        dict(truncate_prompt_tokens=0),
        dict(logits_processors=[3]),
        dict(output_kind=7),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
