"""Metric arithmetic on hand-built request outputs, and the SSE line splitter."""

from __future__ import annotations

import pytest

from xlaserve.bench.metrics import calculate_metrics, parse_goodput
from xlaserve.bench.request_funcs import RequestFuncOutput, iter_sse_data


def _out(
    ttft: float, latency: float, n: int, prompt_len: int = 10, ok: bool = True
) -> RequestFuncOutput:
    return RequestFuncOutput(
        success=ok,
        latency=latency,
        ttft=ttft,
        itl=[(latency - ttft) / max(n - 1, 1)] * (n - 1),
        prompt_len=prompt_len,
        output_tokens=n,
        generated_text="x" * n,
        error="" if ok else "HTTP 500: boom",
    )


def test_tpot_throughput_and_failures() -> None:
    outs = [
        _out(0.1, 1.1, 11, prompt_len=7),  # tpot 100 ms
        _out(0.3, 0.7, 5, prompt_len=9),  # tpot 100 ms
        _out(0.2, 0.2, 1, prompt_len=4),  # one token: no tpot
        _out(0.0, 0.05, 0, prompt_len=100, ok=False),
    ]
    m, lens = calculate_metrics(outs, duration=2.0, percentiles=[50, 99])
    assert (m.completed, m.failed) == (3, 1)
    assert lens == [11, 5, 1, 0]
    assert m.total_input == 7 + 9 + 4  # failed request's prompt left out
    assert m.total_output == 17
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(8.5)
    assert m.total_token_throughput == pytest.approx((20 + 17) / 2.0)
    assert m.tpots_ms == pytest.approx([100.0, 100.0])
    assert m.stats["ttft"]["mean"] == pytest.approx(200.0)
    assert m.stats["ttft"]["median"] == pytest.approx(200.0)
    assert m.stats["e2el"]["p99"] <= 1100.0 and m.stats["e2el"]["p50"] == pytest.approx(700.0)
    assert len(m.itls_ms) == 10 + 4
    assert m.request_goodput is None


def test_goodput_counts_requests_meeting_all_slos() -> None:
    outs = [_out(0.1, 1.1, 11), _out(0.3, 0.7, 5), _out(0.05, 0.45, 5)]  # tpot 100, 100, 100
    m, _ = calculate_metrics(outs, 1.0, goodput=parse_goodput("ttft:150,tpot:120"))
    assert m.request_goodput == pytest.approx(2.0)
    m, _ = calculate_metrics(outs, 1.0, goodput=parse_goodput("ttft:150,e2el:1000"))
    assert m.request_goodput == pytest.approx(1.0)
    with pytest.raises(ValueError):
        parse_goodput("itl:3")
    with pytest.raises(ValueError):
        parse_goodput("ttft:-1")


def test_token_count_fallbacks() -> None:
    a = RequestFuncOutput(
        success=True, latency=1.0, ttft=0.1, generated_text="a b c d", num_chunks=2
    )
    m, lens = calculate_metrics([a], 1.0, count=lambda s: len(s.split()))
    assert lens == [4]
    m, lens = calculate_metrics([a], 1.0, count=None)
    assert lens == [2]
    assert m.tpots_ms == pytest.approx([900.0])


def test_empty_and_all_failed() -> None:
    m, lens = calculate_metrics([_out(0, 0, 0, ok=False)] * 3, 1.0)
    assert (m.completed, m.failed, m.total_output) == (0, 3, 0)
    assert all(v == 0.0 for s in m.stats.values() for v in s.values())


def test_iter_sse_data_splits_lines_and_keeps_rest() -> None:
    buf = (
        'data: {"a": 1}\n\n: comment\nevent: x\r\ndata:{"b": 2}\r\n\r\ndata: [DONE]\n\ndata: {"par'
    )
    payloads, rest = iter_sse_data(buf)
    assert payloads == ['{"a": 1}', '{"b": 2}', "[DONE]"]
    assert rest == 'data: {"par'
    more, rest2 = iter_sse_data(rest + 'tial": 3}\n')
    assert more == ['{"partial": 3}'] and rest2 == ""
