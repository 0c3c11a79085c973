"""AsyncLLM failure handling on real engines: loop crash, full waiting queue, early exit, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest
from ep_helpers import MODEL_NAME, engine_config, http, serve, slow_steps

from xlaserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineQueueFullError
from xlaserve.sampling_params import SamplingParams

LONG = dict(max_tokens=200, ignore_eos=True, temperature=0.0)


def test_loop_crash_fails_requests_and_health(model_path: str) -> None:
    eng = AsyncLLM.from_config(engine_config(model_path, num_kv_blocks=128))
    gen = serve(eng, owns_engine=True)
    srv = next(gen)
    try:
        assert http("GET", srv.base_url + "/health")[0] == 200

        async def main() -> tuple[list[bytes], float]:
            async with aiohttp.ClientSession() as s:
                body = {"model": MODEL_NAME, "prompt": "In the beginning", "stream": True, **LONG}
                r = await s.post(srv.base_url + "/v1/completions", json=body)
                lines = []
                async for line in r.content:
                    if line.startswith(b"data: "):
                        lines.append(line)
                        if len(lines) == 2:

                            def boom() -> list:
                                raise RuntimeError("injected device fault")

                            eng.engine.step = boom  # fault injection: the next step raises
                            t0 = time.monotonic()
                return lines, time.monotonic() - t0

        lines, dt = asyncio.run(main())
        assert dt < 5.0  # failed promptly, not after the 200 tokens
        err = json.loads(lines[-2][6:])  # last event before [DONE]
        assert lines[-1].strip() == b"data: [DONE]"
        assert (
            "injected device fault" in err["error"]["message"]
            and err["error"]["code"] == "engine_dead"
        )
        assert eng.errored
        status, _, data = http("GET", srv.base_url + "/health")
        assert status == 503 and json.loads(data)["error"]["type"] == "service_unavailable"
        status, _, data = http(
            "POST", srv.base_url + "/v1/completions", {"prompt": "x", "max_tokens": 2}
        )
        assert status == 503 and "injected device fault" in json.loads(data)["error"]["message"]
    finally:
        gen.close()


def test_waiting_queue_bound_answers_503_with_retry_after(model_path: str) -> None:
    eng = AsyncLLM.from_config(
        engine_config(model_path, num_kv_blocks=128, max_num_seqs=1, max_num_waiting=1)
    )
    slow_steps(eng, 0.02)  # 40 tokens take >= 0.8 s: later arrivals find the first still running
    gen = serve(eng, owns_engine=True)
    srv = next(gen)
    try:

        async def main() -> list[tuple[int, str | None, dict]]:
            async with aiohttp.ClientSession() as s:

                async def one(i: int) -> tuple[int, str | None, dict]:
                    await asyncio.sleep(0.2 * i)  # arrive in order, while the first still runs
                    body = {"prompt": f"And God said {i}", **LONG, "max_tokens": 40}
                    async with s.post(srv.base_url + "/v1/completions", json=body) as r:
                        return r.status, r.headers.get("Retry-After"), await r.json()

                return await asyncio.gather(*(one(i) for i in range(4)))

        results = asyncio.run(main())
        statuses = [r[0] for r in results]
        assert statuses[0] == 200 and 503 in statuses, statuses
        for status, retry, body in results:
            if status == 503:
                assert retry is not None and int(retry) >= 1
                assert body["error"]["code"] == "queue_full"
            else:
                assert body["usage"]["completion_tokens"] == 40
        assert http("GET", srv.base_url + "/health")[0] == 200  # full queue is not an engine fault
    finally:
        gen.close()


def test_early_exit_aborts_and_shutdown_fails_pending(model_path: str) -> None:
    eng = AsyncLLM.from_config(engine_config(model_path, num_kv_blocks=128))

    async def main() -> None:
        params = SamplingParams(**LONG)
        n = 0
        async with contextlib.aclosing(eng.generate("In the beginning", params, "early")) as outs:
            async for out in outs:
                n += 1
                assert not out.finished
                if n == 2:
                    assert eng.stats.kv_cache_usage > 0.0
                    break  # consumer leaves: the request must be aborted and its blocks freed
        for _ in range(100):
            if eng.stats.kv_cache_usage == 0.0 and eng.stats.num_running == 0:
                break
            await asyncio.sleep(0.05)
        assert eng.stats.kv_cache_usage == 0.0 and eng.stats.num_running == 0
        with pytest.raises(ValueError, match="context length"):
            await eng.add_request("too-long", "x", SamplingParams(max_tokens=10_000))
        with pytest.raises(ValueError, match="already in use"):
            await eng.add_request("dup", "x", SamplingParams(**LONG))
            await eng.add_request("dup", "x", SamplingParams(**LONG))
        eng.abort("dup")
        # a pending request fails with EngineDeadError when the engine shuts down
        agen = eng.generate("And God said", SamplingParams(**LONG), "pending")
        await agen.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in agen:
                pass
        with pytest.raises(EngineDeadError):
            await eng.add_request("after", "x", SamplingParams())

    asyncio.run(main())
    assert eng.errored
    assert issubclass(EngineQueueFullError, RuntimeError)
