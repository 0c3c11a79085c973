"""Every OpenAI endpoint test of tests/entrypoints, run against a server whose engine core is a
child process (this folder's conftest), plus what only the process split has: the process
tree, 384 streams at concurrency 128, stop strings aborting in the core."""

from __future__ import annotations

import asyncio
import inspect
import os

import openai
import psutil
from ep_helpers import MODEL_NAME, http, metric, wait_until

# The same test functions, collected here with this folder's fixtures (engine in a child process).
from test_openai_server import *  # noqa: F403

# Tests on the `served` fixture (all of test_structured_server's, several here) already run
# `xlaserve serve` as a subprocess, whose default is the engine core in its own process: not
# collected a second time here.
for _name in [
    n
    for n, f in list(globals().items())
    if n.startswith("test_") and callable(f) and "served" in inspect.signature(f).parameters
]:
    del globals()[_name]


def _metrics(server) -> str:  # noqa: ANN001
    status, _, body = http("GET", server.base_url + "/metrics")
    assert status == 200
    return body.decode()


def test_core_is_a_child_process(engine) -> None:  # noqa: ANN001
    me = psutil.Process(os.getpid())
    kids = {p.pid for p in me.children(recursive=False)}
    assert engine.core_pid in kids
    core = psutil.Process(engine.core_pid)
    assert core.is_running() and core.status() != psutil.STATUS_ZOMBIE
    # The model lives there: this process never loaded weights (no runner on the front).
    assert not hasattr(engine.engine, "runner")


def test_384_streams_at_concurrency_128_none_lost(server) -> None:  # noqa: ANN001
    n, conc, max_tokens = 384, 128, 5

    async def main() -> list[tuple[int, str, str | None]]:
        sem = asyncio.Semaphore(conc)
        ac = openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300
        )

        async def one(i: int) -> tuple[int, str, str | None]:
            async with sem:
                s = await ac.completions.create(
                    model=MODEL_NAME,
                    prompt=f"stream number {i}",
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                text, fin, toks = "", None, 0
                async for ch in s:
                    if ch.choices:
                        text += ch.choices[0].text
                        fin = ch.choices[0].finish_reason or fin
                    if ch.usage is not None:
                        toks = ch.usage.completion_tokens
                return toks, text, fin

        try:
            return await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            await ac.close()

    before = metric(_metrics(server), "xlaserve:generation_tokens_total")
    results = asyncio.run(main())
    assert len(results) == n
    assert all(t == max_tokens and f == "length" and s for t, s, f in results)
    assert wait_until(lambda: metric(_metrics(server), "xlaserve:num_requests_running") == 0)
    m = _metrics(server)
    assert metric(m, "xlaserve:generation_tokens_total") - before == n * max_tokens
    assert metric(m, "xlaserve:kv_cache_usage_perc") == 0.0


def test_stop_string_aborts_in_the_core(server) -> None:  # noqa: ANN001
    """A stop string found by the front finishes the request at once and frees its blocks in
    the core (the core would otherwise run to max_tokens)."""
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    free = c.completions.create(
        model=MODEL_NAME, prompt="In the beginning", max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = free.choices[0].text
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    before = metric(_metrics(server), "xlaserve:generation_tokens_total")
    got = c.completions.create(
        model=MODEL_NAME, prompt="In the beginning", max_tokens=200, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    ch = got.choices[0]
    assert ch.finish_reason == "stop" and ch.text == text[: text.index(stop)]
    assert wait_until(lambda: metric(_metrics(server), "xlaserve:kv_cache_usage_perc") == 0.0)
    made = metric(_metrics(server), "xlaserve:generation_tokens_total") - before
    assert made < 50  # the core stopped soon after the stop string, not at 200


def test_output_processing_crash_fails_that_request_only(server, engine) -> None:  # noqa: ANN001
    """A bug while turning one request's tokens into text (front side) fails that request with
    a 500 and aborts it in the core; the engine and the other requests carry on."""
    real = engine.processor._apply

    def boom(co, parent, seq, now, stopped):  # noqa: ANN001, ANN202
        if parent.prompt == "explode here":
            raise RuntimeError("injected detokenizer fault")
        return real(co, parent, seq, now, stopped)

    engine.processor._apply = boom
    try:
        c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        try:
            c.completions.create(model=MODEL_NAME, prompt="explode here", max_tokens=5)
            raise AssertionError("the faulty request succeeded")
        except openai.InternalServerError as e:
            assert "injected detokenizer fault" in str(e)
        ok = c.completions.create(
            model=MODEL_NAME,
            prompt="In the beginning",
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
        assert ok.choices[0].finish_reason == "length"
        assert not engine.errored
        assert wait_until(lambda: metric(_metrics(server), "xlaserve:num_requests_running") == 0)
    finally:
        engine.processor._apply = real
