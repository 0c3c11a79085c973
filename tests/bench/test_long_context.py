"""bench/long_context.py runs end to end on the CPU in its --tiny mode (the 8B config shrunk, short
contexts, stages in process, the attention kernel in the Triton interpreter): every stage ends
without an error and every row of the issue has its numbers; the roofline's byte counts match the
Llama-3.1-8B parameter count; bad stage names and lengths past max_model_len are refused."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from optional_deps import import_or_skip

import_or_skip("torch")
import_or_skip("triton")
import_or_skip("transformers")

from xlaserve.bench import long_context  # noqa: E402
from xlaserve.bench.gpu_bench import LLAMA_8B  # noqa: E402

TINY = ["--tiny", "--in-process", "--repeats", "1"]


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and x > 0


def test_long_context_tiny_every_row(tmp_path: Path) -> None:
    out = tmp_path / "long.json"
    long_context.main([*TINY, "--work-dir", str(tmp_path / "w"), "--output-json", str(out)])
    data = json.loads(out.read_text())
    assert list(data["stages"]) == list(long_context.STAGES)
    for name, stage in data["stages"].items():
        assert "error" not in stage, (name, stage)
    rows = data["rows"]
    p = rows["prefill30k"]
    for key in ("xlaserve_ttft_s", "sdpa_forward_s", "ratio_vs_sdpa"):
        assert _positive(p[key]), (key, p)
    assert isinstance(p["meets_goal"], bool)
    off = p["prefill_sdpa_off"]  # the nosdpa stage (on the CPU both keep torch_batched)
    for key in ("xlaserve_ttft_s", "ratio_vs_sdpa", "ttft_vs_default", "offline_vs_default"):
        assert _positive(off[key]), (key, off)
    d = rows["decode30k"]
    assert _positive(d["decode_tokens_per_s"]) and _positive(d["fraction_of_roofline"])
    assert _positive(d["graph_max_kv_splits_32"]["decode_tokens_per_s"])
    assert _positive(d["graph_max_kv_splits_32"]["ratio_vs_default"])
    for bw in ("4800_gbs", "4300_gbs"):
        assert _positive(d["roofline"][bw]["roofline_tokens_per_s"]), bw
        assert _positive(d["roofline"][bw]["fraction"]), bw
    c = rows["ctx128k"]
    for key in ("ttft_s", "decode_tokens_per_s", "num_kv_blocks"):
        assert _positive(c[key]), (key, c)
    assert c["prompt_len"] == long_context.SIZES["tiny"]["long_len"]
    f = rows["fp8kv"]
    for part in ("offline", "kv_blocks", "decode30k"):
        assert _positive(f[part]["ratio"]), (part, f[part])
    assert _positive(f["offline"]["bf16_output_tokens_per_s"])
    assert _positive(f["offline"]["fp8_output_tokens_per_s"])
    # fp8 codes take fewer bytes than the float cache: more blocks in the same budget.
    assert f["kv_blocks"]["ratio"] > 1.0
    k = data["stages"]["kernels"]
    for key in ("triton_us", "triton_plain_us", "sdpa_us", "triton_vs_sdpa_time", "paged_sdpa_us"):
        assert _positive(k["prefill"][key]), (key, k["prefill"])
    assert k["prefill"]["paged_sdpa_max_abs_diff_vs_triton"] < 1e-4  # float32 on the CPU
    ch = k["prefill_chunk"]  # the later chunk over a cached prefix (48 tokens: 26 + 22)
    assert (ch["first_chunk"], ch["queries"]) == (26, 22)
    assert _positive(ch["triton_us"]) and _positive(ch["paged_sdpa_us"]), ch
    assert ch["paged_sdpa_max_abs_diff_vs_triton"] < 1e-4
    assert "flash_eligible" in ch or "flash_eligible_error" in ch
    for ctx, row in k["decode"].items():
        for dtype in ("bf16", "fp8"):
            for s in (1, 2):
                assert _positive(row[f"{dtype}_splits{s}"]["us"]), (ctx, dtype, s, row)


def test_roofline_bytes_llama8b() -> None:
    cfg = dict(LLAMA_8B)
    wb = long_context.weight_bytes(cfg)
    assert wb["all"] == 2 * 8_030_261_248  # Llama-3.1-8B's parameter count, bf16
    assert wb["all"] - wb["read"] == 2 * 128256 * 4096  # the input embedding
    # K and V of 32 layers x 8 kv heads x 128 dims, bf16: 128 KiB per token.
    assert long_context.kv_bytes(cfg, 1) == 131072
    assert long_context.kv_bytes(cfg, 1, "fp8") == 32 * 2 * 8 * (128 + 4)
    roof = long_context.roofline(cfg, 30000, 150.0, [4300.0])
    ceiling = 4300e9 / (wb["read"] + 30000 * 131072)
    assert roof["4300_gbs"]["roofline_tokens_per_s"] == pytest.approx(ceiling)
    assert roof["4300_gbs"]["fraction"] == pytest.approx(150.0 / ceiling)


def test_long_context_refuses_bad_arguments(tmp_path: Path) -> None:
    out = str(tmp_path / "x.json")
    with pytest.raises(SystemExit):
        long_context.main([*TINY, "--stages", "bf16,nope", "--output-json", out])
    with pytest.raises(SystemExit):  # 120 + 16 output tokens > max_model_len 120
        long_context.main([*TINY, "--prefill-len", "120", "--max-model-len", "120",
                           "--output-json", out])  # fmt: skip
    with pytest.raises(SystemExit):
        long_context.main([*TINY, "--kernel-splits", "3", "--output-json", out])
    assert not Path(out).exists()
    assert isinstance(long_context.SIZES["llama8b"]["long_len"], int)
    assert argparse  # the module's CLI is argparse's: SystemExit on bad input


def test_roofline_bandwidth_from_the_gpu_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """--bandwidth-gbs defaults to the GPU's spec by its nvidia-smi name (the PCIe / NVL H100s
    before the SXM one); an unknown name or no GPU (no nvidia-smi) gives the H200's 4800."""
    spec = long_context.spec_bandwidth_gbs
    assert spec("NVIDIA H100 80GB HBM3") == 3350.0
    assert spec("NVIDIA H100 PCIe") == 2000.0
    assert spec("NVIDIA H100 NVL") == 3900.0
    assert spec("NVIDIA H200") == 4800.0
    assert spec("") == spec("NVIDIA L4") == long_context.DEFAULT_GBS == 4800.0
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi to run
    assert long_context.gpu_name() == ""


def test_issue_roofline_at_the_measured_copy_rate() -> None:
    """The issue's definition: all weights (16.1 GB) + KV at the card's copy rate, e.g. the
    issue's own 154 tok/s at 30k on the H200 at 4.3 TB/s is 0.72 of ~215 tok/s; no copy rate
    (no GPU), no row; copy_gbs is None without CUDA."""
    cfg = dict(LLAMA_8B)
    row = long_context.issue_roofline(cfg, 30000, 154.0, 4300.0)
    assert row["roofline_tokens_per_s"] == pytest.approx(
        4300e9 / (2 * 8_030_261_248 + 30000 * 131072)
    )
    assert row["roofline_tokens_per_s"] == pytest.approx(215, abs=1.0)
    assert row["fraction"] == pytest.approx(0.72, abs=0.005)
    assert long_context.issue_roofline(cfg, 30000, 154.0, None) is None
    import torch

    if not torch.cuda.is_available():
        assert long_context.copy_gbs() is None
