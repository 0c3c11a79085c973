"""Fixtures: one AsyncLLM over a tiny random Llama (real BPE tokenizer, ChatML template), served
by real aiohttp servers on free ports of 127.0.0.1, each running its own event loop in a thread.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ep_helpers import API_KEY, SMALL_BODY_LIMIT, Server, engine_config, serve

from xlaserve.config import ServerConfig
from xlaserve.engine.async_llm import AsyncLLM


@pytest.fixture(scope="session")
def model_path(tiny_model_dir) -> str:  # noqa: ANN001
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def engine(model_path: str) -> Iterator[AsyncLLM]:
    eng = AsyncLLM.from_config(engine_config(model_path))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def server(engine: AsyncLLM) -> Iterator[Server]:
    yield from serve(engine)


@pytest.fixture(scope="session")
def strict_server(engine: AsyncLLM) -> Iterator[Server]:
    """Same engine, with an API key and a small body limit."""
    yield from serve(engine, ServerConfig(api_key=API_KEY, max_request_bytes=SMALL_BODY_LIMIT))
