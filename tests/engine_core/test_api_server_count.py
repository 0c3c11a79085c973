"""`--api-server-count` auto (None): 2 fronts on a CUDA host with >= 8 cores and the core in its
own process, 1 elsewhere; an explicit count is kept."""

from __future__ import annotations

import dataclasses

import pytest

from xlaserve.config import EngineConfig, ParallelConfig, ServerConfig
from xlaserve.entrypoints.openai import api_server
from xlaserve.platforms import current_platform


@pytest.mark.parametrize(
    ("cuda", "cores", "engine_process", "dp", "explicit", "want"),
    [
        (True, 16, True, 1, None, 2),  # the H200 host: two fronts
        (True, 4, True, 1, None, 1),  # too few cores
        (False, 16, True, 1, None, 1),  # CPU / TPU host
        (True, 16, False, 1, None, 1),  # in-process engine: one front only
        (True, 16, True, 2, None, 1),  # data parallel: ranks behind one front
        (False, 2, True, 1, 3, 3),  # explicit wins
        (True, 16, True, 1, 1, 1),
    ],
)
def test_resolve_api_server_count(
    monkeypatch: pytest.MonkeyPatch,
    cuda: bool,
    cores: int,
    engine_process: bool,
    dp: int,
    explicit: int | None,
    want: int,
) -> None:
    monkeypatch.setattr(current_platform, "is_cuda", lambda: cuda, raising=False)
    monkeypatch.setattr(api_server.os, "cpu_count", lambda: cores)
    ec = dataclasses.replace(EngineConfig(), parallel=ParallelConfig(data_parallel_size=dp))
    sc = ServerConfig(engine_process=engine_process, api_server_count=explicit)
    assert api_server.resolve_api_server_count(ec, sc) == want


def test_api_server_count_is_checked() -> None:
    with pytest.raises(ValueError, match="api_server_count"):
        ServerConfig(api_server_count=0)
    with pytest.raises(ValueError, match="engine-process"):
        ServerConfig(api_server_count=2, engine_process=False)
