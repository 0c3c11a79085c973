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
