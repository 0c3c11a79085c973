"""Completions echo shaped as OpenAI's (scoring clients such as lm-eval), checked against
transformers, and vLLM's extras: prompt_logprobs, return_tokens_as_token_ids,
continuous_usage_stats, /tokenize return_token_strs."""

from __future__ import annotations

import json

import openai
import pytest
from ep_helpers import MODEL_NAME, Server, http
from tiny_models import hf_logprobs

PROMPT = "And God said, Let there be light: and there was light."


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _ids(server: Server, text: str) -> list[int]:
    return json.loads(http("POST", server.base_url + "/tokenize", {"prompt": text})[2])["tokens"]


def _offsets_ok(lp) -> None:  # noqa: ANN001
    off = 0
    for tok, o in zip(lp.tokens, lp.text_offset, strict=True):
        assert o == off
        off += len(tok)


def test_lm_eval_scoring_request(client: openai.OpenAI, server: Server, model_path: str) -> None:
    """echo=true, logprobs=1, max_tokens=0: the prompt's log-probabilities, nothing generated."""
    r = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    ch = r.choices[0]
    assert ch.text == PROMPT and ch.finish_reason == "length"
    assert r.usage.completion_tokens == 0
    ids = _ids(server, PROMPT)
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) and None not in lp.tokens
    assert "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    _offsets_ok(lp)
    want = hf_logprobs(model_path, ids[:1], ids[1:])
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-4)
    # top_logprobs (k=1) hold the best token, at least as likely as the prompt's own
    for top, got in zip(lp.top_logprobs[1:], lp.token_logprobs[1:], strict=True):
        assert max(top.values()) >= got - 1e-6


def test_max_tokens_zero_needs_echo(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="echo") as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_echo_stream_offsets_accumulate(client: openai.OpenAI) -> None:
    kw = dict(
        model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=2, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    whole = client.completions.create(**kw).choices[0]
    _offsets_ok(whole.logprobs)
    text, tokens, offsets, lps = "", [], [], []
    for chunk in client.completions.create(**kw, stream=True):
        c = chunk.choices[0]
        text += c.text
        if c.logprobs:
            tokens += c.logprobs.tokens
            offsets += c.logprobs.text_offset
            lps += c.logprobs.token_logprobs
    assert text == whole.text
    assert tokens == whole.logprobs.tokens
    assert offsets == whole.logprobs.text_offset
    assert lps[0] is None and lps[1:] == pytest.approx(whole.logprobs.token_logprobs[1:])
    # echo-only streamed: one chunk with the prompt, then nothing generated
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert chunks[-1].choices[0].finish_reason == "length"


def test_prompt_logprobs_and_token_ids(client: openai.OpenAI, server: Server) -> None:
    ids = _ids(server, PROMPT)
    r = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=0,
        extra_body={"prompt_logprobs": 1, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    ch = r.choices[0].model_dump()
    plp = ch["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, pos in zip(ids[1:], plp[1:], strict=True):
        assert str(tid) in pos and pos[str(tid)]["logprob"] <= 0
        assert any(v["rank"] == 1 for v in pos.values())
    toks = r.choices[0].logprobs.tokens
    assert len(toks) == 2 and all(t.startswith("token_id:") for t in toks)
    # echo logprobs equal the prompt_logprobs of the same positions
    e = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1
    ).choices[0]
    for got, pos, tid in zip(e.logprobs.token_logprobs[1:], plp[1:], ids[1:], strict=True):
        assert got == pytest.approx(pos[str(tid)]["logprob"], abs=1e-5)
    # chat: prompt_logprobs at the response level
    c = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    plp = c.model_dump()["prompt_logprobs"]
    assert plp[0] is None and len(plp) == c.usage.prompt_tokens


def test_continuous_usage_stats(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts and counts == sorted(counts) and counts[-1] == 4
    assert all(c.usage is not None for c in chunks)
    chat = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
            stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert chat[-1].usage.completion_tokens == 3
    assert all(c.usage is not None for c in chat if c.choices and c.choices[0].finish_reason)


def test_tokenize_token_strs(server: Server) -> None:
    status, _, body = http(
        "POST", server.base_url + "/tokenize", {"prompt": PROMPT, "return_token_strs": True}
    )
    out = json.loads(body)
    assert status == 200 and len(out["token_strs"]) == out["count"]
    assert all(isinstance(s, str) for s in out["token_strs"])
