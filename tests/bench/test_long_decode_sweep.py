"""bench/gpu_probes/long_decode_sweep.py runs on the CPU (interpreter, tiny shapes, the first
two configs) and writes its JSON: rows with GB/s fields, a best row per shape, and every config's
output equal to the first's."""

from __future__ import annotations

import json

import pytest

from bench.gpu_probes import long_decode_sweep


def test_sweep_runs_on_cpu(tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "ld.json"
    assert long_decode_sweep.main(["--tiny", "--configs", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["rows"]) == 2 * len(long_decode_sweep._shapes(tiny=True))
    assert set(res["best"]) == {s.name for s in long_decode_sweep._shapes(tiny=True)}
    for row in res["rows"]:
        assert row["us"] > 0 and row["gbps"] >= 0 and "hbm_fraction" in row
        assert row["max_diff_vs_first"] < 1e-4  # 16 vs 32 splits: the same attention


def test_sweep_fp8_cache_on_cpu(tmp_path) -> None:  # noqa: ANN001
    """--kv fp8: the caches hold fp8 codes with scales (bytes per token: codes + a float32
    scale), every config computing the same attention."""
    out = tmp_path / "ld8.json"
    assert (
        long_decode_sweep.main(["--tiny", "--kv", "fp8", "--configs", "2", "--out", str(out)]) == 0
    )
    res = json.loads(out.read_text())
    assert res["kv"] == "fp8" and {r["kv"] for r in res["rows"]} == {"fp8"}
    for row in res["rows"]:
        assert row["us"] > 0 and row["max_diff_vs_first"] < 1e-4
        s = row["shape"]  # one byte a code and a float32 scale per (token, head), K and V
        assert row["kv_bytes"] == 2 * s["batch"] * s["ctx"] * s["hkv"] * (s["head_dim"] + 4)


def test_sweep_batch_shape_on_cpu(tmp_path) -> None:  # noqa: ANN001
    """--shapes picks shapes by name; a batch shape runs BATCH_CONFIGS (no split), over an fp8
    cache here, every config computing the same attention; an unknown name is an error."""
    out = tmp_path / "ldb.json"
    argv = ["--tiny", "--kv", "fp8", "--shapes", "ctx40_b8", "--configs", "3", "--out", str(out)]
    assert long_decode_sweep.main(argv) == 0
    res = json.loads(out.read_text())
    assert [r["shape"]["name"] for r in res["rows"]] == ["ctx40_b8"] * 3
    got = [(r["block_n"], r["num_warps"], r["num_stages"], r["splits"]) for r in res["rows"]]
    assert got == long_decode_sweep.BATCH_CONFIGS[:3]
    for row in res["rows"]:
        assert row["max_diff_vs_first"] < 1e-4
    with pytest.raises(ValueError, match="unknown shapes"):
        long_decode_sweep.run(True, 1, 1.0, 1, "bf16", ["nope"])
