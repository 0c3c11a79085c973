"""bench/timing.py on the CPU: every call runs once to warm up and then once per rep, the result is
per call (the wall time of the calls divided by their count), and an empty call list is an error."""

from __future__ import annotations

import time

import pytest

from xlaserve.bench.timing import event_time_us, graph_time_us


def test_graph_time_us_runs_each_call_and_divides() -> None:
    ran = [0, 0]

    def one() -> None:
        ran[0] += 1
        time.sleep(0.002)

    def two() -> None:
        ran[1] += 1

    us = graph_time_us([one, two], reps=3, cuda=False)
    assert ran == [4, 4]  # one warm-up + three timed rounds each
    # Per call: the round (>= 2 ms, the sleep) over two calls, so at least ~1 ms each.
    assert us >= 1000.0
    with pytest.raises(ValueError, match="no calls"):
        graph_time_us([], reps=1)


def test_event_time_us_warmup_and_reps() -> None:
    ran = [0]

    def fn() -> None:
        ran[0] += 1

    assert event_time_us(fn, reps=5, warmup=2, cuda=False) >= 0.0
    assert ran[0] == 7
