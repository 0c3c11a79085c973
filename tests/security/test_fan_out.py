"""Attack class 2: fan-out. One small request must not become unbounded engine work or an
unbounded response: prompts x n, logprobs x n, stop strings and the waiting queue are bounded,
each violation a 4xx OpenAI error before any work."""

from __future__ import annotations

import asyncio

import pytest
from ep_helpers import MODEL_NAME, Server, http
from sec_helpers import error_of

from xlaserve.engine.async_llm import AsyncLLM


def test_prompts_times_n_over_the_limit_is_400_before_any_work(
    sec_server: Server, sec_engine: AsyncLLM
) -> None:
    # The 2,000 prompts x n=128 (256,000 sequences), scaled to stay cheap.
    before = sec_engine.stats.prompt_tokens_total
    body = {"model": MODEL_NAME, "prompt": ["In the beginning"] * 300, "n": 2, "max_tokens": 1}
    status, _, raw = http("POST", sec_server.base_url + "/v1/completions", body)
    assert status == 400
    err = error_of(raw)
    assert err["code"] == "too_many_sequences" and err["param"] == "prompt"
    one = {"model": MODEL_NAME, "prompt": "In the beginning", "n": 128, "max_tokens": 1}
    ok_status, _, _ = http("POST", sec_server.base_url + "/v1/completions", one)
    assert ok_status == 200  # 128 sequences: under the default 256
    two = {**one, "prompt": ["a", "b", "c"]}
    status, _, raw = http("POST", sec_server.base_url + "/v1/completions", two)
    assert status == 400 and error_of(raw)["code"] == "too_many_sequences"
    assert sec_engine.engine.scheduler.num_waiting == 0
    assert sec_engine.stats.prompt_tokens_total >= before


def test_logprobs_times_n_over_the_limit_is_400(sec_server: Server) -> None:
    # n=128 with top_logprobs=20 returned 107 MB before; 128 x 20 = 2,560 > 512.
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "n": 128,
        "logprobs": True,
        "top_logprobs": 20,
        "max_tokens": 1,
    }
    status, _, raw = http("POST", sec_server.base_url + "/v1/chat/completions", body)
    assert status == 400
    assert error_of(raw)["code"] == "too_many_logprobs"
    body["n"], body["top_logprobs"] = 4, 5  # 20: fine
    status, _, _ = http("POST", sec_server.base_url + "/v1/chat/completions", body)
    assert status == 200


def test_stop_strings_are_bounded_in_count_and_length(sec_server: Server) -> None:
    url = sec_server.base_url + "/v1/completions"
    base = {"model": MODEL_NAME, "prompt": "And God said", "max_tokens": 1}
    status, _, raw = http("POST", url, {**base, "stop": [f"s{i}" for i in range(10_000)]})
    assert status == 400 and error_of(raw)["code"] == "too_many_stop_strings"
    status, _, raw = http("POST", url, {**base, "stop": ["x" * 257]})
    assert status == 400 and error_of(raw)["code"] == "stop_string_too_long"
    status, _, _ = http("POST", url, {**base, "stop": ["x" * 256, "y"]})
    assert status == 200


def test_full_waiting_queue_is_503_with_retry_after(
    sec_server: Server, sec_engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The queue is bounded (1024 sequences by default; 8 here): past it, 503 + Retry-After
    instead of queueing unbounded work."""
    import aiohttp

    assert sec_engine.config.scheduler.max_num_waiting == 1024  # bounded by default
    monkeypatch.setattr(sec_engine.config.scheduler, "max_num_waiting", 8)

    async def flood() -> list[tuple[int, dict]]:
        body = {"model": MODEL_NAME, "prompt": "And", "max_tokens": 64, "ignore_eos": True, "n": 8}
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as s:

            async def one() -> tuple[int, dict]:
                async with s.post(sec_server.base_url + "/v1/completions", json=body) as r:
                    await r.read()
                    return r.status, dict(r.headers)

            return await asyncio.gather(*(one() for _ in range(24)))

    results = asyncio.run(flood())
    statuses = [s for s, _ in results]
    assert 503 in statuses and 200 in statuses, statuses
    assert all(h.get("Retry-After") for s, h in results if s == 503)
    assert set(statuses) <= {200, 503}
