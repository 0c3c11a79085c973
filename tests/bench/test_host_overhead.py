"""bench/host_overhead.py on both backends (tiny counts): one JSON with every phase's median, the
runner's part timed as execute (synchronous torch steps) or launch + finish (async XLA steps),
and output processing the step's remainder."""

from __future__ import annotations

import json

import pytest

from xlaserve.bench import host_overhead


@pytest.mark.parametrize("backend", ["torch", "xla"])
def test_host_overhead_phases(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    if backend == "xla":
        pytest.importorskip("jax")
    argv = ["--backend", backend, "--batch", "4", "--vocab", "512", "--output-len", "6",
            "--input-len", "8", "--final-only"]  # fmt: skip
    host_overhead.main(argv)
    res = json.loads(capsys.readouterr().out)
    assert res["backend"] == backend and res["batch"] == 4
    assert res["steps"] >= 6 and res["output_tok_s"] > 0
    med = res["decode_step_ms_median"]
    runner = [k for k in ("execute", "launch", "finish") if k in med]
    assert runner == (["execute"] if backend == "torch" else ["launch", "finish"])
    for k in ("step", "schedule", "update", "front", *runner):
        assert med[k] > 0, (k, med)
    parts = med["schedule"] + med["update"] + sum(med[k] for k in runner)
    assert med["output_processing"] == pytest.approx(med["step"] - parts)
