"""Bounded soak: thousands (CI: a couple of hundred) of mixed requests over loopback against a
server whose KV cache is small enough to preempt often.

Mix: prompt lengths 3..~45 tokens, n 1-2, stop strings, streaming and not, completions and chat,
priorities (the server runs the "priority" policy), client cancellations before the reply,
client disconnects mid-stream, and a few requests that must be rejected (too long).

Afterwards: no request lost (each one finished, was given up by its client, or was rejected with
a reason), no KV block held (engine stats, the block manager, /metrics), preemptions happened,
and resident memory grew less than RSS_BOUND_MIB after the warm-up.

Size: XLASERVE_SOAK_REQUESTS (default 200; `make soak` runs 3000). With XLASERVE_SOAK_RESULTS set
to a file, a row of figures is appended to it (`make soak` appends to bench/RESULTS.md).
Engine: XLASERVE_SOAK_ENGINE=process (default, as `xlaserve serve`: the engine core in a child
process) or inprocess (the engine on a thread of the server's process).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from ep_helpers import MODEL_NAME, engine_config, metric, serve
from rel_helpers import rss_bytes

from xlaserve.engine.async_llm import AsyncLLM

NUM_REQUESTS = int(os.environ.get("XLASERVE_SOAK_REQUESTS", "150"))
ENGINE_MODE = os.environ.get("XLASERVE_SOAK_ENGINE", "process")
# Strict priority scheduling may hold a low-priority request back while others keep arriving:
# that is a wait, not a loss, so the client waits long before calling a request lost.
CLIENT_TIMEOUT_S = 300.0
CONCURRENCY = 16
# Resident memory may grow at most this much between the end of the warm-up and the end.
RSS_BOUND_MIB = 64
WORDS = (
    "In the beginning God created the heaven and the earth And the earth was without form and "
    "void and darkness was upon the face of the deep And God said Let there be light"
).split()
STOPS = ["light", "God", "the earth", "\n"]


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # finished / client_gone / rejected / lost
    kinds: Counter = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    disconnects: int = 0  # streams closed by the client after at least one chunk
    cancels: int = 0  # requests cancelled by the client before the reply
    max_latency: float = 0.0

    def add(self, outcome: str, why: str = "") -> None:
        self.outcomes[outcome] += 1
        if outcome == "lost":
            self.lost.append(why)


def _prompt(rng: random.Random) -> str:
    n = rng.choice([2, 4, 8, 12, 20])
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _body(rng: random.Random, kind: str) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "max_tokens": rng.randint(2, 16),
        "priority": rng.choice([-1, 0, 0, 1, 2]),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "seed": rng.randrange(1 << 30),
    }
    if rng.random() < 0.3:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.2:
        body["n"] = 2
    if kind == "reject":
        body["max_tokens"] = 10_000  # over the context length: a 400 with a reason
    if kind in ("stream", "disconnect", "chat_stream"):
        body["stream"] = True
    if kind.startswith("chat"):
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
        return "/v1/chat/completions", body
    body["prompt"] = _prompt(rng)
    return "/v1/completions", body


def _finished_choices(events: list[Any]) -> dict[int, str]:
    done: dict[int, str] = {}
    for ev in events:
        for ch in ev.get("choices", []):
            if ch.get("finish_reason"):
                done[ch["index"]] = ch["finish_reason"]
    return done


async def _one(
    s: aiohttp.ClientSession, url: str, i: int, rng: random.Random, tally: Tally
) -> None:
    kind = rng.choices(
        ["complete", "stream", "chat", "chat_stream", "cancel", "disconnect", "reject"],
        weights=[25, 20, 10, 15, 10, 15, 5],
    )[0]
    tally.kinds[kind] += 1
    path, body = _body(rng, kind)
    n = body.get("n", 1)

    async def call() -> None:
        async with s.post(url + path, json=body) as r:
            if r.status != 200:
                data = await r.json()
                err = data.get("error", {})
                if r.status < 500 or r.status == 503:
                    assert err.get("message"), data
                    tally.add("rejected")
                else:
                    tally.add("lost", f"{kind} {r.status} {err}")
                return
            if not body.get("stream"):
                data = await r.json()
                reasons = [c["finish_reason"] for c in data["choices"]]
                ok = len(reasons) == n and all(x in ("stop", "length") for x in reasons)
                tally.add("finished" if ok else "lost", f"{kind} {data}")
                return
            events: list[Any] = []
            stop_after = rng.randint(1, 6) if kind == "disconnect" else None
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    done = _finished_choices(events)
                    errs = [e for e in events if "error" in e]
                    ok = not errs and len(done) == n
                    tally.add("finished" if ok else "lost", f"{kind} {errs or done}")
                    return
                events.append(json.loads(payload))
                if stop_after is not None and len(events) >= stop_after:
                    tally.disconnects += 1
                    tally.add("client_gone")
                    return  # leaving the `async with` closes the connection mid-stream
            tally.add("lost", f"{kind}: stream ended without [DONE]")

    if kind != "cancel":
        try:
            t0 = time.monotonic()
            await asyncio.wait_for(call(), CLIENT_TIMEOUT_S)
            tally.max_latency = max(tally.max_latency, time.monotonic() - t0)
        except asyncio.TimeoutError:
            tally.add("lost", f"{kind} {body}: no reply in {CLIENT_TIMEOUT_S} s")
        return
    task = asyncio.ensure_future(call())
    await asyncio.sleep(rng.uniform(0.0, 0.4))
    if task.done():
        await task
        return
    task.cancel()
    tally.cancels += 1
    tally.add("client_gone")
    with_exc = await asyncio.gather(task, return_exceptions=True)
    assert isinstance(with_exc[0], asyncio.CancelledError | type(None))


async def _drive(url: str, tally: Tally, warmup: int, rss: dict[str, int]) -> None:
    rng = random.Random(1234)
    sem = asyncio.Semaphore(CONCURRENCY)
    connector = aiohttp.TCPConnector(limit=CONCURRENCY * 2)
    async with aiohttp.ClientSession(connector=connector) as s:

        async def guarded(i: int, r: random.Random) -> None:
            async with sem:
                await _one(s, url, i, r, tally)

        # Warm-up first (then measure RSS), then the rest.
        await asyncio.gather(*(guarded(i, random.Random(rng.random())) for i in range(warmup)))
        gc.collect()
        rss["warm"] = rss_bytes()
        await asyncio.gather(
            *(guarded(i, random.Random(rng.random())) for i in range(warmup, NUM_REQUESTS))
        )


def _wait_idle(engine: AsyncLLM, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = engine.stats
        if st.num_running == 0 and st.num_waiting == 0 and st.kv_cache_usage == 0.0:
            return
        time.sleep(0.1)


@pytest.mark.soak
def test_soak_mixed_requests_with_preemption(rel_model_path: str) -> None:
    cfg = engine_config(
        rel_model_path,
        num_kv_blocks=48,  # 192 tokens of KV for up to 12 sequences: preempts often
        block_size=4,
        max_num_seqs=12,
        max_num_batched_tokens=128,
        max_model_len=128,
        policy="priority",
    )
    if ENGINE_MODE == "process":
        from xlaserve.engine.core_client import MPAsyncLLM

        eng = MPAsyncLLM(cfg)
    else:
        eng = AsyncLLM.from_config(cfg)
    gen = serve(eng, owns_engine=True)
    srv = next(gen)
    try:
        tally = Tally()
        rss: dict[str, int] = {"start": rss_bytes()}
        warmup = max(30, NUM_REQUESTS // 10)
        t0 = time.monotonic()
        asyncio.run(_drive(srv.base_url, tally, warmup, rss))
        wall = time.monotonic() - t0
        _wait_idle(eng)
        gc.collect()
        rss["end"] = rss_bytes()

        st = eng.stats
        metrics_text = asyncio.run(_get_text(srv.base_url + "/metrics"))
        growth_mib = (rss["end"] - rss["warm"]) / 2**20
        figures = {
            "engine": ENGINE_MODE,
            "requests": NUM_REQUESTS,
            **{k: tally.outcomes[k] for k in ("finished", "client_gone", "rejected", "lost")},
            "cancels": tally.cancels,
            "disconnects": tally.disconnects,
            "preemptions": st.num_preemptions_total,
            "generation_tokens": st.generation_tokens_total,
            "wall_s": round(wall, 1),
            "max_latency_s": round(tally.max_latency, 1),
            "rss_warm_mib": round(rss["warm"] / 2**20, 1),
            "rss_end_mib": round(rss["end"] / 2**20, 1),
            "rss_growth_mib": round(growth_mib, 1),
        }
        print("\nsoak:", json.dumps(figures), "kinds:", dict(tally.kinds))
        _maybe_record(figures)

        assert sum(tally.outcomes.values()) == NUM_REQUESTS, tally.outcomes
        assert tally.outcomes["lost"] == 0, tally.lost[:5]
        assert tally.outcomes["finished"] > NUM_REQUESTS // 2
        assert tally.outcomes["rejected"] > 0 and tally.disconnects > 0
        # No KV block held by anyone: stats, the block manager itself, and /metrics.
        assert st.num_running == 0 and st.num_waiting == 0, st
        assert st.kv_cache_usage == 0.0 and st.num_free_blocks == st.num_total_blocks, st
        if ENGINE_MODE == "process":  # the block manager is in the core: its stats say it
            assert not eng.processor.has_unfinished_requests()
        else:
            kv = eng.engine.kv_manager
            assert not any(kv.req_to_blocks.values()), "a request still holds blocks"
            assert not eng.engine.has_unfinished_requests()
        assert metric(metrics_text, "xlaserve:kv_cache_usage_perc") == 0.0
        assert metric(metrics_text, "xlaserve:num_requests_running") == 0.0
        assert st.num_preemptions_total > 0
        assert metric(metrics_text, "xlaserve:num_preemptions_total") == st.num_preemptions_total
        assert growth_mib < RSS_BOUND_MIB, figures
        assert not eng.errored
    finally:
        gen.close()


async def _get_text(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()


def _maybe_record(fig: dict[str, Any]) -> None:
    path = os.environ.get("XLASERVE_SOAK_RESULTS")
    if not path:
        return
    row = (
        f"| {time.strftime('%Y-%m-%d')}, engine {fig['engine']} | {fig['requests']} | {fig['finished']} | "
        f"{fig['client_gone']} ({fig['cancels']} cancels, {fig['disconnects']} disconnects) | "
        f"{fig['rejected']} | {fig['lost']} | {fig['preemptions']} | {fig['generation_tokens']} | "
        f"{fig['wall_s']} | {fig['max_latency_s']} | {fig['rss_warm_mib']} -> {fig['rss_end_mib']} "
        f"(+{fig['rss_growth_mib']}) |\n"
    )
    with open(path, "a") as f:
        f.write(row)
