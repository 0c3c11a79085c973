"""`bench serve` against a live xlaserve server (in-process aiohttp app on a free port)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from xlaserve.bench.cli import bench
from xlaserve.bench.datasets import BenchTokenizer, sample_random
from xlaserve.bench.serve import ServeBenchConfig, run_serve_benchmark

SCALAR_KEYS = [
    "date",
    "backend",
    "model_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
]
LIST_KEYS = ["input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"]
METRICS = ["ttft", "tpot", "itl", "e2el"]


class LiveServer:
    """xlaserve's aiohttp app over a real engine, served from a thread with its own event loop."""

    def __init__(self, model_dir: Path, port: int) -> None:
        from aiohttp import web

        from xlaserve.config import EngineConfig, ServerConfig
        from xlaserve.engine.async_llm import AsyncLLM
        from xlaserve.entrypoints.openai.api_server import build_app

        self.port = port
        config = EngineConfig.from_kwargs(
            model=str(model_dir), backend="torch", served_model_name="tiny", num_kv_blocks=256
        )
        self.engine = AsyncLLM.from_config(config)
        app = build_app(self.engine, ServerConfig(port=self.port), owns_engine=True)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", self.port)
            self.loop.run_until_complete(site.start())
            ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self.runner.cleanup())
            self.loop.close()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert ready.wait(60), "server did not start"
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(bench_model_dir: Path) -> Any:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = LiveServer(bench_model_dir, port)
    yield s
    s.stop()


def _check_consistent(res: dict[str, Any], num_prompts: int) -> None:
    for k in SCALAR_KEYS + LIST_KEYS:
        assert k in res, k
    for m in METRICS:
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{stat}_{m}_ms" in res, f"{stat}_{m}_ms"
    assert res["num_prompts"] == num_prompts
    assert res["completed"] + res["failed"] == num_prompts
    for k in LIST_KEYS:
        assert len(res[k]) == num_prompts, k
    ok = [i for i, e in enumerate(res["errors"]) if not e]
    assert len(ok) == res["completed"]
    assert res["total_input_tokens"] == sum(res["input_lens"][i] for i in ok)
    assert res["total_output_tokens"] == sum(res["output_lens"])
    d = res["duration"]
    assert res["request_throughput"] == pytest.approx(res["completed"] / d)
    assert res["output_throughput"] == pytest.approx(res["total_output_tokens"] / d)
    assert res["total_token_throughput"] == pytest.approx(
        (res["total_input_tokens"] + res["total_output_tokens"]) / d
    )
    for m in METRICS:
        assert 0 <= res[f"p50_{m}_ms"] <= res[f"p90_{m}_ms"] <= res[f"p99_{m}_ms"]
    if res["completed"]:
        ttfts = [res["ttfts"][i] * 1000 for i in ok]
        assert min(ttfts) - 1e-6 <= res["mean_ttft_ms"] <= max(ttfts) + 1e-6
        assert res["median_ttft_ms"] <= res["p99_e2el_ms"]
        for i in ok:
            assert 0 < res["ttfts"][i] <= res["e2els"][i]


def test_serve_completions_cli_json_and_plot(
    server: LiveServer, bench_model_dir: Path, tmp_path: Path
) -> None:
    out, png = tmp_path / "r.json", tmp_path / "cdf.png"
    n = 6
    result = CliRunner().invoke(
        bench,
        [
            "serve",
            "--base-url",
            server.url,
            "--model",
            "tiny",
            "--tokenizer",
            str(bench_model_dir),
            "--num-prompts",
            str(n),
            "--input-len",
            "24",
            "--output-len",
            "8",
            "--range-ratio",
            "0.3",
            "--max-concurrency",
            "3",
            "--ignore-eos",
            "--seed",
            "1",
            "--output-json",
            str(out),
            "--goodput",
            "ttft:60000,tpot:60000",
            "--plot",
            str(png),
            "--disable-tqdm",
        ],
    )
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "Serving Benchmark Result" in result.output
    res = json.loads(out.read_text())
    _check_consistent(res, n)
    assert res["failed"] == 0 and res["completed"] == n
    # ignore_eos + usage: exactly the lengths asked for (range ratio applies to outputs too)
    asked = sample_random(n, 24, 8, BenchTokenizer(str(bench_model_dir)), 0.3, seed=1)
    assert res["output_lens"] == [r.expected_output_len for r in asked]
    assert res["input_lens"] == [r.prompt_len for r in asked]
    assert res["max_concurrency"] == 3 and res["backend"] == "openai"
    assert res["request_goodput"] == pytest.approx(n / res["duration"])  # generous SLOs: all good
    assert all(len(t) > 0 for t in res["generated_texts"])
    # prompt lengths counted with the local tokenizer: within the range ratio around 24
    assert all(24 * 0.7 - 2 <= x <= 24 * 1.3 + 2 for x in res["input_lens"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_chat_poisson_counts_with_server_tokenize(server: LiveServer, tmp_path: Path) -> None:
    cfg = ServeBenchConfig(
        base_url=server.url + "/v1",  # a /v1 base URL works too
        endpoint="/v1/chat/completions",
        model=None,  # first model of /v1/models
        num_prompts=5,
        input_len=12,
        output_len=6,
        request_rate=20.0,
        burstiness=1.0,
        ignore_eos=True,
        output_json=str(tmp_path / "chat.json"),
        disable_tqdm=True,
        metric_percentiles=[50.0, 90.0, 99.0],
    )
    res = run_serve_benchmark(cfg, echo=lambda s: None)
    assert json.loads((tmp_path / "chat.json").read_text())["completed"] == res["completed"]
    _check_consistent(res, 5)
    assert res["backend"] == "openai-chat" and res["model_id"] == "tiny"
    assert res["completed"] == 5
    assert res["output_lens"] == [6] * 5
    # no local tokenizer: prompt lengths came from the server's /tokenize (random words)
    assert all(x > 0 for x in res["input_lens"])


def test_wrong_model_is_counted_as_failed(server: LiveServer, tmp_path: Path) -> None:
    cfg = ServeBenchConfig(
        base_url=server.url,
        model="no-such-model",
        num_prompts=3,
        input_len=8,
        output_len=4,
        output_json=str(tmp_path / "bad.json"),
        disable_tqdm=True,
    )
    lines: list[str] = []
    res = run_serve_benchmark(cfg, echo=lines.append)
    _check_consistent(res, 3)
    assert (res["completed"], res["failed"]) == (0, 3)
    assert all(e.startswith("HTTP 404") for e in res["errors"]), res["errors"]
    assert res["total_output_tokens"] == 0 and res["output_lens"] == [0, 0, 0]
    assert "first error" in lines[0]


def test_dead_port_is_counted_as_failed(tmp_path: Path, free_port: int) -> None:
    cfg = ServeBenchConfig(
        base_url=f"http://127.0.0.1:{free_port}",
        model="m",
        num_prompts=4,
        input_len=8,
        output_len=4,
        request_rate=100.0,
        output_json=str(tmp_path / "dead.json"),
        disable_tqdm=True,
    )
    res = run_serve_benchmark(cfg, echo=lambda s: None)
    _check_consistent(res, 4)
    assert (res["completed"], res["failed"]) == (0, 4)
    assert all("Connect" in e for e in res["errors"]), res["errors"]


def test_unreachable_server_without_model_is_a_clear_cli_error(free_port: int) -> None:
    result = CliRunner().invoke(
        bench, ["serve", "--base-url", f"http://127.0.0.1:{free_port}", "--num-prompts", "2"]
    )
    assert result.exit_code == 1
    assert "could not get a model name" in result.output and "--model" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_serve_with_vllm_flag_names(server: LiveServer, tmp_path: Path) -> None:
    """vLLM's spellings: --host/--port, --dataset-name, --random-*-len, --save-result with
    --result-dir/--result-filename."""
    n = 3
    result = CliRunner().invoke(
        bench,
        ["serve", "--host", "127.0.0.1", "--port", str(server.port), "--model", "tiny",
         "--dataset-name", "random", "--num-prompts", str(n), "--random-input-len", "16",
         "--random-output-len", "4", "--random-range-ratio", "0", "--ignore-eos",
         "--save-result", "--result-dir", str(tmp_path / "res"), "--result-filename", "v.json",
         "--disable-tqdm"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output + repr(result.exception)
    res = json.loads((tmp_path / "res" / "v.json").read_text())
    assert res["completed"] == n and res["output_lens"] == [4] * n
