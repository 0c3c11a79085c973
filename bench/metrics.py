"""Serving metrics from a list of `RequestFuncOutput`s, and request arrival schedules.

Definitions (times in ms in the results):
- TTFT: request sent -> first generated text chunk.
- TPOT: (e2e latency - TTFT) / (output_tokens - 1), for requests with more than one output token.
- ITL: gaps between successive text chunks, all requests pooled.
- E2EL: request sent -> stream ended.
- goodput: completed requests per second that met every SLO given (`ttft:MS,tpot:MS,e2el:MS`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from xlaserve.bench.request_funcs import RequestFuncOutput

METRICS = ("ttft", "tpot", "itl", "e2el")


def request_intervals(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Seconds to wait before each request (the first is 0 + its own draw).

    Gamma-distributed gaps with shape `burstiness` and mean 1 / request_rate: burstiness 1 is a
    Poisson process (exponential gaps), < 1 burstier, > 1 more uniform. request_rate inf -> all
    gaps 0 (everything at once).
    """
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (inf for all at once), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if np.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [float(x) for x in rng.gamma(shape=burstiness, scale=theta, size=num_requests)]


def parse_goodput(spec: str | None) -> dict[str, float]:
    """'ttft:200,tpot:50' -> {'ttft': 200.0, 'tpot': 50.0} (milliseconds)."""
    if not spec:
        return {}
    slos: dict[str, float] = {}
    for part in spec.replace(" ", ",").split(","):
        if not part:
            continue
        name, sep, value = part.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"bad --goodput item {part!r}: expected ttft|tpot|e2el:MILLISECONDS")
        ms = float(value)
        if ms <= 0:
            raise ValueError(f"--goodput {name} must be positive, got {value}")
        slos[name] = ms
    return slos


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    # metric name -> {"mean": .., "median": .., "std": .., "p99": ..} in ms
    stats: dict[str, dict[str, float]] = field(default_factory=dict)
    # per request, in ms (tpot only where defined)
    ttfts_ms: list[float] = field(default_factory=list)
    tpots_ms: list[float] = field(default_factory=list)
    e2els_ms: list[float] = field(default_factory=list)
    itls_ms: list[float] = field(default_factory=list)


def output_token_count(out: RequestFuncOutput, count: Callable[[str], int] | None) -> int:
    """The server's usage count, else a tokenizer count of the text, else the chunk count."""
    if out.output_tokens is not None:
        return out.output_tokens
    if count is not None:
        return count(out.generated_text)
    return out.num_chunks


def _fmt_pct(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p).replace(".", "_")


def _stats(values_ms: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values_ms, dtype=np.float64)
    if arr.size == 0:
        arr = np.zeros(1)
    res = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        res[f"p{_fmt_pct(p)}"] = float(np.percentile(arr, p))
    return res


def calculate_metrics(
    outputs: Sequence[RequestFuncOutput],
    duration: float,
    count: Callable[[str], int] | None = None,
    percentiles: Sequence[float] = (50, 90, 99),
    goodput: dict[str, float] | None = None,
) -> tuple[BenchmarkMetrics, list[int]]:
    """Aggregate per-request outputs; returns (metrics, output token count per request).

    Failed requests count in `failed` only: their tokens and times are left out of every total.
    """
    output_lens: list[int] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    e2els: list[float] = []
    itls: list[float] = []
    total_input = 0
    completed = 0
    good = 0
    for out in outputs:
        if not out.success:
            output_lens.append(0)
            continue
        n_out = output_token_count(out, count)
        output_lens.append(n_out)
        completed += 1
        total_input += out.prompt_len or 0
        ttft_ms = out.ttft * 1000.0
        e2el_ms = out.latency * 1000.0
        tpot_ms = (out.latency - out.ttft) / (n_out - 1) * 1000.0 if n_out > 1 else None
        ttfts.append(ttft_ms)
        e2els.append(e2el_ms)
        itls.extend(x * 1000.0 for x in out.itl)
        if tpot_ms is not None:
            tpots.append(tpot_ms)
        if goodput:
            ok = ttft_ms <= goodput.get("ttft", float("inf"))
            ok = ok and e2el_ms <= goodput.get("e2el", float("inf"))
            ok = ok and (tpot_ms or 0.0) <= goodput.get("tpot", float("inf"))
            good += int(ok)
    total_output = sum(output_lens)
    duration = max(duration, 1e-9)
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    metrics = BenchmarkMetrics(
        completed=completed,
        failed=len(outputs) - completed,
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / duration,
        request_goodput=good / duration if goodput else None,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        stats={m: _stats(series[m], percentiles) for m in METRICS},
        ttfts_ms=ttfts,
        tpots_ms=tpots,
        e2els_ms=e2els,
        itls_ms=itls,
    )
    return metrics, output_lens
