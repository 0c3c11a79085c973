"""bench/gpu_probes/chunk_attention.py on the CPU: the routes it can run there compute the same
chunk attention (the padded square call equals the lower-right causal one)."""

from __future__ import annotations

import json

import pytest
from optional_deps import import_or_skip

import_or_skip("torch")


def test_tiny_routes_agree(tmp_path) -> None:  # noqa: ANN001
    from xlaserve.bench.gpu_probes.chunk_attention import main

    out = tmp_path / "ca.json"
    assert main(["--tiny", "--reps", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"lower_right", "padded_square", "square_whole_prompt"}
    assert rows["padded_square"]["max_abs_diff_vs_first"] == pytest.approx(0.0, abs=1e-5)
    assert all(r["us"] > 0 for r in rows.values())
