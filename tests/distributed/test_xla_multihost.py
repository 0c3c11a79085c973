"""XLA multi-host on the CPU: two processes (1 host device each, gloo collectives) joined by
jax.distributed run one engine (host 0) with TP 2 across the processes and give the greedy
tokens of one process; plus the step channel (host 0 -> followers) and the follower loop."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
from tiny_models import hf_greedy

from xlaserve.backends_xla.multihost import (
    EXECUTE,
    STOP,
    StepReceiver,
    StepSender,
    follower_loop,
    init_multihost,
)
from xlaserve.config import EngineConfig, ParallelConfig
from xlaserve.runner import NewRequestData, SchedulerOutput
from xlaserve.sampling_params import SamplingParams

WORKER = os.path.join(os.path.dirname(__file__), "xla_multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_two_processes_match_single_process(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    path, cache = tiny_model_dir("llama"), str(tmp_path / "jax-cache")
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, path, cache, str(rank), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        (out0, err0), (out1, err1) = (p.communicate(timeout=600) for p in procs)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 0, err0[-3000:]
    assert procs[1].returncode == 0, err1[-3000:]
    single = subprocess.run(
        [sys.executable, WORKER, path, cache, "single"], capture_output=True, text=True, timeout=600
    )
    assert single.returncode == 0, single.stderr[-3000:]
    (ref,) = _json_lines(single.stdout)
    (got,) = _json_lines(out0)
    assert not _json_lines(out1)  # the follower's LLM(...) never returned: host 0 alone answers
    assert got["tokens"] == ref["tokens"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 384, n).tolist() for n in (7, 20, 3)]
    assert ref["tokens"] == hf_greedy(path, prompts, 6)
    # TP 2 across the two processes: each holds half of q_proj's rows.
    assert got["processes"] == 2 and got["devices"] == 2 and ref["processes"] == 1
    assert got["q_spec"][0] == "model" and got["q_local_rows"] == [got["q_rows"] // 2]
    assert got["num_kv_blocks"] == ref["num_kv_blocks"] > 0  # same budget, agreed over hosts
    # The follower ran host 0's steps and was stopped by host 0's exit hook (no shutdown call).
    assert "follower 1: ran" in err1 and "ran 0 steps" not in err1


def _so(i: int) -> SchedulerOutput:
    return SchedulerOutput(
        new_requests=[NewRequestData(f"r{i}", [1, 2, 3], 3, SamplingParams(seed=i), [i], 0)],
        num_scheduled_tokens={f"r{i}": 3},
        total_num_scheduled_tokens=3,
        grammar_bitmask={f"r{i}": np.full((1, 12), i, np.int32)},
    )


def _connect(num: int, token: str | None = None) -> tuple[StepSender, list[StepReceiver]]:
    sender = StepSender(num, bind="127.0.0.1")
    t = threading.Thread(target=sender.accept, kwargs={"timeout": 30})
    t.start()
    receivers = [
        StepReceiver("127.0.0.1", sender.port, token or sender.token, pid + 1) for pid in range(num)
    ]
    t.join()
    return sender, receivers


def test_step_channel_delivers_in_order_to_every_follower() -> None:
    sender, receivers = _connect(2)
    for i in range(3):
        sender.send(EXECUTE, _so(i))
    sender.send(STOP)
    for rx in receivers:
        for i in range(3):
            kind, so = rx.recv()
            assert kind == EXECUTE and so.new_requests[0].req_id == f"r{i}"
            assert so.new_requests[0].sampling_params.seed == i
            np.testing.assert_array_equal(so.grammar_bitmask[f"r{i}"], np.full((1, 12), i))
        assert rx.recv() == (STOP, None)
        rx.close()
    sender.close()


def test_step_channel_drops_a_bad_token_and_reports_a_lost_leader() -> None:
    sender = StepSender(1, bind="127.0.0.1")
    t = threading.Thread(target=sender.accept, kwargs={"timeout": 30})
    t.start()
    intruder = StepReceiver("127.0.0.1", sender.port, "0" * 32, 7)
    good = StepReceiver("127.0.0.1", sender.port, sender.token, 1)
    t.join()
    assert list(sender._conns) == [1]  # only the follower with the token
    sender.send(EXECUTE, _so(0))
    assert good.recv()[1].new_requests[0].req_id == "r0"
    with pytest.raises(ConnectionError):  # the intruder was closed without a message
        intruder.recv()
    sender.close()  # host 0 gone without STOP
    with pytest.raises(ConnectionError, match="closed the step channel"):
        good.recv()


def test_step_channel_accept_times_out_with_missing_followers() -> None:
    sender = StepSender(1, bind="127.0.0.1")
    with pytest.raises(TimeoutError, match="0 of 1 follower hosts"):
        sender.accept(timeout=0.2)


class _Recorder:
    """Stands in for the runner in the loop: records each SchedulerOutput it is asked to run."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def execute(self, so: SchedulerOutput) -> None:
        self.seen.append(so.new_requests[0].req_id)
        if so.new_requests[0].req_id == "r1":
            raise ValueError("a step that fails on every host")


def test_follower_loop_runs_until_stop() -> None:
    sender, (rx,) = _connect(1)
    for i in range(3):
        sender.send(EXECUTE, _so(i))
    sender.send(STOP)
    runner = _Recorder()
    assert follower_loop(runner, rx) == 3  # the failing step is logged, the loop goes on
    assert runner.seen == ["r0", "r1", "r2"]
    sender.close()
    rx.close()


def test_multihost_config() -> None:
    assert init_multihost(EngineConfig()) is None  # one host: jax.distributed untouched
    with pytest.raises(ValueError, match="KV offload"):
        init_multihost(EngineConfig.from_kwargs(nnodes=2, kv_offload_bytes=1 << 20))
    with pytest.raises(ValueError, match="node_rank must be in"):
        ParallelConfig(nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="data_parallel_size"):
        ParallelConfig(nnodes=2, data_parallel_size=2)
