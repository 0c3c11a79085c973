"""bench/gpu_probes/quant_gemm_sweep.py runs on the CPU (interpreter, tiny shapes) and writes its
JSON: a bf16 row per (shape, M), every tried config's output equal to its family's first (the
same product whatever the tiles), a best row per (family, shape, M), and the M filter of the
candidate lists."""

from __future__ import annotations

import json

from bench.gpu_probes import quant_gemm_sweep as qs


def test_candidate_filter() -> None:
    assert qs.fits(16, 1) and qs.fits(16, 16) and not qs.fits(32, 16)
    assert qs.fits(64, 256) and qs.fits(32, 256) and not qs.fits(16, 256)
    assert qs.fits(256, 8192) and qs.fits(64, 8192) and not qs.fits(32, 8192)


def test_sweep_runs_on_cpu(tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "qg.json"
    argv = ["--tiny", "--families", "int8", "int8_w8a8", "--shapes", "a", "--ms", "16", "40"]
    assert qs.main([*argv, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["partial"] is False  # the last write is the whole sweep's
    rows = res["rows"]
    assert not [r for r in rows if "error" in r]
    assert {(r["m"], r["family"]) for r in rows if r["family"] == "bf16"} == {
        (16, "bf16"),
        (40, "bf16"),
    }
    int8 = [r for r in rows if r["family"] == "int8"]
    assert any("True" in r["config"] for r in int8) and any("False" in r["config"] for r in int8)
    for r in rows:
        if r["family"] != "bf16":
            assert r["max_rel_vs_first"] < 1e-5, r
            assert r["rel_vs_bf16"] < 0.05, r  # int8 codes (and w8a8 activations) vs the float
    assert set(res["best"]) == {f"{f} a M={m}" for f in ("int8", "int8_w8a8") for m in (16, 40)}
    # One pick per family and table bucket (M 16 and 40 fall in the first two int8 buckets),
    # with its tile tuple recoverable from the row label.
    assert set(res["suggest"]["int8"]) == {"16", "64"}
    for pick in res["suggest"]["int8"].values():
        assert pick["vs_table"] >= 1.0 and pick["us_sum"] > 0
    assert all(r["tiles"] is None or len(r["tiles"]) >= 6 for r in rows if r["family"] != "bf16")


def test_suggest_sums_over_shapes() -> None:
    """The bucket pick minimizes the time summed over shapes, not the best of one shape."""
    rows = [{"family": "bf16", "shape": s, "m": 16, "us": 10.0} for s in ("a", "b")] + [
        {"family": "int8", "shape": "a", "m": 16, "config": "table (1)", "tiles": [1], "us": 5.0},
        {"family": "int8", "shape": "b", "m": 16, "config": "table (1)", "tiles": [1], "us": 5.0},
        {"family": "int8", "shape": "a", "m": 16, "config": "(2)", "tiles": [2], "us": 1.0},
        {"family": "int8", "shape": "b", "m": 16, "config": "(2)", "tiles": [2], "us": 20.0},
        {"family": "int8", "shape": "a", "m": 16, "config": "(3)", "tiles": [3], "us": 4.0},
        {"family": "int8", "shape": "b", "m": 16, "config": "(3)", "tiles": [3], "us": 4.0},
        # one shape only
        {"family": "int8", "shape": "a", "m": 16, "config": "(4)", "tiles": [4], "us": 0.5},
    ]
    pick = qs.suggest(rows)["int8"]["16"]
    assert pick == {"config": "(3)", "tiles": [3], "us_sum": 8.0, "vs_table": 1.25, "vs_bf16": 2.5}
