"""`xlaserve bench serve`: load an OpenAI-compatible server and measure it.

Requests are sent on a schedule (`request_rate`, `burstiness`), at most `max_concurrency` at once,
streamed and timed by the request functions of `request_funcs.py`; the results are aggregated by
`metrics.py`, printed as a table and written as JSON with the keys of vLLM's `bench serve`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import aiohttp
from tqdm.asyncio import tqdm

from xlaserve.bench.datasets import BenchTokenizer, SampleRequest, get_samples
from xlaserve.bench.metrics import (
    METRICS,
    BenchmarkMetrics,
    calculate_metrics,
    parse_goodput,
    request_intervals,
)
from xlaserve.bench.request_funcs import (
    AIOHTTP_TIMEOUT,
    ENDPOINT_BACKENDS,
    REQUEST_FUNCS,
    RequestFuncInput,
    RequestFuncOutput,
)


@dataclass
class ServeBenchConfig:
    """Flags of `xlaserve bench serve`, one field each."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None = the first id of GET /v1/models
    endpoint: str = "/v1/completions"
    backend: str | None = None  # None = from the endpoint
    dataset: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 100
    input_len: int = 128
    output_len: int | None = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_prefixes: int = 4
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    output_json: str | None = None
    percentile_metrics: list[str] = field(default_factory=lambda: list(METRICS))
    metric_percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    goodput: str | None = None
    tokenizer: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    api_key: str | None = None
    plot: str | None = None
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if self.backend is None:
            if self.endpoint not in ENDPOINT_BACKENDS:
                raise ValueError(
                    f"cannot infer --backend from endpoint {self.endpoint!r}; pass --backend"
                )
            self.backend = ENDPOINT_BACKENDS[self.endpoint]
        if self.backend not in REQUEST_FUNCS:
            raise ValueError(
                f"unknown backend {self.backend!r}; choose from {sorted(REQUEST_FUNCS)}"
            )
        bad = [m for m in self.percentile_metrics if m not in METRICS]
        if bad:
            raise ValueError(f"unknown percentile metric(s) {bad}; choose from {METRICS}")
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        parse_goodput(self.goodput)  # validates

    @property
    def api_url(self) -> str:
        base = self.base_url.rstrip("/")
        if base.endswith("/v1") and self.endpoint.startswith("/v1/"):
            base = base[: -len("/v1")]
        return base + self.endpoint

    @property
    def root_url(self) -> str:
        base = self.base_url.rstrip("/")
        return base[: -len("/v1")] if base.endswith("/v1") else base


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class BenchError(Exception):
    """A benchmark that cannot start (the CLI prints the message, no traceback)."""


async def _first_model(session: aiohttp.ClientSession, cfg: ServeBenchConfig) -> str:
    url = cfg.root_url + "/v1/models"
    try:
        async with session.get(url, headers=_headers(cfg.api_key)) as resp:
            resp.raise_for_status()
            data = await resp.json()
        return data["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as e:
        raise BenchError(f"could not get a model name from {url} ({e}); pass --model") from e


class ServerTokenCounter:
    """Counts tokens with the server's `/tokenize` (`{"model", "prompt"}` -> `{"count"|"tokens"}`)."""

    def __init__(self, session: aiohttp.ClientSession, cfg: ServeBenchConfig, model: str) -> None:
        self.session, self.url, self.model, self.api_key = (
            session,
            cfg.root_url + "/tokenize",
            model,
            cfg.api_key,
        )

    async def count(self, text: str) -> int | None:
        """Token count, or None when the server has no usable /tokenize."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        try:
            async with self.session.post(self.url, json=body, headers=_headers(self.api_key)) as r:
                if r.status != 200:
                    return None
                data = await r.json()
        except (aiohttp.ClientError, ValueError, asyncio.TimeoutError):
            return None
        if isinstance(data.get("count"), int):
            return data["count"]
        if isinstance(data.get("tokens"), list):
            return len(data["tokens"])
        return None


async def _run(
    cfg: ServeBenchConfig, samples: list[SampleRequest], tokenizer: BenchTokenizer | None
) -> tuple[list[RequestFuncOutput], float, str, Callable[[str], int] | None]:
    """Send every sample on schedule; returns (outputs, duration s, model, sync token counter)."""
    request_func = REQUEST_FUNCS[cfg.backend or "openai"]
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0, force_close=False)
    async with aiohttp.ClientSession(
        timeout=AIOHTTP_TIMEOUT, connector=connector, trust_env=True
    ) as session:
        model = cfg.model or await _first_model(session, cfg)
        server_counter = None if tokenizer is not None else ServerTokenCounter(session, cfg, model)
        if server_counter is not None and any(s.prompt_len is None for s in samples):
            # Exact prompt lengths from the server when it can tokenize; else usage fills them.
            for s in samples:
                s.prompt_len = await server_counter.count(s.prompt)
                if s.prompt_len is None:
                    break
        intervals = request_intervals(len(samples), cfg.request_rate, cfg.burstiness, cfg.seed)
        sema = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        pbar = None if cfg.disable_tqdm else tqdm(total=len(samples), desc="requests")

        async def one(s: SampleRequest) -> RequestFuncOutput:
            inp = RequestFuncInput(
                prompt=s.prompt,
                api_url=cfg.api_url,
                prompt_len=s.prompt_len,
                output_len=s.expected_output_len,
                model=model,
                ignore_eos=cfg.ignore_eos,
                temperature=cfg.temperature,
                api_key=cfg.api_key,
            )
            if sema is None:
                return await request_func(inp, session, pbar)
            async with sema:
                return await request_func(inp, session, pbar)

        start = time.perf_counter()
        tasks = []
        due = 0.0
        for i, s in enumerate(samples):
            if i > 0:
                due += intervals[i]
                delay = start + due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(s)))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        if pbar is not None:
            pbar.close()

        count: Callable[[str], int] | None = tokenizer.count if tokenizer is not None else None
        if server_counter is not None and any(
            o.success and o.output_tokens is None for o in outputs
        ):
            # No usage in the stream: count the generated text with the server's tokenizer.
            counts: dict[int, int] = {}
            for i, o in enumerate(outputs):
                if o.success and o.output_tokens is None:
                    n = await server_counter.count(o.generated_text)
                    if n is None:
                        break
                    counts[i] = n
            for i, n in counts.items():
                outputs[i].output_tokens = n
    return outputs, duration, model, count


def _fmt_pct(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p).replace(".", "_")


def build_result(
    cfg: ServeBenchConfig,
    model: str,
    outputs: list[RequestFuncOutput],
    duration: float,
    metrics: BenchmarkMetrics,
    output_lens: list[int],
) -> dict[str, Any]:
    """The JSON document (vLLM `bench serve` keys, plus a few of ours)."""
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": cfg.backend,
        "endpoint": cfg.endpoint,
        "model_id": model,
        "tokenizer_id": cfg.tokenizer,
        "dataset": cfg.dataset,
        "num_prompts": len(outputs),
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "duration": duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "goodput_slos_ms": parse_goodput(cfg.goodput) or None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
    }
    for m in cfg.percentile_metrics:
        st = metrics.stats[m]
        result[f"mean_{m}_ms"] = st["mean"]
        result[f"median_{m}_ms"] = st["median"]
        result[f"std_{m}_ms"] = st["std"]
        for p in cfg.metric_percentiles:
            result[f"p{_fmt_pct(p)}_{m}_ms"] = st[f"p{_fmt_pct(p)}"]
    result.update(
        {
            "input_lens": [o.prompt_len or 0 for o in outputs],
            "output_lens": output_lens,
            "ttfts": [o.ttft for o in outputs],
            "itls": [o.itl for o in outputs],
            "e2els": [o.latency for o in outputs],
            "generated_texts": [o.generated_text for o in outputs],
            "errors": [o.error for o in outputs],
        }
    )
    return result


def format_summary(cfg: ServeBenchConfig, result: dict[str, Any]) -> str:
    """The human-readable table printed at the end of a run."""
    width = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=width, c="=")]

    def row(name: str, value: Any, fmt: str = "") -> None:
        text = format(value, fmt) if value is not None else "n/a"
        lines.append(f"{name:<40} {text:>{width - 41}}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    row("Maximum request concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for m in cfg.percentile_metrics:
        lines.append("{s:{c}^{n}}".format(s=f" {titles[m]} ", n=width, c="-"))
        row(f"Mean {m.upper()} (ms):", result[f"mean_{m}_ms"], ".2f")
        row(f"Median {m.upper()} (ms):", result[f"median_{m}_ms"], ".2f")
        for p in cfg.metric_percentiles:
            row(f"P{p:g} {m.upper()} (ms):", result[f"p{_fmt_pct(p)}_{m}_ms"], ".2f")
    lines.append("=" * width)
    errors = [e for e in result["errors"] if e]
    if errors:
        lines.append(f"first error ({len(errors)} failed): {errors[0][:300]}")
    return "\n".join(lines)


def run_serve_benchmark(
    cfg: ServeBenchConfig, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the whole benchmark; returns the JSON document (also written to cfg.output_json)."""
    tokenizer = BenchTokenizer(cfg.tokenizer) if cfg.tokenizer else None
    samples = get_samples(
        cfg.dataset,
        cfg.num_prompts,
        tokenizer,
        dataset_path=cfg.dataset_path,
        input_len=cfg.input_len,
        output_len=cfg.output_len,
        range_ratio=cfg.range_ratio,
        prefix_len=cfg.prefix_len,
        num_prefixes=cfg.num_prefixes,
        seed=cfg.seed,
    )
    if tokenizer is None and cfg.dataset == "random":
        # Random words are only an estimate of the length; let the server count when it can.
        for s in samples:
            s.prompt_len = None
    outputs, duration, model, count = asyncio.run(_run(cfg, samples, tokenizer))
    metrics, output_lens = calculate_metrics(
        outputs, duration, count, cfg.metric_percentiles, parse_goodput(cfg.goodput)
    )
    result = build_result(cfg, model, outputs, duration, metrics, output_lens)
    result["config"] = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
    if not math.isfinite(cfg.request_rate):
        result["config"]["request_rate"] = "inf"
    echo(format_summary(cfg, result))
    if cfg.output_json:
        with open(cfg.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        echo(f"results written to {cfg.output_json}")
    if cfg.plot:
        from xlaserve.bench.plot import plot_latency_cdfs

        msg = plot_latency_cdfs(
            {"TTFT": metrics.ttfts_ms, "TPOT": metrics.tpots_ms, "E2EL": metrics.e2els_ms},
            cfg.plot,
            title=f"{model} @ {result['request_rate']} req/s",
        )
        echo(msg)
    return result
