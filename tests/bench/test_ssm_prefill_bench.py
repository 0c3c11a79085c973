"""The SSM prefill kernel micro-benchmark (bench/kernels/ssm_prefill.py) runs on the CPU (Triton
interpreter, tiny shapes) and writes its JSON rows: kernel and reference side by side, and the
kernel agrees with the reference (its max abs error column)."""

from __future__ import annotations

import json
import os

import pytest


def test_ssm_prefill_bench_tiny_runs(tmp_path) -> None:  # noqa: ANN001
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from xlaserve.bench.kernels import ssm_prefill

    out = tmp_path / "ssm_prefill.json"
    rows = ssm_prefill.main(["--tiny", "--iters", "1", "--output-json", str(out)])
    saved = json.loads(out.read_text())["rows"]
    assert saved == rows
    assert {r["op"] for r in rows} == {"conv", "ssd_g=hs", "ssd_g=2"}
    assert {r["tokens"] for r in rows} == {1, 37}
    for r in rows:
        assert r["kernel_ms"] > 0 and r["reference_ms"] > 0
        assert r["max_abs_err"] < 1e-3, r
