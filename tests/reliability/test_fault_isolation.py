"""Fault isolation: an error while handling one request fails that request, clearly, and leaves
the others running. Also back-pressure: per-request timeouts (504) and their cleanup.

(a) NaN logits for one request (fault injection: one row of the embedding table is poisoned, so
    exactly the requests whose prompt holds that token produce NaN; the torch runner reports it,
    the scheduler finishes the request with an error, the server answers 500 for it alone).
(b) tokenizer edge cases (lone surrogates, invalid / huge token ids, partial UTF-8) -> 400 / 200.
(c) an engine-loop crash fails every pending request promptly and turns /health to 503; an
    unexpected exception while *adding* one request fails only that request.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from ep_helpers import engine_config, serve, slow_steps
from rel_helpers import Client, check_error_body

from xlaserve.config import ServerConfig
from xlaserve.engine.async_llm import AsyncLLM

GREEDY = {"temperature": 0.0, "ignore_eos": True}
NORMAL_PROMPTS = [
    "In the beginning",
    "And God said",
    "And the earth was",
    "Let there be light",
    "the face of the deep",
    "And God saw the light",
    "darkness was upon",
    "the Spirit of God",
]


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, JSON body) or, for streams, (status, list of decoded events incl. '[DONE]')."""
    async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
        if r.content_type == "text/event-stream":
            events: list[Any] = []
            async for line in r.content:
                if line.startswith(b"data: "):
                    p = line[6:].strip().decode()
                    events.append(p if p == "[DONE]" else json.loads(p))
            return r.status, events
        return r.status, await r.json()


def _stream_text(events: list[Any]) -> str:
    return "".join(c["text"] for e in events if isinstance(e, dict) for c in e.get("choices", []))


def _embedding(engine: AsyncLLM) -> Any:
    model = engine.engine.runner.model
    for name, mod in model.named_modules():
        if name.endswith("embed_tokens"):
            return mod.weight
    raise AssertionError("no embed_tokens in the torch model")


# ------------------------------------------------------------------------------------- (a)


def test_nan_logits_fail_only_that_request(rel_model_path: str) -> None:
    # 20 blocks of 4 tokens: the poisoned request's blocks are soon reused by others, so stale
    # NaN K/V left in the cache would show up in their greedy output.
    eng = AsyncLLM.from_config(
        engine_config(rel_model_path, num_kv_blocks=20, max_num_seqs=8, max_model_len=64)
    )
    gen = serve(eng, owns_engine=True)
    srv = next(gen)
    url = srv.base_url + "/v1/completions"
    tok = eng.tokenizer
    normal_ids = {t for p in NORMAL_PROMPTS for t in tok.encode(p)}
    bad = next(t for t in range(300, 384) if t not in normal_ids)  # a token no normal prompt has
    try:

        async def reference() -> list[str]:
            async with aiohttp.ClientSession() as s:
                outs = []
                for p in NORMAL_PROMPTS:
                    st, body = await _post(s, url, {"prompt": p, "max_tokens": 10, **GREEDY})
                    assert st == 200, body
                    outs.append(body["choices"][0]["text"])
                return outs

        ref = asyncio.run(reference())
        assert len(set(ref)) > 1  # the model does not write one thing for every prompt
        with __import__("torch").no_grad():
            _embedding(eng)[bad] = float("nan")  # fault injection: a poisoned weight row

        poisoned = [5, 6, bad, 7, 8]

        async def mixed() -> list[tuple[int, Any]]:
            async with aiohttp.ClientSession() as s:
                jobs = [
                    _post(s, url, {"prompt": p, "max_tokens": 10, "stream": i % 2 == 0, **GREEDY})
                    for i, p in enumerate(NORMAL_PROMPTS[:4])
                ]
                jobs.insert(1, _post(s, url, {"prompt": poisoned, "max_tokens": 10, **GREEDY}))
                jobs.insert(
                    3,
                    _post(s, url, {"prompt": poisoned, "max_tokens": 10, "stream": True, **GREEDY}),
                )
                return await asyncio.gather(*jobs)

        results = asyncio.run(mixed())
        (st_bad, body_bad), (st_bad_s, ev_bad) = results[1], results[3]
        normal = [results[i] for i in (0, 2, 4, 5)]
        # the poisoned request: a 500 with a clear message (non-stream) / an error event (stream)
        assert st_bad == 500, body_bad
        assert "non-finite logits" in body_bad["error"]["message"]
        assert body_bad["error"]["type"] == "server_error"
        assert st_bad_s == 200 and ev_bad[-1] == "[DONE]"
        errs = [e for e in ev_bad if isinstance(e, dict) and "error" in e]
        assert len(errs) == 1 and "non-finite logits" in errs[0]["error"]["message"]
        # everyone else: exactly the output they had before the fault
        for i, (st, body) in enumerate(normal):
            assert st == 200
            text = _stream_text(body) if isinstance(body, list) else body["choices"][0]["text"]
            assert text == ref[i], (i, text, ref[i])
        # The engine lives on; requests that reuse the freed blocks are unaffected.
        assert not eng.errored
        assert asyncio.run(reference()) == ref
        end = time.monotonic() + 10
        while eng.stats.kv_cache_usage > 0 and time.monotonic() < end:
            time.sleep(0.05)
        assert eng.stats.kv_cache_usage == 0.0, eng.stats
    finally:
        gen.close()


# ------------------------------------------------------------------------------------- (b)


@pytest.mark.parametrize(
    "route,body,status,needle",
    [
        ("/v1/completions", {"prompt": "In the \ud800 beginning", "max_tokens": 2}, 400, "Unicode"),
        ("/v1/completions", {"prompt": ["ok", "\udfff"], "max_tokens": 2}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": ["\ud83d"]}, 400, "stop"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 2},
            400,
            "Unicode",
        ),
        ("/tokenize", {"prompt": "\udc80abc"}, 400, "Unicode"),
        ("/v1/completions", {"prompt": [1, 2, 384], "max_tokens": 2}, 400, "[0, 384)"),
        ("/v1/completions", {"prompt": [1, -1], "max_tokens": 2}, 400, "[0, 384)"),
        ("/v1/completions", {"prompt": [1, 2**63], "max_tokens": 2}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 2**62], "max_tokens": 2}, 400, "[0, 384)"),
        ("/detokenize", {"tokens": [1, 384]}, 400, "[0, 384)"),
        ("/detokenize", {"tokens": [-1]}, 400, "[0, 384)"),
        ("/detokenize", {"tokens": [2**70]}, 400, "64-bit"),
        ("/detokenize", {"tokens": [1.5]}, 400, "integer"),
    ],
)
def test_tokenizer_edge_cases_fail_that_request(
    fuzz_client: Client, route: str, body: dict, status: int, needle: str
) -> None:
    r = fuzz_client.send("POST", route, body)
    assert r.status == status, r.body
    err = check_error_body(r)
    assert needle in err["message"] or needle == err["param"], err


def test_partial_utf8_tokens_and_healthy_after(fuzz_client: Client, fuzz_server) -> None:  # noqa: ANN001
    tok = fuzz_server.engine.tokenizer
    # Byte-level BPE: an emoji is several byte tokens; one of them alone is not valid UTF-8.
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    r = fuzz_client.send("POST", "/detokenize", {"tokens": ids[:1]})
    assert r.status == 200 and "\ufffd" in r.json()["prompt"]
    r = fuzz_client.send("POST", "/detokenize", {"tokens": ids})
    assert r.status == 200 and r.json()["prompt"] == "🙂"
    # a prompt of partial-UTF-8 token ids generates fine (echo decodes them with U+FFFD)
    r = fuzz_client.send(
        "POST",
        "/v1/completions",
        {"prompt": ids[:1] * 3, "max_tokens": 3, "echo": True, **GREEDY},
    )
    assert r.status == 200, r.body
    assert r.json()["choices"][0]["text"].startswith("\ufffd")
    assert fuzz_client.send("GET", "/health").status == 200


# ------------------------------------------------------------------------------------- (c)


def test_loop_crash_fails_all_pending_promptly(rel_model_path: str) -> None:
    """Several requests in flight (running, waiting, streaming) when the loop thread dies: each
    fails within seconds with engine_dead, /health is 503, new requests get 503."""
    eng = AsyncLLM.from_config(engine_config(rel_model_path, num_kv_blocks=64, max_num_seqs=2))
    gen = serve(eng, owns_engine=True)
    srv = next(gen)
    url = srv.base_url + "/v1/completions"
    try:

        async def main() -> tuple[list[tuple[int, Any]], float]:
            async with aiohttp.ClientSession() as s:
                long = {"max_tokens": 200, **GREEDY}
                jobs = [
                    asyncio.ensure_future(_post(s, url, {"prompt": p, **long, "stream": i == 0}))
                    for i, p in enumerate(NORMAL_PROMPTS[:5])  # 2 run, 3 wait
                ]
                while eng.stats.num_running < 2 or eng.stats.num_waiting < 3:
                    await asyncio.sleep(0.02)

                def boom() -> list:
                    raise RuntimeError("injected device fault")

                eng.engine.step = boom
                t0 = time.monotonic()
                res = await asyncio.gather(*jobs)
                return res, time.monotonic() - t0

        results, dt = asyncio.run(main())
        assert dt < 5.0, dt
        st0, events = results[0]
        assert st0 == 200 and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "engine_dead"
        for st, body in results[1:]:
            assert st == 503 and body["error"]["code"] == "engine_dead", body
            assert "injected device fault" in body["error"]["message"]
        c = Client(srv.base_url)
        try:
            assert c.send("GET", "/health").status == 503
            r = c.send("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert r.status == 503 and check_error_body(r)["code"] == "engine_dead"
        finally:
            c.close()
    finally:
        gen.close()


def test_unexpected_add_error_fails_only_that_request(rel_model_path: str) -> None:
    eng = AsyncLLM.from_config(engine_config(rel_model_path, num_kv_blocks=64))
    real_add = eng.engine.add_request

    def flaky_add(request_id: str, prompt: Any, *a: Any, **kw: Any) -> None:
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt  # server: a dict
        if text == "boom":
            raise KeyError("injected fault while adding")  # not a ValueError: a bug, not input
        real_add(request_id, prompt, *a, **kw)

    eng.engine.add_request = flaky_add
    gen = serve(eng, owns_engine=True)
    srv = next(gen)
    url = srv.base_url + "/v1/completions"
    try:

        async def main() -> list[tuple[int, Any]]:
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(
                    _post(s, url, {"prompt": "In the beginning", "max_tokens": 8, **GREEDY}),
                    _post(s, url, {"prompt": "boom", "max_tokens": 8}),
                    _post(s, url, {"prompt": "And God said", "max_tokens": 8, **GREEDY}),
                )

        (s1, b1), (s2, b2), (s3, b3) = asyncio.run(main())
        assert s2 == 500 and "injected fault while adding" in b2["error"]["message"], b2
        assert b2["error"]["type"] == "server_error"
        assert s1 == s3 == 200
        assert b1["usage"]["completion_tokens"] == b3["usage"]["completion_tokens"] == 8
        assert not eng.errored
        c = Client(srv.base_url)
        try:
            assert c.send("GET", "/health").status == 200
        finally:
            c.close()
    finally:
        gen.close()


# ------------------------------------------------------------------------------------- timeouts


def test_request_timeout_gives_504_and_frees_blocks(rel_model_path: str) -> None:
    eng = AsyncLLM.from_config(engine_config(rel_model_path, num_kv_blocks=128))
    slow_steps(eng, 0.01)  # 240 tokens take >= 2.4 s, well past the 0.5 s timeout
    gen = serve(eng, ServerConfig(request_timeout=0.5), owns_engine=True)
    srv = next(gen)
    url = srv.base_url + "/v1/completions"
    try:

        async def main() -> tuple[tuple[int, Any], tuple[int, Any], tuple[int, Any], float]:
            async with aiohttp.ClientSession() as s:
                long = {"prompt": "In the beginning", "max_tokens": 240, **GREEDY}
                t0 = time.monotonic()
                a = await _post(s, url, long)
                dt = time.monotonic() - t0
                b = await _post(s, url, {**long, "stream": True})
                short = await _post(s, url, {"prompt": "And God", "max_tokens": 2})
                return a, b, short, dt

        (sa, ba), (sb, eb), (sc, bc), dt = asyncio.run(main())
        assert sa == 504 and ba["error"]["code"] == "timeout" and ba["error"]["type"] == "timeout"
        assert dt < 5.0
        assert sb == 200 and eb[-1] == "[DONE]" and eb[-2]["error"]["code"] == "timeout"
        assert sc == 200 and bc["usage"]["completion_tokens"] == 2
        end = time.monotonic() + 10
        while eng.stats.kv_cache_usage > 0 and time.monotonic() < end:
            time.sleep(0.05)
        assert eng.stats.kv_cache_usage == 0.0 and eng.stats.num_running == 0
    finally:
        gen.close()
