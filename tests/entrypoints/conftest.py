"""Fixtures: one AsyncLLM over a tiny random Llama (real BPE tokenizer, ChatML template), served
by real aiohttp servers on free ports of 127.0.0.1, each running its own event loop in a thread;
and `served`: `xlaserve serve` subprocesses over the same model, one per backend.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import serve_proc
from ep_helpers import API_KEY, MODEL_NAME, SMALL_BODY_LIMIT, Server, engine_config, serve
from optional_deps import backend_available

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


# The backends whose server tests run here: XLA whenever jax is installed (a broken jax install
# fails at collection instead of dropping the XLA cases).
SERVE_BACKENDS = [b for b in ("torch", "xla") if backend_available(b)]


@pytest.fixture(scope="session", params=SERVE_BACKENDS)
def served(
    request: pytest.FixtureRequest, model_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[serve_proc.ServeProcess]:
    """`xlaserve serve` in a subprocess, per backend (one at a time: pytest finishes every test
    of one param before starting the next)."""
    extra = []
    if request.param == "xla":  # compiled programs cached for the session, not in $HOME
        extra = ["--compilation-cache-dir", str(tmp_path_factory.mktemp("serve-jax-cache"))]
    proc = serve_proc.start(model_path, request.param, MODEL_NAME, *extra)
    yield proc
    proc.stop()
