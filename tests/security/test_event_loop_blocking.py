"""Attack class 3: CPU-heavy work on the event loop. Decompression, JSON parsing of large
bodies, chat templating and tokenization run on the server's CPU pool, so /health answers while
they run. The pool's work is held on an Event here, which makes the check an ordering one: if
the work ran on the loop, /health could not answer until the Event is set."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading

import aiohttp
from ep_helpers import MODEL_NAME, Server

from xlaserve.engine.async_llm import AsyncLLM


def _held(sec_engine: AsyncLLM, monkeypatch, release: threading.Event, entered: threading.Event):  # noqa: ANN001, ANN202
    """Make chat templating block until `release` (it runs on the CPU pool, not the loop)."""
    tok = sec_engine.tokenizer
    real = tok.chat_prompt

    def held(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        entered.set()
        assert release.wait(60), "never released"
        return real(*args, **kwargs)

    monkeypatch.setattr(tok, "chat_prompt", held)


def test_health_answers_while_chat_templating_runs(
    sec_server: Server, sec_engine: AsyncLLM, monkeypatch
) -> None:  # noqa: ANN001
    release, entered = threading.Event(), threading.Event()
    _held(sec_engine, monkeypatch, release, entered)
    order: list[str] = []

    async def run() -> None:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            body = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "In the beginning " * 10}],
                "max_tokens": 1,
                # Ignored by the server, but inflated and parsed: ~12 KB of gzip, 3 MB of JSON.
                "metadata": {"pad": ["In the beginning God created the heaven"] * 75_000},
            }
            # gzip: the body is also inflated on the pool (4 big bodies, as in the issue).
            data = gzip.compress(json.dumps(body).encode())
            headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}

            async def big() -> None:
                url = sec_server.base_url + "/v1/chat/completions"
                async with s.post(url, data=data, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    order.append("big")

            tasks = [asyncio.ensure_future(big()) for _ in range(4)]
            for _ in range(1200):  # bounded: until a worker holds a request
                if entered.is_set():
                    break
                await asyncio.sleep(0.05)
            assert entered.is_set()
            async with s.get(sec_server.base_url + "/health") as r:
                assert r.status == 200
                order.append("health")
            release.set()
            await asyncio.gather(*tasks)

    asyncio.run(run())
    assert order == ["health", "big", "big", "big", "big"]
