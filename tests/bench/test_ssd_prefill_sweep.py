"""bench/gpu_probes/ssd_prefill_sweep.py runs on the CPU (Triton interpreter: tests/conftest.py; tiny shapes, the first
two variants) in both modes: one request against the torch reference, and the engine's varlen
step (x / B / C as views of one row): every row timed, accurate, with its mode's fields."""

from __future__ import annotations

from bench.gpu_probes import ssd_prefill_sweep as sweep


def test_sweep_single_request_and_varlen_rows() -> None:
    rows = sweep.main(["--tiny", "--iters", "1"])
    assert len(rows) == 2 and all("error" not in r for r in rows), rows
    for row in rows:
        assert row["kernel_ms"] > 0 and row["reference_ms"] > 0 and row["speedup"] > 0
        assert row["rel_err"] < 1e-3
    rows = sweep.main(["--tiny", "--iters", "1", "--varlen", "3x40"])
    assert len(rows) == 2 and all("error" not in r for r in rows), rows
    for row in rows:
        assert row["seqs"] == 3 and row["length"] == 40 and row["tokens_per_ms"] > 0
        assert row["rel_err"] < 1e-3
