"""bench/lora_bench.py runs end to end on the CPU (the demo model, and the --llama8b code path
at the tiny shape) and writes every row of its JSON report."""

from __future__ import annotations

import json

import pytest

from xlaserve.bench.lora_bench import main


@pytest.mark.parametrize("shape", [[], ["--llama8b", "--tiny"]])
def test_lora_bench_runs_every_row(tmp_path, shape) -> None:  # noqa: ANN001
    out = tmp_path / "lora.json"
    args = [*shape, "--backend", "torch", "--num-prompts", "4", "--input-len", "8",
            "--output-len", "4", "--batch1-output-len", "4", "--num-adapters", "2", "--rank", "4",
            "--output-json", str(out)]  # fmt: skip
    assert main(args) == 0
    rep = json.loads(out.read_text())
    for mode in ("offline", "batch1"):
        for tag in ("no_lora", "lora_base", "lora_adapters"):
            assert rep["rows"][f"{mode}/{tag}"]["output_tok_s"] > 0, (mode, tag)
        assert rep["ratio_adapters_vs_no_lora"][mode] > 0
