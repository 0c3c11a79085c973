"""Attack class 2b: one request holding the batch. A request with many sequences (n, or many
prompts) gets at most `max_running_share` of the running batch while another client waits, so
the other client's small request is not queued behind it (end to end over HTTP; the exact
scheduler behaviour is in tests/core/test_scheduler_fairness.py)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from ep_helpers import MODEL_NAME, Server

from xlaserve.engine.async_llm import AsyncLLM


def test_small_request_finishes_while_a_wide_request_holds_the_batch(
    sec_server: Server, sec_engine: AsyncLLM
) -> None:
    """max_num_seqs=64 here: a 128-sequence request (2 prompts x n=64) would fill the batch
    for its whole run; with the share cap the small request is admitted at once and finishes
    long before the wide one (an ordering, not a timing, assertion)."""
    finished: list[str] = []

    async def run() -> None:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            wide = {
                "model": MODEL_NAME,
                "prompt": ["In the beginning", "And God said"],
                "n": 64,
                "max_tokens": 48,
                "ignore_eos": True,
            }
            small = {"model": MODEL_NAME, "prompt": "Let", "max_tokens": 2, "ignore_eos": True}

            async def go(name: str, body: dict, after_wide_runs: bool) -> None:
                for _ in range(2000):  # bounded: the wide request fills the batch first
                    if not after_wide_runs or sec_engine.engine.scheduler.num_running >= 32:
                        break
                    await asyncio.sleep(0.01)
                async with s.post(sec_server.base_url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                finished.append(name)

            # The small request arrives once the wide one is running.
            await asyncio.gather(go("wide", wide, False), go("small", small, True))

    t0 = time.monotonic()
    asyncio.run(run())
    assert finished == ["small", "wide"], finished
    assert time.monotonic() - t0 < 300
