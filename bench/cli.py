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


def _result_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Where the results JSON goes: vLLM's --save-result/--result-dir/--result-filename, or
    our --output-json PATH."""
    options = [
        click.option(
            "--save-result", is_flag=True, help="Save the results JSON (see --result-dir)."
        ),
        click.option(
            "--result-dir",
            default=None,
            type=click.Path(file_okay=False),
            help="Folder of the saved results (default: the current one).",
        ),
        click.option(
            "--result-filename",
            default=None,
            help="File name of the saved results (default: <bench>-<time>.json).",
        ),
        click.option(
            "--output-json",
            default=None,
            type=click.Path(dir_okay=False),
            help="Write the results JSON to this path.",
        ),
    ]
    for opt in reversed(options):
        f = opt(f)
    return f


def _result_path(kw: dict[str, Any], stem: str) -> str | None:
    """The results file from the result flags (popped from `kw`; output_json stays)."""
    import os
    import time

    save, folder, name = kw.pop("save_result"), kw.pop("result_dir"), kw.pop("result_filename")
    if kw.get("output_json"):
        return kw["output_json"]
    if not (save or folder or name):
        return None
    name = name or f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if folder:
        os.makedirs(folder, exist_ok=True)
    return os.path.join(folder or ".", name)


@click.group("bench", help="Benchmark xlaserve or any OpenAI-compatible server.")
def bench() -> None:
    pass


@bench.command("serve")
@click.option(
    "--base-url",
    default=None,
    help="Server URL, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Server host (no --base-url).")
@click.option(
    "--port", type=int, default=8000, show_default=True, help="Server port (no --base-url)."
)
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
@click.option(
    "--dataset-name",
    "--dataset",
    "dataset",
    type=click.Choice(DATASETS),
    default="random",
    show_default=True,
    help="Where prompts come from (random tokens, a ShareGPT file, shared prefixes, ...).",
)
@click.option("--dataset-path", default=None, help="ShareGPT JSON or prompts JSONL file.")
@click.option("--num-prompts", type=int, default=100, show_default=True, help="Requests sent.")
@click.option(
    "--random-input-len",
    "--input-len",
    "input_len",
    type=int,
    default=128,
    show_default=True,
    help="Prompt tokens per request (random and prefix-repetition datasets).",
)
@click.option(
    "--random-output-len",
    "--output-len",
    "output_len",
    type=int,
    default=None,
    help="max_tokens per request (random: default 128; file datasets: their lengths).",
)
@click.option(
    "--random-range-ratio",
    "--range-ratio",
    "range_ratio",
    type=float,
    default=0.0,
    show_default=True,
    help="Lengths drawn uniformly from [len x (1 - r), len x (1 + r)].",
)
@click.option(
    "--random-prefix-len",
    "--prefix-len",
    "prefix_len",
    type=int,
    default=0,
    show_default=True,
    help="Tokens of random prefix shared by every prompt (prefix-repetition: per prefix).",
)
@click.option(
    "--num-prefixes",
    type=int,
    default=4,
    show_default=True,
    help="Distinct shared prefixes (prefix-repetition dataset).",
)
@click.option(
    "--request-rate", default="inf", show_default=True, help="Requests/s; inf = all at once."
)
@click.option(
    "--burstiness",
    type=float,
    default=1.0,
    show_default=True,
    help="Gamma shape of request gaps: 1 = Poisson, < 1 burstier, > 1 steadier.",
)
@click.option(
    "--max-concurrency", type=int, default=None, help="Most requests in flight (default: no cap)."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompt sampler.")
@_result_options
@click.option(
    "--percentile-metrics",
    default="ttft,tpot,itl,e2el",
    show_default=True,
    help="Metrics whose percentiles are reported (comma-separated).",
)
@click.option(
    "--metric-percentiles",
    default="50,90,99",
    show_default=True,
    help="Percentiles reported (comma-separated).",
)
@click.option("--goodput", default=None, help="SLOs in ms, e.g. ttft:500,tpot:50.")
@click.option("--tokenizer", default=None, help="Tokenizer dir/file for prompts and counting.")
@click.option("--ignore-eos", is_flag=True, help="Generate max_tokens even past EOS.")
@click.option(
    "--temperature", type=float, default=0.0, show_default=True, help="Sampling temperature."
)
@click.option(
    "--api-key", envvar="OPENAI_API_KEY", default=None, help="Bearer key (env OPENAI_API_KEY)."
)
@click.option("--plot", default=None, type=click.Path(dir_okay=False), help="Latency CDF PNG.")
@click.option("--disable-tqdm", is_flag=True, help="No progress bar.")
def serve_cmd(**kw: Any) -> None:
    """Measure an OpenAI-compatible server (TTFT, TPOT, ITL, E2E latency, throughput)."""
    from xlaserve.bench.serve import BenchError, ServeBenchConfig, run_serve_benchmark

    host, port = kw.pop("host"), kw.pop("port")
    if kw["base_url"] is None:
        kw["base_url"] = f"http://{host}:{port}"
    kw["output_json"] = _result_path(kw, f"serve-{kw['dataset']}")
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
        click.option(
            "--backend",
            type=click.Choice(["auto", "torch", "xla"]),
            default="auto",
            show_default=True,
            help="Engine backend (auto: the platform's default).",
        ),
        click.option(
            "--dtype",
            type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
            default="auto",
            show_default=True,
            help="Weights/activation dtype (auto: config.json's).",
        ),
        click.option(
            "--load-format",
            type=click.Choice(["auto", "safetensors", "dummy"]),
            default="auto",
            show_default=True,
            help="dummy: random weights of the model's shapes (no checkpoint read).",
        ),
        click.option("--max-model-len", type=int, default=None, help="Longest prompt + output."),
        click.option("--max-num-seqs", type=int, default=None, help="Most requests per step."),
        click.option(
            "--max-num-batched-tokens", type=int, default=None, help="Most tokens per step."
        ),
        click.option("--block-size", type=int, default=None, help="Tokens per KV block."),
        click.option(
            "--num-kv-blocks", type=int, default=None, help="KV blocks (default: from memory)."
        ),
        click.option(
            "--enforce-eager",
            is_flag=True,
            default=None,
            help="No CUDA graphs (torch); compile buckets lazily (XLA).",
        ),
        click.option(
            "--seed", type=int, default=0, show_default=True, help="Engine and prompt seed."
        ),
        click.option(
            "--dataset-name",
            type=click.Choice(["random"]),
            default="random",
            show_default=True,
            help="Offline benchmarks use random token prompts (vLLM's name, one choice).",
        ),
        _result_options,
    ]
    for opt in reversed(options):
        f = opt(f)
    return f


def _check_model(model: str | None, load_format: str | None) -> None:
    """The model directory is readable (config, known architecture, weights) before anything
    loads: one `Error:` line otherwise (as `xlaserve serve`)."""
    from xlaserve.config import EngineConfig, LoadConfig, ModelConfig
    from xlaserve.entrypoints.checks import StartupError, check_model

    try:
        config = EngineConfig(
            model=ModelConfig(model=model), load=LoadConfig(load_format=load_format or "auto")
        )
        check_model(config)
    except (StartupError, ValueError) as e:
        raise click.ClickException(str(e)) from None


def _split(kw: dict[str, Any], stem: str = "bench") -> tuple[str | None, dict[str, Any]]:
    """(model, the runner's keyword arguments): the CLI-only flags resolved and removed."""
    kw.pop("dataset_name", None)
    kw["output_json"] = _result_path(kw, stem)
    model = kw.pop("model")
    _check_model(model, kw.get("load_format"))
    if kw.get("enforce_eager") is False:
        kw["enforce_eager"] = None
    return model, kw


@bench.command("throughput")
@_engine_options
@click.option("--num-prompts", type=int, default=64, show_default=True, help="Requests.")
@click.option(
    "--random-input-len",
    "--input-len",
    "input_len",
    type=int,
    default=128,
    show_default=True,
    help="Prompt tokens per request.",
)
@click.option(
    "--random-output-len",
    "--output-len",
    "output_len",
    type=int,
    default=128,
    show_default=True,
    help="Generated tokens per request (EOS ignored).",
)
@click.option(
    "--temperature", type=float, default=1.0, show_default=True, help="Sampling temperature."
)
@click.option(
    "--no-warmup",
    "warmup",
    is_flag=True,
    flag_value=False,
    default=True,
    help="Skip the one-request warm-up before the timed run.",
)
@click.option("--disable-tqdm", is_flag=True, help="No progress bar during the timed run.")
@click.option(
    "--min-tokens",
    is_flag=True,
    help="Force the output length with min_tokens (EOS kept, masked every step) instead of "
    "ignoring EOS.",
)
@click.option(
    "--disable-detokenize",
    is_flag=True,
    help="SamplingParams(detokenize=False): token ids only, no text built per token.",
)
def throughput_cmd(**kw: Any) -> None:
    """Offline throughput of LLM.generate (requests/s, tokens/s in and out)."""
    from xlaserve.bench.offline import run_throughput

    kw["use_tqdm"] = not kw.pop("disable_tqdm")
    model, kw = _split(kw, "throughput")
    run_throughput(model, echo=click.echo, **kw)


@bench.command("latency")
@_engine_options
@click.option("--batch-size", type=int, default=8, show_default=True, help="Requests per batch.")
@click.option(
    "--random-input-len",
    "--input-len",
    "input_len",
    type=int,
    default=32,
    show_default=True,
    help="Prompt tokens per request.",
)
@click.option(
    "--random-output-len",
    "--output-len",
    "output_len",
    type=int,
    default=128,
    show_default=True,
    help="Generated tokens per request.",
)
@click.option("--num-iters", type=int, default=10, show_default=True, help="Timed batches.")
@click.option(
    "--num-iters-warmup", type=int, default=2, show_default=True, help="Untimed batches first."
)
@click.option(
    "--temperature", type=float, default=1.0, show_default=True, help="Sampling temperature."
)
def latency_cmd(**kw: Any) -> None:
    """End-to-end latency of one fixed batch (percentiles over --num-iters)."""
    from xlaserve.bench.offline import run_latency

    model, kw = _split(kw, "latency")
    run_latency(model, echo=click.echo, **kw)


@bench.command("prefix-caching")
@_engine_options
@click.option("--num-prompts", type=int, default=32, show_default=True, help="Requests.")
@click.option(
    "--num-prefixes", type=int, default=4, show_default=True, help="Distinct shared prefixes."
)
@click.option(
    "--prefix-len", type=int, default=256, show_default=True, help="Tokens of each prefix."
)
@click.option(
    "--suffix-len",
    type=int,
    default=32,
    show_default=True,
    help="Unique tokens after the prefix, per request.",
)
@click.option(
    "--random-output-len",
    "--output-len",
    "output_len",
    type=int,
    default=16,
    show_default=True,
    help="Generated tokens per request.",
)
def prefix_caching_cmd(**kw: Any) -> None:
    """Shared-prefix workload with prefix caching on vs off: hit rate and speedup."""
    from xlaserve.bench.offline import run_prefix_caching

    model, kw = _split(kw, "prefix-caching")
    run_prefix_caching(model, echo=click.echo, **kw)


@bench.command("structured-output")
@_engine_options
@click.option("--batch-sizes", default="1,8", show_default=True, help="Comma-separated.")
@click.option(
    "--random-output-len",
    "--output-len",
    "output_len",
    type=int,
    default=128,
    show_default=True,
    help="Generated tokens per request.",
)
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed runs per row.")
def structured_output_cmd(**kw: Any) -> None:
    """Decode tokens/s with and without a JSON schema (structured-output cost)."""
    from xlaserve.bench.offline import run_structured_output

    model, kw = _split(kw, "structured-output")
    kw["batch_sizes"] = [int(b) for b in _csv(kw["batch_sizes"])]
    run_structured_output(model, echo=click.echo, **kw)


@bench.command("compare-hf")
@click.option("--model", default=None, help="Model dir; default: the demo model.")
@click.option("--num-prompts", type=int, default=16, show_default=True, help="Requests.")
@click.option(
    "--random-input-len",
    "--input-len",
    "input_len",
    type=int,
    default=64,
    show_default=True,
    help="Prompt tokens per request.",
)
@click.option(
    "--random-output-len",
    "--output-len",
    "output_len",
    type=int,
    default=64,
    show_default=True,
    help="Generated tokens per request.",
)
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed runs per system.")
@click.option("--seed", type=int, default=0, show_default=True, help="Prompt seed.")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default="float32",
    show_default=True,
    help="Dtype of both systems.",
)
@click.option(
    "--backend",
    type=click.Choice(["torch", "xla"]),
    default="torch",
    show_default=True,
    help="xlaserve's backend.",
)
@click.option(
    "--threads",
    type=int,
    default=1,
    show_default=True,
    help="torch intra-op threads for both systems; 0 = torch's default. On a loaded machine more "
    "threads than free cores makes every small op wait on the others (10x slower).",
)
@_result_options
def compare_hf_cmd(**kw: Any) -> None:
    """xlaserve vs transformers generate on CPU: throughput and batch-1 latency, side by side."""
    from xlaserve.bench.compare_hf import run_compare_hf

    kw["output_json"] = _result_path(kw, "compare-hf")
    run_compare_hf(echo=click.echo, **kw)


def main() -> None:
    bench(prog_name="xlaserve bench")


if __name__ == "__main__":
    main()
