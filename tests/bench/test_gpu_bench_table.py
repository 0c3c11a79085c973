"""gpu_bench's closing table: the base rows always (dashes where a stage did not run), and rows
for the variant stages that ran only."""

from __future__ import annotations

import pytest

from xlaserve.bench import gpu_bench


def test_table_lists_only_measured_variants(capsys: pytest.CaptureFixture[str]) -> None:
    ran = "torch_proc"
    assert ran in gpu_bench.VARIANTS and len(gpu_bench.VARIANTS) > 3
    result = {
        "xlaserve": {"batch1": {"decode_tokens_per_s": 240.0, "e2e_tokens_per_s": 233.0}},
        ran: {"batch1": {"decode_tokens_per_s": 239.5},
              "offline_256_256": {"output_tokens_per_s": 14300.0}},
    }  # fmt: skip
    gpu_bench._print_table(result)
    out = capsys.readouterr().out.splitlines()
    rows = {line[:28].strip(): line[28:].split() for line in out[1:]}
    assert rows["b1 decode tok/s"] == ["240.00", "-"]
    assert rows[f"{ran} b1 decode tok/s"] == ["239.50", "-"]
    assert rows[f"{ran} 256/256 tok/s"] == ["14300.00", "-"]
    labels = ("b1 decode tok/s", "256/256 tok/s", "rep. b1 tok/s", "acc. length")
    others = [f"{name} {lab}" for name in gpu_bench.VARIANTS if name != ran for lab in labels]
    assert not set(others) & set(rows)  # no row of dashes for a variant that did not run
