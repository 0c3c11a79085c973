"""The bench CLI is reachable as `python -m xlaserve.bench` and as `xlaserve bench`."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

SUBCOMMANDS = (
    "serve",
    "throughput",
    "latency",
    "prefix-caching",
    "structured-output",
    "compare-hf",
)


def test_python_dash_m_lists_subcommands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "xlaserve.bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for name in SUBCOMMANDS:
        assert name in out.stdout


def test_registered_under_xlaserve_bench() -> None:
    from xlaserve.entrypoints.cli import main

    result = CliRunner().invoke(main, ["bench", "serve", "--help"])
    assert result.exit_code == 0, result.output
    assert "--request-rate" in result.output and "--goodput" in result.output


def test_bad_flags_are_usage_errors() -> None:
    from xlaserve.bench.cli import bench

    r = CliRunner().invoke(bench, ["serve", "--endpoint", "/v1/embeddings", "--model", "m"])
    assert r.exit_code == 2 and "--backend" in r.output
    r = CliRunner().invoke(bench, ["serve", "--percentile-metrics", "ttft,foo", "--model", "m"])
    assert r.exit_code == 2 and "foo" in r.output
    r = CliRunner().invoke(bench, ["serve", "--request-rate", "fast", "--model", "m"])
    assert r.exit_code == 2


def _commands() -> list:
    from xlaserve.bench.cli import bench

    return [bench.commands[name] for name in SUBCOMMANDS]


def test_every_bench_option_has_help() -> None:
    import click

    for cmd in _commands():
        for p in cmd.params:
            if isinstance(p, click.Option) and p.name != "help":
                assert p.help, f"bench {cmd.name} {p.opts[0]} has no help text"


def test_vllm_flag_names_are_accepted_everywhere() -> None:
    import click

    for cmd in _commands():
        flags = {o for p in cmd.params if isinstance(p, click.Option) for o in p.opts}
        assert {"--save-result", "--result-dir", "--result-filename", "--output-json"} <= flags
        assert "--random-output-len" in flags and "--output-len" in flags, cmd.name
        if cmd.name in ("serve", "throughput", "latency", "compare-hf"):
            assert "--random-input-len" in flags and "--input-len" in flags, cmd.name
        if cmd.name != "compare-hf":
            assert "--dataset-name" in flags, cmd.name
    serve = {o for p in _commands()[0].params for o in p.opts}
    assert {"--host", "--port", "--base-url", "--dataset", "--random-range-ratio"} <= serve


def test_throughput_saves_results_and_shows_progress(tmp_path) -> None:  # noqa: ANN001
    from xlaserve.bench.cli import bench

    args = ["throughput", "--backend", "torch", "--dtype", "float32", "--num-kv-blocks", "256",
            "--dataset-name", "random", "--num-prompts", "4", "--random-input-len", "8",
            "--random-output-len", "4", "--no-warmup", "--save-result", "--result-dir",
            str(tmp_path), "--result-filename", "t.json"]  # fmt: skip
    r = CliRunner().invoke(bench, args)
    assert r.exit_code == 0, r.output + repr(r.exception)
    import json

    res = json.loads((tmp_path / "t.json").read_text())
    assert res["num_requests"] == 4 and res["total_output_tokens"] == 16
    assert "Processed prompts" in r.output  # LLM.generate's tqdm bar (stderr is mixed in)
    r = CliRunner().invoke(bench, [*args[:-1], "q.json", "--disable-tqdm"])
    assert r.exit_code == 0 and "Processed prompts" not in r.output


def test_offline_bench_checks_the_model_first(tmp_path) -> None:  # noqa: ANN001
    from xlaserve.bench.cli import bench

    r = CliRunner().invoke(bench, ["throughput", "--model", str(tmp_path / "none")])
    assert r.exit_code == 1 and r.output.startswith("Error: ") and "does not exist" in r.output
    assert r.output.count("\n") == 1
    r = CliRunner().invoke(bench, ["latency", "--model", str(tmp_path)])  # no config.json
    assert r.exit_code == 1 and "config.json" in r.output
