"""Back-pressure through the process boundary: the core's waiting-queue bound answers the add
with "full" and the server replies 503 + Retry-After; the admitted requests complete."""

from __future__ import annotations

import asyncio

import aiohttp
from ep_helpers import engine_config, http, serve

from xlaserve.engine.core_client import MPAsyncLLM


def test_waiting_queue_bound_answers_503_with_retry_after(model_path: str) -> None:
    eng = MPAsyncLLM(
        engine_config(model_path, num_kv_blocks=128, max_num_seqs=1, max_num_waiting=1)
    )
    gen = serve(eng, owns_engine=True)  # type: ignore[arg-type]
    srv = next(gen)
    try:

        async def main() -> list[tuple[int, str | None, dict]]:
            async with aiohttp.ClientSession() as s:

                async def one(i: int) -> tuple[int, str | None, dict]:
                    # 200 tokens each with one running and one waiting at most: 12 requests at
                    # once cannot all be admitted.
                    body = {"prompt": f"And God said {i}", "max_tokens": 200, "ignore_eos": True}
                    async with s.post(srv.base_url + "/v1/completions", json=body) as r:
                        return r.status, r.headers.get("Retry-After"), await r.json()

                return await asyncio.gather(*(one(i) for i in range(12)))

        results = asyncio.run(main())
        statuses = [r[0] for r in results]
        assert 200 in statuses and 503 in statuses, statuses
        for status, retry, body in results:
            if status == 503:
                assert retry is not None and int(retry) >= 1
                assert body["error"]["code"] == "queue_full"
            else:
                assert status == 200 and body["usage"]["completion_tokens"] == 200
        assert http("GET", srv.base_url + "/health")[0] == 200  # full queue is not an engine fault
    finally:
        gen.close()
