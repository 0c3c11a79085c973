"""bench/ssm_bench.py runs end to end on the CPU with tiny shapes: every row of both shapes
(xlaserve torch and xla, transformers) lands in the JSON with positive rates; a failing row is
recorded without stopping the others."""

from __future__ import annotations

import json
from pathlib import Path

from xlaserve.bench import ssm_bench

TINY = ["--tiny", "--num-prompts", "3", "--input-len", "6", "--output-len", "4", "--hf-prompts",
        "2", "--hf-batch", "2", "--batch1-output", "4", "--repeats", "1", "--in-process"]  # fmt: skip


def test_ssm_bench_tiny_rows(tmp_path: Path) -> None:
    """Every system on the hybrid shape (its Mamba2 mixers are the mamba2 shape's code path; the
    mamba2 shape's rows run on the GPU)."""
    out = tmp_path / "ssm.json"
    ssm_bench.main([*TINY, "--shapes", "bamba", "--systems",
                    "xlaserve-torch,xlaserve-xla,transformers,nope", "--output-json", str(out)])  # fmt: skip
    data = json.loads(out.read_text())
    assert set(data) >= {"bamba"} and "mamba2" not in data
    for shape in ("bamba",):
        entry = data[shape]
        assert entry["roofline"]["params"] > 0 and entry["roofline"]["state_bytes_per_seq"] > 0
        for system in ("xlaserve-torch", "xlaserve-xla", "transformers"):
            row = entry[system]
            assert "error" not in row, row
            assert row["batch1_decode_tokens_per_s"] > 0
            assert row["offline_output_tokens_per_s"] > 0
            assert row["batch1_ratio_to_roofline"] > 0
        assert "error" in entry["nope"]  # an unknown backend: recorded, the run goes on


def test_ssm_bench_tiny_qwen3_next(tmp_path: Path) -> None:
    """The opt-in Qwen3-Next shape (--shapes qwen3_next): xlaserve (torch) beside transformers
    (the XLA row runs the same code path as the other shapes' XLA rows, with the model that
    tests/models_ssm/test_qwen3_next.py checks; left out here to keep the test short)."""
    out = tmp_path / "ssm.json"
    ssm_bench.main([*TINY, "--shapes", "qwen3_next", "--systems", "xlaserve-torch,transformers",
                    "--output-json", str(out)])  # fmt: skip
    entry = json.loads(out.read_text())["qwen3_next"]
    assert entry["roofline"]["state_bytes_per_seq"] > 0
    for system in ("xlaserve-torch", "transformers"):
        row = entry[system]
        assert "error" not in row, row
        assert row["batch1_decode_tokens_per_s"] > 0 and row["offline_output_tokens_per_s"] > 0


def test_ssm_bench_tiny_eager_row(tmp_path: Path) -> None:
    """The opt-in enforce_eager torch row beside the default one (graphs vs eager on the GPU):
    both land with rates; on the CPU neither has graph replays."""
    out = tmp_path / "ssm.json"
    ssm_bench.main([*TINY, "--shapes", "mamba2", "--systems", "xlaserve-torch,xlaserve-torch-eager",
                    "--output-json", str(out)])  # fmt: skip
    entry = json.loads(out.read_text())["mamba2"]
    for system in ("xlaserve-torch", "xlaserve-torch-eager"):
        row = entry[system]
        assert "error" not in row, row
        assert row["batch1_decode_tokens_per_s"] > 0 and row["cuda_graph_replays"] == 0
