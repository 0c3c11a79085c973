"""Data parallelism: two AsyncLLM replicas behind one server with the prefix-aware balancer.

- the balancer's ordering rules, worked by hand;
- a full replica is skipped (its request goes to the other one) and only when both are full is
  the request refused (EngineQueueFullError); every accepted request completes;
- over HTTP: DP 2 splits concurrent load (per-replica counts on /metrics with a `replica`
  label), 503s carry Retry-After, and retrying them loses no request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time

import pytest
from ep_helpers import engine_config, http, serve, slow_steps

from xlaserve.engine.async_llm import EngineQueueFullError
from xlaserve.engine.dp import DataParallelAsyncLLM, PrefixAwareBalancer, prefix_key
from xlaserve.sampling_params import SamplingParams


def test_balancer_orders_by_prefix_then_load() -> None:
    b = PrefixAwareBalancer(3, max_imbalance=2)
    k = prefix_key(list(range(8)), 4, 1, None)
    assert k == prefix_key(list(range(4)) + [99, 98], 4, 1, None)  # first block only
    assert prefix_key([1, 2, 3], 4, 1, None) is None  # no full block: nothing to route by
    assert prefix_key(list(range(8)), 4, 1, "salt") != k
    ok = [True, True, True]
    assert b.candidates(k, ok) == [0, 1, 2]  # all idle: lowest index first
    b.placed(0, k)
    b.placed(1, None)
    assert b.candidates(None, ok) == [2, 0, 1]  # least loaded first
    assert b.candidates(k, ok) == [0, 2, 1]  # the prefix's replica first
    assert b.candidates(k, [False, True, True]) == [2, 1]  # ...unless it cannot take it
    b.placed(0, k)
    b.placed(0, k)  # replica 0: 3 in flight, replica 2: 0 -> imbalance 3 > 2
    assert b.candidates(k, ok) == [2, 1, 0]
    assert b.prefix_routed == [2, 0, 0] and b.routed == [3, 1, 0]
    b.released(0)
    assert b.candidates(k, ok)[0] == 0


def _wait(cond, timeout: float = 60.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_full_replica_is_skipped_and_nothing_is_lost(tiny_model_dir) -> None:  # noqa: ANN001
    cfg = engine_config(
        tiny_model_dir("llama"), max_num_seqs=1, max_num_waiting=1, data_parallel_size=2
    )
    front = DataParallelAsyncLLM.from_config(cfg)
    r0, r1 = front.replicas
    assert r0.engine is not r1.engine
    for r in (r0, r1):  # 48 tokens take >= 1.4 s: the queues stay full while the test looks
        slow_steps(r, 0.03)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(10, 30))}  # one shared prefix for all

    async def run() -> dict[str, object]:
        streams = {}

        async def add(rid: str) -> object:
            s = await front.add_request(rid, prompt, params)
            streams[rid] = s
            return front._owner[rid]

        owner = {"a": await add("a")}
        _wait(lambda: r0.stats.num_running == 1)
        owner["b"] = await add("b")  # prefix affinity: replica 0, where it waits
        _wait(lambda: r0.stats.num_waiting == 1)
        owner["c"] = await add("c")  # replica 0 is full: the other one takes it
        _wait(lambda: r1.stats.num_running == 1)
        owner["d"] = await add("d")
        _wait(lambda: r1.stats.num_waiting == 1)
        with pytest.raises(EngineQueueFullError) as ei:
            await add("e")  # both full: refused (the server answers 503)
        assert ei.value.retry_after >= 1

        async def drain(s: object) -> list[int]:
            last = None
            async with contextlib.aclosing(front.iterate(s)) as it:
                async for out in it:
                    last = out
            assert last is not None and last.finished
            return list(last.outputs[0].token_ids)

        outs = await asyncio.gather(*(drain(s) for s in streams.values()))
        # After the queues drain, the refused request is accepted.
        late = [o async for o in front.generate(prompt, params, "e")][-1]
        return {"owner": owner, "outs": outs, "late": late}

    try:
        res = asyncio.run(run())
    finally:
        front.shutdown()
    assert res["owner"] == {"a": 0, "b": 0, "c": 1, "d": 1}
    outs = res["outs"]
    assert len(outs) == 4 and all(len(o) == 48 for o in outs)
    assert all(o == outs[0] for o in outs)  # same prompt, greedy: replicas agree
    assert res["late"].finished and list(res["late"].outputs[0].token_ids) == outs[0]
    assert front.rejected[0] >= 1 and front.rejected[1] >= 1
    assert front.balancer.in_flight == [0, 0]
    assert front.balancer.prefix_routed[0] == 1  # "b" followed "a"'s prefix


def _series(text: str, name: str) -> dict[str, float]:
    """replica label -> value of metric `name`."""
    out = {}
    for m in re.finditer(
        rf'^{re.escape(name)}\{{[^}}]*replica="(\d+)"[^}}]*\}} (\S+)$', text, re.M
    ):
        out[m.group(1)] = float(m.group(2))
    return out


def test_dp2_server_splits_load_and_loses_nothing(tiny_model_dir) -> None:  # noqa: ANN001
    cfg = engine_config(
        tiny_model_dir("llama"), max_num_seqs=2, max_num_waiting=2, data_parallel_size=2
    )
    front = DataParallelAsyncLLM.from_config(cfg)
    n = 16
    results: dict[int, tuple[int, int, str]] = {}  # i -> (status, attempts, text)
    retry_after: list[str] = []
    lock = threading.Lock()
    gen = serve(front)  # type: ignore[arg-type]
    srv = next(gen)
    try:

        def client(i: int) -> None:
            body = {
                "model": "tiny",
                # distinct first blocks: prefix affinity does not pin them together
                "prompt": [i + 5, 7, 11, 13, 17, 19, 23],
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
            }
            for attempt in range(1, 200):
                status, headers, raw = http("POST", srv.base_url + "/v1/completions", body)
                if status == 503:
                    with lock:
                        retry_after.append(headers.get("Retry-After", ""))
                    time.sleep(0.1)
                    continue
                text = json.loads(raw)["choices"][0]["text"] if status == 200 else raw.decode()
                with lock:
                    results[i] = (status, attempt, text)
                return
            with lock:
                results[i] = (0, attempt, "gave up")

        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        status, _, raw = http("GET", srv.base_url + "/metrics")
        assert status == 200
        metrics = raw.decode()
        health, _, _ = http("GET", srv.base_url + "/health")
        assert health == 200
    finally:
        gen.close()
        front.shutdown()
    assert sorted(results) == list(range(n))
    assert all(s == 200 for s, _, _ in results.values()), results  # zero lost
    routed = _series(metrics, "xlaserve:dp_requests_routed_total")
    assert set(routed) == {"0", "1"}
    assert routed["0"] > 0 and routed["1"] > 0  # both replicas served
    assert routed["0"] + routed["1"] == n  # each request placed exactly once
    assert _series(metrics, "xlaserve:dp_replica_up") == {"0": 1.0, "1": 1.0}
    assert all(v == 0 for v in _series(metrics, "xlaserve:dp_requests_in_flight").values())
    refused = sum(_series(metrics, "xlaserve:dp_requests_rejected_full_total").values())
    # Every 503 carried Retry-After; a 503 only happened with both replicas full.
    assert all(r.isdigit() and int(r) >= 1 for r in retry_after)
    assert refused >= len(retry_after)
    print(f"dp2: routed {routed}, 503s retried {len(retry_after)}")
