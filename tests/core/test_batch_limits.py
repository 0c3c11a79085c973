"""Platform defaults of max_num_seqs / max_num_batched_tokens (config.default_batch_limits)."""

from __future__ import annotations

import pytest

from xlaserve import config as cfg
from xlaserve import platforms
from xlaserve.platforms import Platform

H200 = Platform("cuda", "torch", "NVIDIA H200", 139.8)
L4 = Platform("cuda", "torch", "NVIDIA L4", 22.0)
CPU = Platform("cpu", "torch", "cpu")
TPU = Platform("tpu", "xla", "tpu")


@pytest.mark.parametrize(
    "platform,offline,backend,want",
    [
        (H200, True, "auto", (512, 16384)),
        (H200, False, "auto", (512, 8192)),
        (H200, True, "torch", (512, 16384)),
        (H200, True, "xla", cfg.HOST_BATCH_LIMITS),  # XLA compiles a bucket per size
        (L4, True, "auto", (256, 8192)),
        (L4, False, "auto", (256, 2048)),
        (CPU, True, "auto", cfg.HOST_BATCH_LIMITS),
        (CPU, False, "torch", cfg.HOST_BATCH_LIMITS),
        (TPU, True, "auto", cfg.HOST_BATCH_LIMITS),
    ],
)
def test_default_batch_limits(platform, offline, backend, want):
    assert cfg.default_batch_limits(platform, offline, backend) == want


def test_engine_config_fills_only_unset_limits(monkeypatch):
    monkeypatch.setattr(platforms, "detect_platform", lambda: H200)
    assert cfg.HOST_BATCH_LIMITS == (64, 2048)
    c = cfg.EngineConfig()  # server defaults of the platform
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (512, 8192)
    c = cfg.EngineConfig.from_kwargs(max_num_seqs=8)
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (8, 8192)
    c = cfg.EngineConfig.from_kwargs(max_num_batched_tokens=256, backend="xla")
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (64, 256)
    monkeypatch.setattr(platforms, "detect_platform", lambda: CPU)
    c = cfg.EngineConfig()
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (64, 2048)


def test_bad_limits_still_raise():
    with pytest.raises(ValueError, match="max_num_seqs must be positive"):
        cfg.SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be positive"):
        cfg.EngineConfig.from_kwargs(max_num_batched_tokens=-1)


def test_llm_takes_the_offline_limits(monkeypatch):
    """LLM(...) passes the platform's offline limits (here: the CPU's) unless given."""
    from xlaserve import LLM

    llm = LLM(max_num_batched_tokens=512)
    sc = llm.llm_engine.config.scheduler
    assert (sc.max_num_seqs, sc.max_num_batched_tokens) == (cfg.HOST_BATCH_LIMITS[0], 512)
    seen = []
    monkeypatch.setattr(
        cfg, "default_batch_limits", lambda p, offline, backend: seen.append(offline) or (3, 96)
    )
    import xlaserve.engine.llm as llm_mod

    monkeypatch.setattr(llm_mod, "default_batch_limits", cfg.default_batch_limits)
    sc = LLM().llm_engine.config.scheduler
    assert (sc.max_num_seqs, sc.max_num_batched_tokens) == (3, 96) and seen == [True]


class _Untouchable:
    """A platform that must not be asked (asking it imports torch on an NVIDIA host)."""

    def __getattr__(self, item: str) -> None:
        raise AssertionError(f"platform.{item} read for an explicit non-torch backend")


def test_explicit_xla_backend_asks_nothing_of_the_platform() -> None:
    assert cfg.default_batch_limits(_Untouchable(), True, "xla") == cfg.HOST_BATCH_LIMITS
    with pytest.raises(AssertionError):
        cfg.default_batch_limits(_Untouchable(), True, "auto")
