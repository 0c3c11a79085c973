"""KernelConfig: every kernel / fusion / graph switch in one frozen config section.

- defaults, then XLASERVE_<FIELD> environment overrides (read only by KernelConfig.from_env /
  kernel_switch), then explicit arguments (LLM(...) keywords, CLI flags);
- bad values give a clear ValueError naming the field or variable;
- `xlaserve serve --help` lists the switches under "Kernels options";
- the torch runner takes its switches from the config it is given, not from the environment.
"""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from xlaserve.config import EngineConfig, KernelConfig, kernel_switch
from xlaserve.entrypoints.cli import build_engine_config, main


def test_defaults_env_and_explicit_precedence() -> None:
    base = KernelConfig.from_env({})
    assert base == KernelConfig()
    assert base.pdl and base.fuse_projections and base.graph_max_kv_splits == 16
    env = {"XLASERVE_PDL": "0", "XLASERVE_TRITON_OPS": "1", "XLASERVE_GRAPH_MAX_KV_SPLITS": "8"}
    got = KernelConfig.from_env(env)
    assert (got.pdl, got.triton_ops, got.graph_max_kv_splits) == (False, "on", 8)
    # explicit arguments win over the environment
    got = KernelConfig.from_env(env, pdl=True, triton_ops="off")
    assert (got.pdl, got.triton_ops, got.graph_max_kv_splits) == (True, "off", 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.pdl = False  # type: ignore[misc]


@pytest.mark.parametrize(
    "env, match",
    [
        ({"XLASERVE_PDL": "maybe"}, "XLASERVE_PDL"),
        ({"XLASERVE_DENSE_GEMV": "always"}, "XLASERVE_DENSE_GEMV"),
        ({"XLASERVE_GRAPH_MAX_KV_SPLITS": "x"}, "XLASERVE_GRAPH_MAX_KV_SPLITS"),
        ({"XLASERVE_GRAPH_MAX_KV_SPLITS": "6"}, "graph_max_kv_splits"),
    ],
)
def test_bad_values_name_the_switch(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KernelConfig.from_env(env)


def test_kernel_switch_reads_the_environment_at_call_time(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("XLASERVE_MOE_IMPL", raising=False)
    assert kernel_switch("moe_impl") == "auto"
    monkeypatch.setenv("XLASERVE_MOE_IMPL", "torch_ref")
    assert kernel_switch("moe_impl") == "torch_ref"
    # a config given explicitly is what counts
    assert kernel_switch("moe_impl", KernelConfig(moe_impl="triton")) == "triton"
    with pytest.raises(AttributeError):
        kernel_switch("no_such_switch")


def test_engine_config_routes_kernel_keywords(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("XLASERVE_FUSED_GREEDY", "0")
    cfg = EngineConfig.from_kwargs(attention_backend="torch_ref", block_size=8)
    assert cfg.kernels.attention_backend == "torch_ref" and cfg.cache.block_size == 8
    assert cfg.kernels.fused_greedy == "off"  # from the environment
    assert EngineConfig.from_kwargs(fused_greedy="on").kernels.fused_greedy == "on"


def test_cli_lists_and_maps_the_switches(monkeypatch) -> None:  # noqa: ANN001
    out = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "Kernels options" in out
    for flag in ("--attention-backend", "--no-pdl", "--dense-gemv", "--graph-max-kv-splits"):
        assert flag in out
    monkeypatch.setenv("XLASERVE_GEMV_PREFETCH", "0")
    cfg = build_engine_config(None, {"kernels": {"pdl": False, "dense_gemv": None}})
    assert cfg.kernels.pdl is False  # the flag
    assert cfg.kernels.gemv_prefetch is False  # the environment, through from_env
    assert cfg.kernels.dense_gemv == "auto"  # not given: the default


def test_torch_runner_takes_switches_from_its_config(tiny_model_dir, monkeypatch) -> None:  # noqa: ANN001
    """The environment says one thing, the config another: the config wins."""
    from xlaserve import LLM

    monkeypatch.setenv("XLASERVE_ATTENTION_BACKEND", "torch_batched")
    monkeypatch.setenv("XLASERVE_FUSE_PROJECTIONS", "1")
    llm = LLM(
        tiny_model_dir(),
        backend="torch",
        num_kv_blocks=16,
        attention_backend="torch_ref",
        fuse_projections=False,
    )
    runner = llm.llm_engine.runner
    assert runner.attn_backend_name == "torch_ref"
    assert not any(getattr(layer.self_attn, "fused", True) for layer in runner.model.layers)
    assert runner.model.kernels is runner.config.kernels
    llm.llm_engine.shutdown()
