"""End to end through LLM -> engine -> scheduler -> backend, against transformers.

Parity: greedy tokens equal transformers' for a mixed-length batch on tiny random
Llama/Mistral/Qwen2/Qwen3, also under preemption (tiny KV cache), prefix caching on/off and
chunked prefill (small token budget). Then sampling semantics through the whole engine.
"""

from __future__ import annotations

import os

import pytest
from tiny_models import hf_greedy, hf_logprobs

from xlaserve import LLM, SamplingParams

BACKENDS = [os.environ.get("XLASERVE_TEST_BACKEND", "torch")]

PROMPTS = [
    [5, 6, 7, 8, 9, 10],
    [40, 41, 42],
    list(range(100, 137)),  # spans several blocks
    [7] * 20 + [8, 9],
    [200],
]
MAX_NEW = 10

_HF_CACHE: dict[str, list[list[int]]] = {}


def _hf(path: str) -> list[list[int]]:
    if path not in _HF_CACHE:
        _HF_CACHE[path] = hf_greedy(path, PROMPTS, MAX_NEW)
    return _HF_CACHE[path]


def _greedy(llm: LLM, prompts: list[list[int]] = PROMPTS, n: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "llama3"])
def test_greedy_matches_transformers(tiny_model_dir, kind: str, backend: str) -> None:
    path = tiny_model_dir(kind)
    llm = LLM(path, backend=backend, dtype="float32", block_size=4, num_kv_blocks=128)
    assert _greedy(llm) == _hf(path)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kwargs",
    [
        # 14 blocks of 4 tokens: the batch cannot all fit -> preemption by recompute
        dict(num_kv_blocks=14, max_num_batched_tokens=64, max_model_len=56),
        dict(
            num_kv_blocks=14,
            max_num_batched_tokens=64,
            max_model_len=56,
            enable_prefix_caching=False,
        ),
        # token budget 8 -> prompts are prefilled in chunks
        dict(num_kv_blocks=128, max_num_batched_tokens=8),
        dict(
            num_kv_blocks=128, max_num_batched_tokens=8, enable_prefix_caching=False, max_num_seqs=2
        ),
    ],
    ids=["preempt", "preempt-nocache", "chunked", "chunked-nocache-2seqs"],
)
def test_greedy_under_pressure(tiny_model_dir, kwargs: dict, backend: str) -> None:
    path = tiny_model_dir("llama")
    llm = LLM(path, backend=backend, dtype="float32", block_size=4, **kwargs)
    assert _greedy(llm) == _hf(path)
    stats = llm.llm_engine.get_stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_running == 0 and stats.num_waiting == 0
    if kwargs["num_kv_blocks"] == 14:
        assert stats.num_preemptions_total > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_cache_hits_keep_outputs(tiny_model_dir, backend: str) -> None:
    path = tiny_model_dir("llama")
    llm = LLM(path, backend=backend, dtype="float32", block_size=4, num_kv_blocks=128)
    shared = list(range(100, 137))
    first = _greedy(llm, [shared])
    again = llm.generate(
        [{"prompt_token_ids": shared}],
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
        use_tqdm=False,
    )
    assert again[0].outputs[0].token_ids == first[0]
    assert again[0].num_cached_tokens == 36  # 9 full blocks of 4; the last token is recomputed
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits >= 36


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_close_to_transformers(tiny_model_dir, backend: str) -> None:
    path = tiny_model_dir("qwen2")
    llm = LLM(path, backend=backend, dtype="float32", block_size=4, num_kv_blocks=64)
    p = PROMPTS[0]
    out = llm.generate(
        [{"prompt_token_ids": p}],
        SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True),
        use_tqdm=False,
    )[0]
    toks = out.outputs[0].token_ids
    ref = hf_logprobs(path, p, toks)
    got = [out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(toks)]
    assert got == pytest.approx(ref, abs=1e-4)
    for pos in out.outputs[0].logprobs:
        assert len(pos) >= 3
        assert max(lp.logprob for lp in pos.values()) == pytest.approx(
            next(lp.logprob for lp in pos.values() if lp.rank == 1)
        )
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(ref), abs=1e-3)
    # prompt logprobs: None for the first token, then log P(p[i] | p[:i])
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    ref_prompt = hf_logprobs(path, p[:1], p[1:])
    got_prompt = [out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
    assert got_prompt == pytest.approx(ref_prompt, abs=1e-4)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(
        tiny_model_dir("llama"),
        backend=BACKENDS[0],
        dtype="float32",
        block_size=4,
        num_kv_blocks=256,
    )


def test_seeded_sampling_reproducible(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    a = llm.generate(
        prompts,
        SamplingParams(temperature=1.0, seed=123, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    b = llm.generate(
        prompts,
        SamplingParams(temperature=1.0, seed=123, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    c = llm.generate(
        prompts,
        SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    ta = [o.outputs[0].token_ids for o in a]
    assert ta == [o.outputs[0].token_ids for o in b]
    assert ta != [o.outputs[0].token_ids for o in c]


def test_n_outputs(llm: LLM) -> None:
    out = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}],
        SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # different seeds per sample


def test_detokenize_false_gives_token_ids_only(llm: LLM) -> None:
    """SamplingParams(detokenize=False) (vLLM's flag): the same tokens, finish reasons and
    logprobs, no text; stop strings (which need the text) are refused up front."""
    kw = dict(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    want = llm.generate(["And God said"], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]
    got = llm.generate(["And God said"], SamplingParams(**kw, detokenize=False), use_tqdm=False)[
        0
    ].outputs[0]
    assert want.text and got.text == ""
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert [sorted(p) for p in got.logprobs] == [sorted(p) for p in want.logprobs]
    with pytest.raises(ValueError, match="detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)


def test_finish_reasons_and_stop_strings(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    base = llm.generate(
        ["And God said"],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )[0]
    o = base.outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 12
    assert o.text == tok.decode(o.token_ids)
    # Stop on a substring of the greedy text: output is the text before it, reason "stop".
    full = o.text
    cut = next(i for i in range(2, len(full)) if full[i] != " " and full[:i].strip())
    stop = full[cut : cut + 2]
    first = full.find(stop)
    out = llm.generate(
        ["And God said"],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:first]
    # stop token id
    sid = o.token_ids[3]
    out = llm.generate(
        ["And God said"],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[sid]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == sid
    assert out.token_ids == o.token_ids[: o.token_ids.index(sid) + 1]


def test_stop_string_precedence_is_earliest_in_text(llm: LLM) -> None:
    """Stop strings s_long = text[i:j] and s_short = text[i+1:j] end at the same character, so
    one token completes both: s_long (which starts earlier) wins in either list order."""
    params = dict(temperature=0, max_tokens=16, ignore_eos=True)
    full = llm.generate(["And God said"], SamplingParams(**params), use_tqdm=False)[0]
    text = full.outputs[0].text
    i, j = next(
        (i, i + 4)
        for i in range(1, len(text) - 4)
        if text.find(text[i + 1 : i + 4]) == i + 1
        and all(c.isascii() and c.isprintable() for c in text[i : i + 4])
    )
    s_long, s_short = text[i:j], text[i + 1 : j]
    for stop in ([s_short, s_long], [s_long, s_short]):
        out = llm.generate(["And God said"], SamplingParams(**params, stop=stop), use_tqdm=False)[
            0
        ].outputs[0]
        assert (out.finish_reason, out.stop_reason, out.text) == ("stop", s_long, text[:i]), stop


def test_eos_and_min_tokens(llm: LLM) -> None:
    # Bias EOS (id 0) to be certain: stops at once, unless min_tokens holds it back.
    bias = {0: 100.0}
    out = llm.generate(
        ["In the"], SamplingParams(temperature=0, max_tokens=10, logit_bias=bias), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == [0] and out.finish_reason == "stop" and out.text == ""
    out = llm.generate(
        ["In the"],
        SamplingParams(temperature=0, max_tokens=10, logit_bias=bias, min_tokens=4),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == 0 and 0 not in out.token_ids[:4]


def test_bad_requests_raise_clearly(llm: LLM) -> None:
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate(
            [{"prompt_token_ids": [1] * 250}], SamplingParams(max_tokens=10), use_tqdm=False
        )
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([{"prompt_token_ids": [10**6]}], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    # the engine still works afterwards, with nothing left allocated
    assert (
        llm.generate(["In"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    )
    assert llm.llm_engine.get_stats().kv_cache_usage == 0.0


def test_chat_uses_template(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "Who made the light?"}],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.chat_prompt_ids(
        [{"role": "user", "content": "Who made the light?"}]
    )
    assert len(out.outputs[0].token_ids) == 4


def test_unknown_architecture_and_missing_files(tmp_path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NopeForCausalLM"]}))
    with pytest.raises(
        ValueError,
        match="unsupported architecture 'NopeForCausalLM'; supported: .*LlamaForCausalLM",
    ):
        LLM(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="offline"):
        LLM("some-org/some-model")
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(str(tmp_path), no_such_flag=1)


def test_dummy_weights(tiny_model_dir) -> None:
    llm = LLM(tiny_model_dir("llama"), load_format="dummy", dtype="float32", num_kv_blocks=32)
    got = _greedy(llm, PROMPTS[:2], 6)
    assert [len(t) for t in got] == [6, 6]
    # random weights of the right shapes, not the checkpoint's
    assert got != [t[:6] for t in _hf(tiny_model_dir("llama"))[:2]]
