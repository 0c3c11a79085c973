"""bench/kernels/lora_xla.py runs (CPU smoke: tiny shapes, kernels part) and every
implementation agrees with the reference."""

from __future__ import annotations

import json


def test_lora_bench_kernels_smoke(tmp_path) -> None:  # noqa: ANN001
    from xlaserve.bench.kernels.lora_xla import main

    out = tmp_path / "lora.json"
    assert main(["--tiny", "--skip-runner", "--reps", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["kernels"]
    assert rows and all("base_ms" in r for r in rows)
    for r in rows:
        for impl in ("reference", "xla", "pallas_gpu"):
            assert f"{impl}_error" not in r, r
            assert r[f"{impl}_max_abs_diff"] < 1e-4, r
