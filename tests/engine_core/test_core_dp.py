"""Data parallelism with the engine cores in their own processes: two core children behind one
front and its prefix-aware balancer; load splits, and one dead core leaves the other serving."""

from __future__ import annotations

import json
import os
import signal
import threading

import psutil
from ep_helpers import engine_config, http, metric, serve, wait_until

from xlaserve.engine.dp import DataParallelAsyncLLM, build_async_engine


def test_dp_ranks_are_core_processes(model_path: str) -> None:
    eng = build_async_engine(engine_config(model_path, data_parallel_size=2), engine_process=True)
    assert isinstance(eng, DataParallelAsyncLLM)
    gen = serve(eng, owns_engine=True)  # type: ignore[arg-type]
    srv = next(gen)
    try:
        pids = [r.core_pid for r in eng.replicas]
        kids = {p.pid for p in psutil.Process(os.getpid()).children()}
        assert len(set(pids)) == 2 and set(pids) <= kids
        results: list = []

        def one(i: int) -> None:
            # The number first: prompts that shared a first block ("rank test ...") all went
            # to that block's replica by prefix affinity (up to max_imbalance), not by load.
            body = {"prompt": f"{i} rank test " * (i + 1), "max_tokens": 16, "ignore_eos": True}
            status, _, data = http("POST", srv.base_url + "/v1/completions", body)
            results.append((status, json.loads(data)))

        # Concurrent, distinct prompts: placed by load (in flight), so both ranks get some.
        threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(results) == 12
        assert all(s == 200 and d["usage"]["completion_tokens"] == 16 for s, d in results)
        assert all(n > 0 for n in eng.balancer.routed), eng.balancer.routed
        # Rank 0's core dies: the front notices, rank 1 keeps serving, /health stays 200.
        os.kill(pids[0], signal.SIGKILL)
        assert wait_until(lambda: eng.replicas[0].errored, timeout=10)
        assert not eng.errored
        assert http("GET", srv.base_url + "/health")[0] == 200
        for i in range(4):
            body = {"prompt": f"after {i}", "max_tokens": 3, "ignore_eos": True}
            status, _, data = http("POST", srv.base_url + "/v1/completions", body)
            assert status == 200, data
        m = http("GET", srv.base_url + "/metrics")[2].decode()
        up = [ln for ln in m.splitlines() if ln.startswith("xlaserve:dp_replica_up{")]
        assert sorted(float(ln.rsplit(" ", 1)[1]) for ln in up) == [0.0, 1.0], up
        assert metric(m, "xlaserve:num_requests_running") == 0
    finally:
        gen.close()
    assert wait_until(lambda: not psutil.pid_exists(pids[1]) or
                      psutil.Process(pids[1]).status() == psutil.STATUS_ZOMBIE, timeout=30)  # fmt: skip
