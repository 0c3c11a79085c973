"""XLA expert parallelism on 4 forced host devices: Mixtral, Qwen2-MoE (shared expert) and
Qwen3-MoE tiny models with the experts sharded on E over 2 and 4 devices give the 1-device greedy
tokens, and each device really holds only E / N experts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from arch_zoo import make_arch_model

from xlaserve.model_loader.registry import build_spec

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {n: make_arch_model(n, str(tmp_path_factory.mktemp(f"ep-{n}"))) for n in ARCHS}


def test_expert_parallel_matches_single_device(moe_dirs: dict[str, str], tmp_path) -> None:  # noqa: ANN001
    worker = os.path.join(os.path.dirname(__file__), "xla_ep_worker.py")
    arg = ",".join(f"{n}={p}" for n, p in moe_dirs.items())
    proc = subprocess.run(
        [sys.executable, worker, str(tmp_path / "jax-cache"), arg],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ARCHS:
        r = res[name]
        assert r["1"]["tokens"] == r["2"]["tokens"] == r["4"]["tokens"], name
        assert len({t for toks in r["1"]["tokens"] for t in toks}) > 3, name  # not degenerate
        e = r["1"]["experts"]
        assert r["1"]["spec"] == [None, None, None] and r["1"]["shard_rows"] == [e]
        for n in (2, 4):  # [E, I, H] split on E: each device holds E / n experts
            assert r[str(n)]["spec"] == ["model", None, None], (name, n)
            assert r[str(n)]["shard_rows"] == [e // n] and r[str(n)]["devices"] == n, (name, n)
    assert "3 devices must divide num_experts (4)" in res["ragged_error"]


def test_expert_parallel_needs_divisible_experts(moe_dirs: dict[str, str]) -> None:
    from xlaserve.models_flax.moe import check_expert_parallel

    spec = build_spec(moe_dirs["mixtral"])
    check_expert_parallel(spec, 4)  # 4 experts over 4 devices: fine
    with pytest.raises(ValueError, match="tensor_parallel_size 4 must divide num_experts \\(6\\)"):
        check_expert_parallel(replace(spec, num_experts=6), 4)


def test_enable_expert_parallel_flag() -> None:
    from click.testing import CliRunner

    from xlaserve.config import EngineConfig, ParallelConfig
    from xlaserve.entrypoints.cli import main

    assert EngineConfig.from_kwargs(enable_expert_parallel=True).parallel.enable_expert_parallel
    with pytest.raises(ValueError, match="enable_expert_parallel must be a bool"):
        ParallelConfig(enable_expert_parallel="yes")  # type: ignore[arg-type]
    out = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "--enable-expert-parallel" in out


def test_torch_backend_refuses_xla_only_parallel_options(moe_dirs: dict[str, str]) -> None:
    from xlaserve.config import EngineConfig
    from xlaserve.engine.llm_engine import LLMEngine

    for extra in ({"enable_expert_parallel": True}, {"nnodes": 2, "node_rank": 0}):
        cfg = EngineConfig.from_kwargs(model=moe_dirs["mixtral"], backend="torch", **extra)
        with pytest.raises(ValueError, match="need backend 'xla'"):
            LLMEngine(cfg)
