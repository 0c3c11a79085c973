"""`xlaserve bench ...` (also `python -m xlaserve.bench ...`).

Subcommands: serve (any OpenAI-compatible server), throughput, latency, prefix-caching (offline,
`xlaserve.LLM`), compare-hf (xlaserve vs transformers on CPU). structured-output is pending.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import click

from xlaserve.bench.datasets import DATASETS
from xlaserve.bench.request_funcs import REQUEST_FUNCS


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


@click.group("bench", help="Benchmark xlaserve or any OpenAI-compatible server.")
def bench() -> None:
    pass


@bench.command("serve")
@click.option("--base-url", default="http://127.0.0.1:8000", show_default=True)
@click.option("--model", default=None, help="Model name sent; default: first of /v1/models.")
@click.option(
    "--endpoint",
    default="/v1/completions",
    show_default=True,
    help="/v1/completions or /v1/chat/completions.",
)
@click.option(
    "--backend",
    type=click.Choice(sorted(REQUEST_FUNCS)),
    default=None,
    help="Request API; default from --endpoint.",
)
@click.option("--dataset", type=click.Choice(DATASETS), default="random", show_default=True)
@click.option("--dataset-path", default=None, help="ShareGPT JSON or prompts JSONL file.")
@click.option("--num-prompts", type=int, default=100, show_default=True)
@click.option("--input-len", type=int, default=128, show_default=True)
@click.option("--output-len", type=int, default=None, help="max_tokens (random: default 128).")
@click.option("--range-ratio", type=float, default=0.0, show_default=True)
@click.option("--prefix-len", type=int, default=0, show_default=True)
@click.option("--num-prefixes", type=int, default=4, show_default=True, help="prefix-repetition.")
@click.option(
    "--request-rate", default="inf", show_default=True, help="Requests/s; inf = all at once."
)
@click.option("--burstiness", type=float, default=1.0, show_default=True, help="1 = Poisson.")
@click.option("--max-concurrency", type=int, default=None)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--output-json", default=None, type=click.Path(dir_okay=False))
@click.option("--percentile-metrics", default="ttft,tpot,itl,e2el", show_default=True)
@click.option("--metric-percentiles", default="50,90,99", show_default=True)
@click.option("--goodput", default=None, help="SLOs in ms, e.g. ttft:500,tpot:50.")
@click.option("--tokenizer", default=None, help="Tokenizer dir/file for prompts and counting.")
@click.option("--ignore-eos", is_flag=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None)
@click.option("--plot", default=None, type=click.Path(dir_okay=False), help="Latency CDF PNG.")
@click.option("--disable-tqdm", is_flag=True)
def serve_cmd(**kw: Any) -> None:
    """Measure an OpenAI-compatible server (TTFT, TPOT, ITL, E2E latency, throughput)."""
    from xlaserve.bench.serve import BenchError, ServeBenchConfig, run_serve_benchmark

    try:
        rate = float(kw.pop("request_rate"))
    except ValueError as e:
        raise click.BadParameter("must be a number or inf", param_hint="--request-rate") from e
    if kw["output_len"] is None and kw["dataset"] in ("random", "prefix-repetition"):
        kw["output_len"] = 128
    try:
        cfg = ServeBenchConfig(
            request_rate=rate if rate > 0 else math.inf,
            percentile_metrics=_csv(kw.pop("percentile_metrics")),
            metric_percentiles=[float(p) for p in _csv(kw.pop("metric_percentiles"))],
            **kw,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    try:
        run_serve_benchmark(cfg, echo=click.echo)
    except (BenchError, FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from e


def _engine_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Engine flags shared by the offline benchmarks (they map onto EngineConfig fields)."""
    options = [
        click.option("--model", default=None, help="Model dir; default: the demo model."),
        click.option("--backend", type=click.Choice(["auto", "torch", "xla"]), default="auto"),
        click.option(
            "--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto"
        ),
        click.option(
            "--load-format", type=click.Choice(["auto", "safetensors", "dummy"]), default="auto"
        ),
        click.option("--max-model-len", type=int, default=None),
        click.option("--max-num-seqs", type=int, default=None),
        click.option("--max-num-batched-tokens", type=int, default=None),
        click.option("--block-size", type=int, default=None),
        click.option("--num-kv-blocks", type=int, default=None),
        click.option("--enforce-eager", is_flag=True, default=None),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--output-json", default=None, type=click.Path(dir_okay=False)),
    ]
    for opt in reversed(options):
        f = opt(f)
    return f


def _split(kw: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    model = kw.pop("model")
    if kw.get("enforce_eager") is False:
        kw["enforce_eager"] = None
    return model, kw


@bench.command("throughput")
@_engine_options
@click.option("--num-prompts", type=int, default=64, show_default=True)
@click.option("--input-len", type=int, default=128, show_default=True)
@click.option("--output-len", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--no-warmup", "warmup", is_flag=True, flag_value=False, default=True)
def throughput_cmd(**kw: Any) -> None:
    """Offline throughput of LLM.generate (requests/s, tokens/s in and out)."""
    from xlaserve.bench.offline import run_throughput

    model, kw = _split(kw)
    run_throughput(model, echo=click.echo, **kw)


@bench.command("latency")
@_engine_options
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--input-len", type=int, default=32, show_default=True)
@click.option("--output-len", type=int, default=128, show_default=True)
@click.option("--num-iters", type=int, default=10, show_default=True)
@click.option("--num-iters-warmup", type=int, default=2, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True)
def latency_cmd(**kw: Any) -> None:
    """End-to-end latency of one fixed batch (percentiles over --num-iters)."""
    from xlaserve.bench.offline import run_latency

    model, kw = _split(kw)
    run_latency(model, echo=click.echo, **kw)


@bench.command("prefix-caching")
@_engine_options
@click.option("--num-prompts", type=int, default=32, show_default=True)
@click.option("--num-prefixes", type=int, default=4, show_default=True)
@click.option("--prefix-len", type=int, default=256, show_default=True)
@click.option("--suffix-len", type=int, default=32, show_default=True)
@click.option("--output-len", type=int, default=16, show_default=True)
def prefix_caching_cmd(**kw: Any) -> None:
    """Shared-prefix workload with prefix caching on vs off: hit rate and speedup."""
    from xlaserve.bench.offline import run_prefix_caching

    model, kw = _split(kw)
    run_prefix_caching(model, echo=click.echo, **kw)


@bench.command("structured-output")
@_engine_options
@click.option("--batch-sizes", default="1,8", show_default=True, help="Comma-separated.")
@click.option("--output-len", type=int, default=128, show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True)
def structured_output_cmd(**kw: Any) -> None:
    """Decode tokens/s with and without a JSON schema (structured-output cost)."""
    from xlaserve.bench.offline import run_structured_output

    model, kw = _split(kw)
    kw["batch_sizes"] = [int(b) for b in _csv(kw["batch_sizes"])]
    run_structured_output(model, echo=click.echo, **kw)


@bench.command("compare-hf")
@click.option("--model", default=None, help="Model dir; default: the demo model.")
@click.option("--num-prompts", type=int, default=16, show_default=True)
@click.option("--input-len", type=int, default=64, show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True
)
@click.option("--backend", type=click.Choice(["torch", "xla"]), default="torch", show_default=True)
@click.option(
    "--threads",
    type=int,
    default=1,
    show_default=True,
    help="torch intra-op threads for both systems; 0 = torch's default. On a loaded machine more "
    "threads than free cores makes every small op wait on the others (10x slower).",
)
@click.option("--output-json", default=None, type=click.Path(dir_okay=False))
def compare_hf_cmd(**kw: Any) -> None:
    """xlaserve vs transformers generate on CPU: throughput and batch-1 latency, side by side."""
    from xlaserve.bench.compare_hf import run_compare_hf

    run_compare_hf(echo=click.echo, **kw)


def main() -> None:
    bench(prog_name="xlaserve bench")


if __name__ == "__main__":
    main()
