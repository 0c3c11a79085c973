"""bench/gpu_probes/prefill_tile_sweep.py in the Triton interpreter: every launch config of both
cases (a whole prompt, a chunk over a cached prefix) computes the table config's output."""

from __future__ import annotations

import json

from optional_deps import import_or_skip

import_or_skip("torch")
import_or_skip("triton")


def test_tiny_sweep_configs_agree(tmp_path) -> None:  # noqa: ANN001
    from xlaserve.bench.gpu_probes.prefill_tile_sweep import TINY_CONFIGS, main

    out = tmp_path / "pt.json"
    assert main(["--tiny", "--reps", "1", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert not rep["partial"]
    for case in ("whole_prompt", "chunk"):
        rows = [r for r in rep["rows"] if r["case"] == case]
        assert [r["config"] for r in rows] == ["table"] + [str(c) for c in TINY_CONFIGS]
        for r in rows:
            assert "error" not in r and r["max_abs_diff_vs_table"] < 1e-5, r
        assert rep["best"][case]["us"] == min(r["us"] for r in rows)
