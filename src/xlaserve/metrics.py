"""Prometheus metrics of one server (`GET /metrics`).

Each app owns a `CollectorRegistry` (never the global one) so tests can build several apps.
Engine-wide numbers (queue lengths, KV usage, token totals) are read from the engine's latest
`EngineStats` snapshot at scrape time by a custom collector; per-request latencies are observed
into histograms when a request finishes (`ServerMetrics.observe_request`).

Names (`xlaserve:` prefix; counters get `_total` appended on exposition):
  gauges      num_requests_running, num_requests_waiting, kv_cache_usage_perc,
              spec_decode_acceptance_rate (accepted / draft tokens),
              spec_decode_mean_acceptance_length (tokens per verification: 1 + accepted / drafts)
  counters    prefix_cache_queries, prefix_cache_hits, num_preemptions, prompt_tokens,
              kv_offload_host_hits, kv_offload_bytes_out, kv_offload_bytes_in,
              generation_tokens, spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens,
              spec_decode_num_drafts (verifications with drafts), request_success{finished_reason}
  histograms  time_to_first_token_seconds, time_per_output_token_seconds,
              e2e_request_latency_seconds, request_prompt_tokens, request_generation_tokens,
              inter_token_latency_seconds, request_queue_time_seconds,
              request_prefill_time_seconds, request_decode_time_seconds,
              request_inference_time_seconds, request_params_n,
              iteration_tokens_total (tokens per engine step, from the stats snapshot)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
_E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    300.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclass
class RequestRecord:
    """Timings of one finished request, measured by the frontend (monotonic seconds)."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    # Engine-side times (RequestMetrics; same monotonic clock): None when unknown.
    first_scheduled_time: float | None = None
    last_token_time: float | None = None
    engine_first_token_time: float | None = None
    n: int = 1  # sequences of the request (SamplingParams.n)
    inter_token_latencies: list[float] = field(default_factory=list)


class _EngineStatsCollector(Collector):
    """Reads the engine's stats snapshot at scrape time (no per-step bookkeeping here)."""

    def __init__(self, get_stats: Callable[[], Any | None], model_name: str) -> None:
        self._get_stats = get_stats
        self._model = model_name

    def collect(self) -> Iterator[Any]:
        s = self._get_stats()
        if s is None:
            return
        labels = ["model_name"]
        gauges = [
            (
                "xlaserve:num_requests_running",
                "Sequences running (scheduled each step).",
                s.num_running,
            ),
            ("xlaserve:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting),
            (
                "xlaserve:kv_cache_usage_perc",
                "Fraction of KV blocks in use (0..1).",
                s.kv_cache_usage,
            ),
            ("xlaserve:num_kv_blocks", "KV cache blocks in total.", s.num_total_blocks),
            (
                "xlaserve:num_free_kv_blocks",
                "KV cache blocks free (includes evictable cached ones).",
                s.num_free_blocks,
            ),
        ]
        num_drafts = getattr(s, "spec_num_drafts", 0)
        if num_drafts:  # only once speculative decoding has run
            gauges += [
                (
                    "xlaserve:spec_decode_acceptance_rate",
                    "Accepted / proposed draft tokens (speculative decoding).",
                    s.spec_num_accepted_tokens / max(s.spec_num_draft_tokens, 1),
                ),
                (
                    "xlaserve:spec_decode_mean_acceptance_length",
                    "Mean tokens emitted per verification with drafts (1 + accepted / drafts).",
                    1.0 + s.spec_num_accepted_tokens / num_drafts,
                ),
            ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self._model], float(value))
            yield g
        counters = [
            (
                "xlaserve:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_cache_queries,
            ),
            (
                "xlaserve:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                s.prefix_cache_hits,
            ),
            (
                "xlaserve:num_preemptions",
                "Preemptions (recompute) so far.",
                s.num_preemptions_total,
            ),
            (
                "xlaserve:kv_offload_host_hits",
                "Prompt tokens whose KV was reloaded from the host tier instead of recomputed.",
                getattr(s, "kv_offload_host_hits", 0),
            ),
            (
                "xlaserve:kv_offload_bytes_out",
                "KV bytes copied device -> host tier.",
                getattr(s, "kv_offload_bytes_out", 0),
            ),
            (
                "xlaserve:kv_offload_bytes_in",
                "KV bytes copied host tier -> device.",
                getattr(s, "kv_offload_bytes_in", 0),
            ),
            (
                "xlaserve:prompt_tokens",
                "Prompt tokens of finished requests.",
                s.prompt_tokens_total,
            ),
            ("xlaserve:generation_tokens", "Tokens generated.", s.generation_tokens_total),
            (
                "xlaserve:spec_decode_num_draft_tokens",
                "Draft tokens proposed.",
                s.spec_num_draft_tokens,
            ),
            (
                "xlaserve:spec_decode_num_accepted_tokens",
                "Draft tokens accepted.",
                s.spec_num_accepted_tokens,
            ),
            (
                "xlaserve:spec_decode_num_drafts",
                "Verifications (request, step) that had draft tokens.",
                num_drafts,
            ),
        ]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self._model], float(value))
            yield c
        counts = getattr(s, "iteration_tokens_buckets", None)
        if counts:
            from xlaserve.engine.core import ITERATION_TOKEN_BUCKETS

            h = HistogramMetricFamily(
                "xlaserve:iteration_tokens_total",
                "Tokens computed per engine step.",
                labels=labels,
            )
            bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
            cum, buckets = 0, []
            for bound, n in zip(bounds, counts, strict=True):
                cum += n
                buckets.append((bound, float(cum)))
            h.add_metric([self._model], buckets, float(s.iteration_tokens_sum))
            yield h


class ServerMetrics:
    """All metrics of one app, in their own registry."""

    def __init__(self, get_stats: Callable[[], Any | None], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineStatsCollector(get_stats, model_name))
        lab = ["model_name"]
        r = self.registry
        self.ttft = Histogram(
            "xlaserve:time_to_first_token_seconds",
            "Time to first token.",
            lab,
            registry=r,
            buckets=_TTFT_BUCKETS,
        )
        self.tpot = Histogram(
            "xlaserve:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            lab,
            registry=r,
            buckets=_TPOT_BUCKETS,
        )
        self.e2e = Histogram(
            "xlaserve:e2e_request_latency_seconds",
            "Request latency.",
            lab,
            registry=r,
            buckets=_E2E_BUCKETS,
        )
        self.req_prompt = Histogram(
            "xlaserve:request_prompt_tokens",
            "Prompt tokens per request.",
            lab,
            registry=r,
            buckets=_TOKEN_BUCKETS,
        )
        self.req_gen = Histogram(
            "xlaserve:request_generation_tokens",
            "Generated tokens per request.",
            lab,
            registry=r,
            buckets=_TOKEN_BUCKETS,
        )
        self.itl = Histogram(
            "xlaserve:inter_token_latency_seconds",
            "Time between successive token deliveries of a request.",
            lab,
            registry=r,
            buckets=_TPOT_BUCKETS,
        )
        phase = (
            ("queue", "Time waiting before the request was first scheduled."),
            ("prefill", "Time from first scheduled to first token."),
            ("decode", "Time from first token to last token."),
            ("inference", "Time from first scheduled to last token."),
        )
        self.phases = {
            name: Histogram(
                f"xlaserve:request_{name}_time_seconds",
                doc,
                lab,
                registry=r,
                buckets=_E2E_BUCKETS,
            )
            for name, doc in phase
        }
        self.params_n = Histogram(
            "xlaserve:request_params_n",
            "The n parameter of requests.",
            lab,
            registry=r,
            buckets=(1, 2, 5, 10, 20),
        )
        self.success = Counter(
            "xlaserve:request_success",
            "Finished requests by finish reason.",
            lab + ["finished_reason"],
            registry=r,
        )

    def observe_request(self, rec: RequestRecord) -> None:
        m = self.model_name
        self.success.labels(m, rec.finish_reason).inc()
        if rec.finish_reason in ("abort", "error"):
            return  # latencies of cut-short requests would skew the histograms
        self.e2e.labels(m).observe(rec.finished_time - rec.arrival_time)
        self.req_prompt.labels(m).observe(rec.num_prompt_tokens)
        self.req_gen.labels(m).observe(rec.num_generation_tokens)
        self.params_n.labels(m).observe(rec.n)
        for gap in rec.inter_token_latencies:
            self.itl.labels(m).observe(gap)
        sched, first, last = (
            rec.first_scheduled_time,
            rec.engine_first_token_time,
            rec.last_token_time,
        )
        if sched is not None:
            self.phases["queue"].labels(m).observe(max(sched - rec.arrival_time, 0.0))
            if first is not None:
                self.phases["prefill"].labels(m).observe(max(first - sched, 0.0))
            if last is not None:
                self.phases["inference"].labels(m).observe(max(last - sched, 0.0))
        if first is not None and last is not None:
            self.phases["decode"].labels(m).observe(max(last - first, 0.0))
        if rec.first_token_time is not None:
            self.ttft.labels(m).observe(rec.first_token_time - rec.arrival_time)
            if rec.num_generation_tokens > 1:
                per = (rec.finished_time - rec.first_token_time) / (rec.num_generation_tokens - 1)
                self.tpot.labels(m).observe(per)

    def render(self) -> bytes:
        return generate_latest(self.registry)
