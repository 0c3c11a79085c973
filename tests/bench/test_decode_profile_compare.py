"""bench/gpu_probes/decode_profile.py --compare on the H100 profiles of the twenty-first session
(tests/bench/data: the offline 1000 x 256 / 256 run's decode and prefill steps, bf16 and fp8,
2026-12-05): kernel classes as RESULTS.md reports them, and the projection reproduces the fp8
run's own steps when given its measured GEMM ratios."""

from __future__ import annotations

import os

import pytest

from xlaserve.bench.gpu_probes import decode_profile as dp

DATA = os.path.join(os.path.dirname(__file__), "data")
BF16 = os.path.join(DATA, "decode_profile_h100_bf16.json")
FP8 = os.path.join(DATA, "decode_profile_h100_fp8.json")


def test_kernel_classes() -> None:
    assert dp.kernel_class("_unified_attention_kernel") == "attention"
    assert dp.kernel_class("_merge_splits_kernel") == "attention"
    assert (
        dp.kernel_class("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT") == "gemm"
    )
    assert dp.kernel_class("_quant_rows_kernel") == "act_quant"
    assert dp.kernel_class("_rms_norm_quant_kernel") == "other"  # fused: norm work
    assert dp.kernel_class("_act_and_mul_kernel") == "other"


def test_compare_h100_bf16_fp8() -> None:
    res = dp.compare(BF16, FP8, [1.5, 2.0])
    dec, fill = res["profile"], res["prefill_profile"]
    # The decode step (batch 256, contexts ~384): attention, GEMMs (lm_head included), quant.
    assert dec["base"]["attention"] == pytest.approx(4.995, abs=1e-3)
    assert dec["base"]["gemm"] == pytest.approx(7.027, abs=1e-3)
    assert dec["run"]["gemm"] == pytest.approx(4.697, abs=1e-3)
    assert dec["run"]["act_quant"] == pytest.approx(0.404, abs=1e-3)
    assert dec["base"]["act_quant"] == 0.0
    for side in dec.values():  # the classes add up to the step's GPU time
        parts = side["attention"] + side["act_quant"] + side["gemm"] + side["other"]
        assert parts == pytest.approx(side["gpu"])
    assert fill["run"]["act_quant"] == pytest.approx(9.468, abs=1e-3)
    assert res["measured_offline_ratio"] == pytest.approx(16036.7 / 13031.8, abs=1e-4)
    # With its own GEMM ratios and act quant kept, the projection is the fp8 run's steps.
    proj = res["projected_measured_gemms"]
    assert proj["decode_ms"] == pytest.approx(dec["run"]["wall"])
    assert proj["prefill_ms"] == pytest.approx(fill["run"]["wall"])
    assert proj["offline_ratio"] == pytest.approx(res["measured_offline_ratio"], abs=0.02)
    # Faster GEMMs can only help, and 2x still leaves the run near 1.4x (attention as is).
    lo, hi = res["projected"]["1.5"]["offline_ratio"], res["projected"]["2.0"]["offline_ratio"]
    assert proj["offline_ratio"] < hi and lo < hi
    assert 1.35 < hi < 1.5
