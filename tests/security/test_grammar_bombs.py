"""Attack class 1: grammar compilation bombs. Grammar sources are bounded in bytes (400 before
any parsing), a compile that runs past `grammar_compile_timeout` is killed (its request gets a
400, the next grammar compiles on another worker), a compile whose client left is killed, the
compiled-grammar cache is bounded in bytes, and shutdown never waits on a compile."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
from ep_helpers import MODEL_NAME, Server, http, wait_until
from sec_helpers import error_of

from xlaserve.config import StructuredOutputConfig
from xlaserve.engine.async_llm import AsyncLLM
from xlaserve.sampling_params import StructuredOutputsParams as SO

# The 100k-entry choice list: 20-60 s to compile even on the tiny model's 384-token
# vocabulary (164 MB compiled), far over the 3 s timeout of these tests.
SLOW_CHOICE = [f"item {i:06d}" for i in range(100_000)]


def _chat(server: Server, extra: dict, max_tokens: int = 4) -> tuple[int, bytes]:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "pick"}],
        "max_tokens": max_tokens,
        **extra,
    }
    status, _, raw = http("POST", server.base_url + "/v1/chat/completions", body)
    return status, raw


def test_grammar_sources_over_the_limit_are_400_before_parsing(
    sec_server: Server, sec_engine: AsyncLLM
) -> None:
    assert StructuredOutputConfig().max_grammar_bytes == 64 * 1024  # the default
    limit = sec_engine.config.structured.max_grammar_bytes  # raised here for the slow tests
    big = limit + 1
    cases = {
        "guided_regex": "a" * big,
        "guided_choice": ["x" * 1000] * (big // 1000 + 1),
        "guided_grammar": 'root ::= "' + "a" * big + '"',
        "guided_json": {"type": "object", "description": "d" * big},
    }
    for field, value in cases.items():
        status, raw = _chat(sec_server, {field: value})
        assert status == 400, (field, raw)
        err = error_of(raw)
        assert err["code"] == "grammar_too_large" and err["param"] == field, err
    # The 4 MB regex does not even get past the body limit.
    status, _ = _chat(sec_server, {"guided_regex": "a" * (4 * 1024 * 1024)})
    assert status == 413
    # Just under the limit is parsed (and compiles: a plain literal).
    assert _chat(sec_server, {"guided_regex": "a" * 1000}, 1)[0] == 200


def test_slow_compile_is_killed_and_other_grammars_still_compile(
    sec_server: Server, sec_engine: AsyncLLM
) -> None:
    async def run() -> tuple[tuple[int, bytes], tuple[int, bytes]]:
        timeout = aiohttp.ClientTimeout(total=240)
        async with aiohttp.ClientSession(timeout=timeout) as s:

            async def post(extra: dict) -> tuple[int, bytes]:
                body = {
                    "model": MODEL_NAME,
                    "messages": [{"role": "user", "content": "pick"}],
                    "max_tokens": 4,
                    **extra,
                }
                async with s.post(sec_server.base_url + "/v1/chat/completions", json=body) as r:
                    return r.status, await r.read()

            slow = asyncio.ensure_future(post({"guided_choice": SLOW_CHOICE}))
            await asyncio.sleep(0.2)
            # A second worker compiles this one while the first is stuck on the slow list.
            quick = await post({"guided_regex": "(yes|no)"})
            return await slow, quick

    (slow_status, slow_raw), (quick_status, quick_raw) = asyncio.run(run())
    assert quick_status == 200, quick_raw
    assert "yes".startswith(json.loads(quick_raw)["choices"][0]["message"]["content"]) or (
        "no".startswith(json.loads(quick_raw)["choices"][0]["message"]["content"])
    )
    assert slow_status == 400, slow_raw
    err = error_of(slow_raw)
    assert err["code"] == "grammar_compile_timeout", err
    assert sec_engine.engine._structured._pool.num_killed >= 1
    assert sec_engine.engine.get_num_unfinished_requests() == 0


def test_compile_of_a_departed_client_is_killed(sec_server: Server, sec_engine: AsyncLLM) -> None:
    mgr = sec_engine.engine._structured
    if mgr is None:  # the manager appears with the first constrained request
        assert _chat(sec_server, {"guided_regex": "a"}, 1)[0] == 200
        mgr = sec_engine.engine._structured
    pool = mgr._pool
    cancels, timeouts = pool.num_cancels, pool.num_timeouts
    choice = [c + "z" for c in SLOW_CHOICE]  # a key not compiled before

    async def leave_while_compiling() -> None:
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "pick"}],
            "max_tokens": 4,
            "guided_choice": choice,
        }
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:

            async def post() -> None:
                async with s.post(sec_server.base_url + "/v1/chat/completions", json=body) as r:
                    await r.read()

            task = asyncio.ensure_future(post())
            for _ in range(1200):  # bounded: until the compile is in flight
                if mgr._inflight:
                    break
                await asyncio.sleep(0.05)
            assert mgr._inflight, "the compile never started"
            task.cancel()  # the client leaves: its connection closes
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(leave_while_compiling())
    # The abort kills the worker (a cancel, not the 3 s timeout) and nothing waits any more.
    assert wait_until(lambda: pool.num_cancels > cancels, timeout=60)
    assert pool.num_timeouts == timeouts
    assert wait_until(lambda: not mgr.has_pending() and not mgr._inflight, timeout=30)


def test_grammar_cache_is_bounded_in_bytes(sec_engine: AsyncLLM) -> None:
    from xlaserve.structured.manager import StructuredOutputManager

    tok = sec_engine.tokenizer
    vocab = sec_engine.engine.spec.vocab_size
    cfg = StructuredOutputConfig(cache_bytes=200_000, compile_workers=0)
    mgr = StructuredOutputManager(tok, vocab, config=cfg)
    try:
        for i in range(12):
            so = SO(choice=[f"c{i}-{j}" for j in range(300)])
            mgr.add_request(f"r{i}", mgr.prepare(so))
            assert wait_until(lambda: (mgr.poll() or True) and not mgr.has_pending(), 60)
            mgr.remove(f"r{i}")
            assert mgr.cache_bytes_used <= cfg.cache_bytes
        assert 0 < len(mgr._cache) < 12  # old entries were evicted by size, not count (256)
    finally:
        mgr.shutdown()


def test_shutdown_does_not_wait_on_a_compile(tiny_model_dir) -> None:  # noqa: ANN001
    """An engine whose worker is mid-compile (timeout 600 s) shuts down at once: the worker
    process is killed, not waited for."""
    from ep_helpers import engine_config

    eng = AsyncLLM.from_config(
        engine_config(
            tiny_model_dir("llama"),
            compile_timeout=600.0,
            compile_workers=1,
            max_grammar_bytes=2 * 1024 * 1024,
        )
    )
    try:
        from xlaserve.sampling_params import SamplingParams

        async def start() -> None:
            params = SamplingParams(max_tokens=2, structured_outputs=SO(choice=SLOW_CHOICE))
            await eng.add_request("slow", "pick", params)

        asyncio.run(start())
        mgr = eng.engine._structured
        assert wait_until(lambda: bool(mgr._inflight) and bool(mgr._pool._procs), 120)
        procs = list(mgr._pool._procs.values())
        assert all(p.poll() is None for p in procs)  # compiling
    finally:
        eng.shutdown()
    assert all(p.poll() is not None for p in procs)  # killed, not left compiling
