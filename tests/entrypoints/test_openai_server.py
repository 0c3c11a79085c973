"""The OpenAI-compatible server end to end: real aiohttp server, real engine, official client.

Tests taking `served` run against `xlaserve serve` subprocesses, once per backend (torch, xla);
the others against the in-process torch server (`server`)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from ep_helpers import API_KEY, MODEL_NAME, SMALL_BODY_LIMIT, http, metric, wait_until

PROMPTS = ["In the beginning", "And God said", "The quick brown fox", "darkness was upon"]


def client(server, **kw) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw
    )


def greedy(server, prompt, max_tokens: int = 8, **kw):  # noqa: ANN001, ANN201
    return client(server).completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kw,
    )


def _metrics(server) -> str:  # noqa: ANN001
    status, _, body = http("GET", server.base_url + "/metrics")
    assert status == 200
    return body.decode()


def test_completion_stream_matches_non_stream(served) -> None:  # noqa: ANN001
    c = client(served)
    for prompt in PROMPTS[:2]:
        full = greedy(served, prompt, max_tokens=10)
        choice = full.choices[0]
        assert choice.finish_reason == "length"
        assert full.usage.completion_tokens == 10
        n_prompt = json.loads(http("POST", served.base_url + "/tokenize", {"prompt": prompt})[2])[
            "count"
        ]
        assert full.usage.prompt_tokens == n_prompt
        assert full.usage.total_tokens == n_prompt + 10
        chunks = list(
            c.completions.create(
                model=MODEL_NAME,
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == choice.text
        finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
        assert len(chunks) > 2  # really streamed, not one blob


def test_chat_stream_matches_non_stream(served) -> None:  # noqa: ANN001
    c = client(served)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello there"}]},
    ]
    full = c.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8
    tok = json.loads(http("POST", served.base_url + "/tokenize", {"messages": messages})[2])
    assert full.usage.prompt_tokens == tok["count"]
    stream = c.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_completion_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == msg.content
    with_choices = [ch for ch in chunks if ch.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in with_choices[:-1])
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_n_samples_and_multiple_prompts(server) -> None:  # noqa: ANN001
    c = client(server)
    r = c.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    # seeded: same request, same samples
    r2 = c.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert [ch.text for ch in r.choices] == [ch.text for ch in r2.choices]
    r = c.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[:2],
        n=2,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2, 3]
    by_index = {ch.index: ch.text for ch in r.choices}
    assert (
        by_index[0] == by_index[1] == greedy(server, PROMPTS[0], 4).choices[0].text
    )  # greedy: samples agree
    assert by_index[2] == greedy(server, PROMPTS[1], 4).choices[0].text
    chat = c.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4, seed=3
    )
    assert sorted(ch.index for ch in chat.choices) == [0, 1]
    # streamed n=2: each index gets its role chunk and its own finish
    chunks = list(
        c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            n=2,
            max_tokens=4,
            stream=True,
        )
    )
    finished = {ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason}
    roles = {ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role}
    assert finished == roles == {0, 1}


def test_stop_strings(server) -> None:  # noqa: ANN001
    text = greedy(server, PROMPTS[2], 16).choices[0].text
    # a stop string of plain characters from the middle of the greedy text
    start = next(
        i
        for i in range(2, len(text) - 1)
        if text[i : i + 2].isascii() and text[i : i + 2].strip() == text[i : i + 2]
    )
    stop = text[start : start + 2]
    cut = text.index(stop)
    r = greedy(server, PROMPTS[2], 16, stop=[stop])
    assert r.choices[0].text == text[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    r = client(server).completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[2],
        max_tokens=16,
        temperature=0,
        stop=stop,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert r.choices[0].text == text[:cut] + stop
    streamed = client(server).completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[2],
        max_tokens=16,
        temperature=0,
        stop=[stop],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(ch.choices[0].text for ch in streamed) == text[:cut]


def test_logprobs(server) -> None:  # noqa: ANN001
    r = greedy(server, PROMPTS[0], 6, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert tlp <= 0.0
        assert 1 <= len(top) <= 4  # the top 3 + the sampled one, keyed by text (may collide)
        assert max(top.values()) == pytest.approx(tlp)  # greedy: the sampled token is the top one
        assert top[tok] == pytest.approx(tlp)
    assert lp.text_offset == sorted(lp.text_offset)
    chat = client(server).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    for e in content:
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    # streamed chat logprobs: one entry per generated token overall
    chunks = list(
        client(server).chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    )
    streamed = [
        e.logprob
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]
    assert streamed == pytest.approx([e.logprob for e in content])


def test_echo_and_token_id_prompts(server) -> None:  # noqa: ANN001
    ids = json.loads(http("POST", server.base_url + "/tokenize", {"prompt": PROMPTS[1]})[2])[
        "tokens"
    ]
    plain = greedy(server, PROMPTS[1], 5).choices[0].text
    assert greedy(server, ids, 5).choices[0].text == plain
    r = greedy(server, [ids, ids[:2]], 5)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == plain
    assert r.usage.prompt_tokens == len(ids) + 2
    e = greedy(server, PROMPTS[1], 5, echo=True)
    assert e.choices[0].text == PROMPTS[1] + plain
    e = greedy(server, PROMPTS[1], 5, echo=True, logprobs=1)
    lp = e.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 5
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    s = client(server).completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=5,
        temperature=0,
        echo=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(ch.choices[0].text for ch in s) == PROMPTS[1] + plain


def test_models_health_version_tokenize(server) -> None:  # noqa: ANN001
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert http("GET", server.base_url + "/health")[0] == 200
    status, _, body = http("GET", server.base_url + "/version")
    assert status == 200 and json.loads(body)["version"]
    text = "And God saw the light, that it was good."
    status, _, body = http("POST", server.base_url + "/tokenize", {"prompt": text})
    toks = json.loads(body)
    assert status == 200 and toks["count"] == len(toks["tokens"]) > 0
    status, _, body = http("POST", server.base_url + "/detokenize", {"tokens": toks["tokens"]})
    assert status == 200 and json.loads(body)["prompt"] == text


def test_concurrent_streaming_clients(server) -> None:  # noqa: ANN001
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(64)]

    async def one(ac: openai.AsyncOpenAI, p: str, stream: bool) -> str:
        kw = dict(
            model=MODEL_NAME, prompt=p, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        if not stream:
            return (await ac.completions.create(**kw)).choices[0].text
        s = await ac.completions.create(**kw, stream=True)
        return "".join([ch.choices[0].text async for ch in s])

    async def main(stream: bool) -> list[str]:
        ac = openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120
        )
        try:
            return await asyncio.gather(*(one(ac, p, stream) for p in prompts))
        finally:
            await ac.close()

    expected = asyncio.run(main(stream=False))
    got = asyncio.run(main(stream=True))
    assert got == expected
    assert greedy(server, prompts[5], 6).choices[0].text == expected[5]  # batched == alone
    assert wait_until(lambda: metric(_metrics(server), "xlaserve:kv_cache_usage_perc") == 0.0)
    m = _metrics(server)
    assert metric(m, "xlaserve:num_requests_running") == 0
    assert metric(m, "xlaserve:generation_tokens_total") >= 64 * 6 * 2


def test_disconnect_mid_stream_frees_blocks(served) -> None:  # noqa: ANN001
    def aborted() -> float:
        for line in _metrics(served).splitlines():
            if (
                line.startswith("xlaserve:request_success_total{")
                and 'finished_reason="abort"' in line
            ):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = aborted()

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            resps = []
            for i in range(4):
                body = {
                    "model": MODEL_NAME,
                    "prompt": f"{PROMPTS[0]} {i}",
                    "max_tokens": 200,
                    "ignore_eos": True,
                    "stream": True,
                }
                r = await s.post(served.base_url + "/v1/completions", json=body)
                assert r.status == 200
                n = 0
                async for line in r.content:  # read a few events, then hang up
                    if line.startswith(b"data: "):
                        n += 1
                        if n == 3:
                            break
                resps.append(r)
            usage = metric(_metrics(served), "xlaserve:kv_cache_usage_perc")
            assert usage > 0.0  # the 4 requests hold blocks while connected
            for r in resps:
                r.close()

    asyncio.run(main())
    assert wait_until(lambda: aborted() - before == 4, timeout=15)
    assert wait_until(lambda: metric(_metrics(served), "xlaserve:kv_cache_usage_perc") == 0.0)
    assert metric(_metrics(served), "xlaserve:num_requests_running") == 0
    assert greedy(served, PROMPTS[0], 3).choices[0].finish_reason == "length"  # still serving


def _finished(served, reason: str) -> float:  # noqa: ANN001
    """xlaserve:request_success_total{finished_reason=reason} (0 before the first such request)."""
    for line in _metrics(served).splitlines():
        if (
            line.startswith("xlaserve:request_success_total{")
            and f'finished_reason="{reason}"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_disconnect_non_streaming_frees_blocks(served) -> None:  # noqa: ANN001
    """A non-streaming client that hangs up while its request runs: the server's handler is
    cancelled (aiohttp handler_cancellation in run_server), which aborts the request and frees
    its KV blocks (seen from /metrics), instead of generating on for nobody."""
    n_req, max_tokens = 4, 230  # near max_model_len (256): far from done when we hang up
    before = {r: _finished(served, r) for r in ("abort", "length")}
    gen_before = metric(_metrics(served), "xlaserve:generation_tokens_total")

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL_NAME, "max_tokens": max_tokens, "ignore_eos": True}
            tasks = [
                asyncio.create_task(
                    s.post(served.base_url + "/v1/completions", json={**body, "prompt": f"{p} {i}"})
                )
                for i, p in enumerate(PROMPTS[:n_req])
            ]
            for _ in range(600):  # until all are running (each holds blocks), 30 s at most
                m = _metrics(served)
                if metric(m, "xlaserve:num_requests_running") == n_req:
                    break
                await asyncio.sleep(0.05)
            assert metric(m, "xlaserve:num_requests_running") == n_req
            assert metric(m, "xlaserve:kv_cache_usage_perc") > 0.0
            for t in tasks:  # hang up: the connections close with the session
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    assert wait_until(lambda: metric(_metrics(served), "xlaserve:num_requests_running") == 0, 60)
    m = _metrics(served)
    assert metric(m, "xlaserve:kv_cache_usage_perc") == 0.0
    aborted = _finished(served, "abort") - before["abort"]
    finished = _finished(served, "length") - before["length"]
    # Every request ended; those still running when the client left were aborted (all of them,
    # unless the machine outran the hang-up), so fewer tokens than asked were generated.
    assert aborted + finished == n_req and aborted >= 1, (aborted, finished)
    generated = metric(m, "xlaserve:generation_tokens_total") - gen_before
    assert generated < n_req * max_tokens
    assert greedy(served, PROMPTS[0], 3).choices[0].finish_reason == "length"  # still serving


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 1, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400, None),  # over max_model_len
    ("/v1/completions", {"prompt": "x", "max_tokens": 1000, "stream": True}, 400, None),
    ("/v1/completions", {"prompt": [10**6]}, 400, None),  # token id out of vocab
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-17"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "model": "nope"},
        404,
        "model",
    ),
    ("/v1/nothing", {}, 404, None),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    # pooling endpoints on a generation server: a 400 that names --runner pooling
    ("/v1/embeddings", {"input": "x"}, 400, None),
    ("/v1/rerank", {"query": "x", "documents": ["y"]}, 400, None),
]


@pytest.mark.parametrize(
    "path,body,status,param", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)]
)
def test_bad_requests_get_openai_errors(server, path, body, status, param) -> None:  # noqa: ANN001
    raw = body if isinstance(body, bytes) else None
    got, _, data = http("POST", server.base_url + path, None if raw else body, raw=raw)
    assert got == status, data
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if path in ("/v1/embeddings", "/v1/rerank"):
        assert err["code"] == "wrong_runner" and "--runner pooling" in err["message"], err
    # the server keeps serving
    assert greedy(server, "ok", 2).usage.completion_tokens == 2


def test_unknown_fields_are_ignored(server) -> None:  # noqa: ANN001
    status, _, data = http(
        "POST",
        server.base_url + "/v1/completions",
        {"prompt": "x", "max_tokens": 2, "frobnicate": [1]},
    )
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 2


def test_api_key_and_body_limit(strict_server) -> None:  # noqa: ANN001
    url = strict_server.base_url
    body = {"prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, _, data = http("POST", url + "/v1/completions", body, headers)
        assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(strict_server, api_key="wrong").models.list()
    ok = client(strict_server, api_key=API_KEY).completions.create(
        model=MODEL_NAME, prompt="x", max_tokens=2
    )
    assert ok.usage.completion_tokens == 2
    for path in ("/health", "/version", "/metrics"):
        assert http("GET", url + path)[0] == 200
    big = {"prompt": "a" * (SMALL_BODY_LIMIT + 10), "max_tokens": 1}
    status, _, data = http(
        "POST", url + "/v1/completions", big, {"Authorization": f"Bearer {API_KEY}"}
    )
    assert status == 413 and json.loads(data)["error"]["code"] in ("request_too_large", 413)


def test_metrics_after_requests(server) -> None:  # noqa: ANN001
    greedy(server, PROMPTS[3], 4)
    m = _metrics(server)
    for name in (
        "xlaserve:num_requests_waiting",
        "xlaserve:prefix_cache_queries_total",
        "xlaserve:prefix_cache_hits_total",
        "xlaserve:num_preemptions_total",
        "xlaserve:prompt_tokens_total",
        "xlaserve:time_per_output_token_seconds_count",
        "xlaserve:e2e_request_latency_seconds_count",
    ):
        metric(m, name)  # present
    assert metric(m, "xlaserve:time_to_first_token_seconds_count") >= 1
    assert any(
        line.startswith("xlaserve:request_success_total{") and 'finished_reason="length"' in line
        for line in m.splitlines()
    )
