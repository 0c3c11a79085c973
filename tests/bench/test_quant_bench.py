"""bench/quant_bench.py runs end to end on the CPU: the demo model with tiny counts (rows in
process), the GEMM sweep on tiny shapes in the Triton interpreter; every row lands in the JSON
with positive rates and ratios to bf16, an unknown row is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from optional_deps import import_or_skip

import_or_skip("torch")
import_or_skip("triton")

from xlaserve.bench import quant_bench  # noqa: E402

TINY = ["--model", "demo", "--num-prompts", "3", "--input-len", "6", "--output-len", "4",
        "--batch1-input", "6", "--batch1-output", "4", "--repeats", "1", "--in-process",
        "--cpu-kv-blocks", "64"]  # fmt: skip


def test_quant_bench_demo_rows_and_gemm(tmp_path: Path) -> None:
    import os

    env_before = dict(os.environ)
    out = tmp_path / "quant.json"
    quant_bench.main([*TINY, "--rows", "bf16,int8_w8a8,fp8_kv", "--gemm", "--tiny-gemm",
                      "--gemm-m", "20", "--gemm-reps", "1", "--quality",
                      "--output-json", str(out)])  # fmt: skip
    # In-process rows must not leave settings behind (fp8 emulation leaked once and turned the
    # CPU's fp8 refusal off for every later test).
    assert dict(os.environ) == env_before
    data = json.loads(out.read_text())
    for name in ("bf16", "int8_w8a8", "fp8_kv"):
        row = data["rows"][name]
        assert "error" not in row, row
        assert row["offline"]["output_tokens_per_s"] > 0
        assert row["offline"]["ratio_vs_bf16"] > 0
        assert row["batch1"]["decode_tokens_per_s"] > 0
        assert row["num_kv_blocks"] > 0
    for name in quant_bench.ROWS:  # every mode's perplexity within 2% of float
        q = data["quality"][name]
        assert q["tokens"] > 20 and q["within_2_percent"], (name, q)
    gemm = data["gemm"]
    for k, n in quant_bench.TINY_GEMM_SHAPES:
        row = gemm[f"{k}x{n}"]["20"]
        for variant in ("bf16", "int8", "int8_w8a8_triton", "fp8_triton", "fp8_block"):
            assert row[variant]["us"] > 0 and row[variant]["speedup_vs_bf16"] > 0, variant


def test_quant_bench_unknown_row(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        quant_bench.main([*TINY, "--rows", "bf16,nope", "--output-json", str(tmp_path / "q")])
