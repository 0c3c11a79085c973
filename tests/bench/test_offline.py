"""Offline subcommands (throughput, latency, prefix-caching, structured-output, compare-hf)
on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from xlaserve.bench.cli import bench

ENGINE = ["--backend", "torch", "--num-kv-blocks", "128", "--block-size", "8"]


def _invoke(args: list[str]) -> str:
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_throughput(bench_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    text = _invoke(
        [
            "throughput",
            "--model",
            str(bench_model_dir),
            *ENGINE,
            "--num-prompts",
            "6",
            "--input-len",
            "20",
            "--output-len",
            "5",
            "--output-json",
            str(out),
        ]
    )
    assert "requests/s" in text
    res = _load(out)
    assert res["num_requests"] == 6
    assert res["total_input_tokens"] == 6 * 20
    assert res["total_output_tokens"] == 6 * 5  # ignore_eos: exactly output_len each
    assert res["total_num_tokens"] == 150
    t = res["elapsed_time"]
    assert t > 0
    assert res["requests_per_second"] == pytest.approx(6 / t)
    assert res["tokens_per_second"] == pytest.approx(150 / t)
    assert res["output_tokens_per_second"] == pytest.approx(30 / t)


def test_throughput_dummy_weights(bench_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tpd.json"
    _invoke(
        [
            "throughput",
            "--model",
            str(bench_model_dir),
            *ENGINE,
            "--load-format",
            "dummy",
            "--dtype",
            "float32",
            "--num-prompts",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--no-warmup",
            "--disable-detokenize",
            "--output-json",
            str(out),
        ]
    )
    res = _load(out)
    assert res["engine_kwargs"]["load_format"] == "dummy"
    assert res["total_output_tokens"] == 6 and res["detokenize"] is False


def test_throughput_warmup_leaves_no_compile_to_the_timed_run(
    bench_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """XLA, sampling at temperature 1: the warm-up runs the timed run's batch shapes and waits
    for the sampler specializations they start, so the timed run starts none (with a one-prompt
    warm-up it started some: bench/RESULTS.md)."""
    pytest.importorskip("jax")
    from xlaserve.bench import offline

    jobs: list[set] = []  # sampler variants asked for, before each generate call
    real_make = offline.make_llm

    def make(*a: Any, **kw: Any) -> Any:
        llm = real_make(*a, **kw)
        real_generate = llm.generate

        def generate(*ga: Any, **gkw: Any) -> Any:
            jobs.append(set(llm.llm_engine.runner._variant_jobs))
            out = real_generate(*ga, **gkw)
            jobs.append(set(llm.llm_engine.runner._variant_jobs))
            return out

        llm.generate = generate
        return llm

    monkeypatch.setattr(offline, "make_llm", make)
    offline.run_throughput(str(bench_model_dir), num_prompts=12, input_len=16, output_len=4,
                           backend="xla", max_num_batched_tokens=64, max_num_seqs=16,
                           echo=lambda _: None)  # fmt: skip
    before_warm, after_warm, before_timed, after_timed = jobs
    assert after_warm - before_warm  # the warm-up asked for specializations
    assert after_timed == before_timed  # the timed run asked for none


def test_latency(bench_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "lat.json"
    text = _invoke(
        [
            "latency",
            "--model",
            str(bench_model_dir),
            *ENGINE,
            "--batch-size",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--num-iters",
            "3",
            "--num-iters-warmup",
            "1",
            "--output-json",
            str(out),
        ]
    )
    assert "Avg latency" in text
    res = _load(out)
    lat = res["latencies"]
    assert len(lat) == 3 and all(x > 0 for x in lat)
    assert res["avg_latency"] == pytest.approx(sum(lat) / 3)
    pct = [res["percentiles"][k] for k in ("10", "25", "50", "75", "90", "99")]
    assert pct == sorted(pct) and min(lat) <= pct[0] and pct[-1] <= max(lat)


def test_prefix_caching_on_vs_off(bench_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "pc.json"
    text = _invoke(
        [
            "prefix-caching",
            "--model",
            str(bench_model_dir),
            *ENGINE,
            "--num-prompts",
            "8",
            "--num-prefixes",
            "2",
            "--prefix-len",
            "48",
            "--suffix-len",
            "5",
            "--output-len",
            "3",
            "--output-json",
            str(out),
        ]
    )
    assert "prefix caching on" in text
    res = _load(out)
    on, off = res["on"], res["off"]
    assert on["enable_prefix_caching"] and not off["enable_prefix_caching"]
    # 6 of 8 prompts reuse a 48-token prefix = 6 full blocks of 8 -> at least 6*48 hit tokens
    assert on["prefix_cache_hits"] >= 6 * 48
    assert on["hit_rate"] == pytest.approx(on["prefix_cache_hits"] / on["prefix_cache_queries"])
    assert 0.5 < on["hit_rate"] <= res["shareable_fraction"] + 1e-9
    assert off["prefix_cache_hits"] == 0 and off["hit_rate"] == 0.0
    assert res["speedup"] == pytest.approx(off["phase2_s"] / on["phase2_s"])
    assert res["outputs_match"] is True  # caching must not change greedy tokens


def test_structured_output(bench_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "so.json"
    text = _invoke(
        [
            "structured-output",
            "--model",
            str(bench_model_dir),
            *ENGINE,
            "--batch-sizes",
            "1,2",
            "--output-len",
            "6",
            "--repeats",
            "2",
            "--output-json",
            str(out),
        ]
    )
    assert "json schema" in text
    res = _load(out)
    assert [r["batch_size"] for r in res["results"]] == [1, 2]
    for r in res["results"]:
        assert len(r["plain_runs"]) == 2 and len(r["structured_runs"]) == 2
        assert r["plain_tokens_per_second"] > 0 and r["structured_tokens_per_second"] > 0
        ratio = r["structured_tokens_per_second"] / r["plain_tokens_per_second"]
        assert r["ratio"] == pytest.approx(ratio)


def test_compare_hf(bench_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp.json"
    text = _invoke(
        [
            "compare-hf",
            "--model",
            str(bench_model_dir),
            "--num-prompts",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "6",
            "--repeats",
            "1",
            "--output-json",
            str(out),
        ]
    )
    assert "transformers" in text
    res = _load(out)
    for k in (
        "xlaserve_output_tok_per_s",
        "hf_output_tok_per_s",
        "xlaserve_batch1_latency_median_s",
        "hf_batch1_latency_median_s",
    ):
        assert res[k] > 0
    assert res["throughput_ratio"] == pytest.approx(
        res["hf_throughput_s"][0] / res["xlaserve_throughput_s"][0]
    )
    # same model, same prompts, greedy, float32: both systems agree token for token
    assert res["greedy_matching_prefix_tokens"] == 6
