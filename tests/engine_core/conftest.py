"""Fixtures: the same tiny model and servers as tests/entrypoints, but the engine core runs in a
child process (`MPAsyncLLM`), so every endpoint test there runs through the process boundary."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ep_helpers import API_KEY, SMALL_BODY_LIMIT, Server, engine_config, serve

from xlaserve.config import ServerConfig
from xlaserve.engine.core_client import MPAsyncLLM


@pytest.fixture(scope="session")
def model_path(tiny_model_dir) -> str:  # noqa: ANN001
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def engine(model_path: str) -> Iterator[MPAsyncLLM]:
    eng = MPAsyncLLM(engine_config(model_path))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def server(engine: MPAsyncLLM) -> Iterator[Server]:
    yield from serve(engine)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def strict_server(engine: MPAsyncLLM) -> Iterator[Server]:
    """Same engine, with an API key and a small body limit."""
    yield from serve(engine, ServerConfig(api_key=API_KEY, max_request_bytes=SMALL_BODY_LIMIT))  # type: ignore[arg-type]
