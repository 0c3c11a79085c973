"""Fixtures for the reliability tests: a tiny random Llama behind a real aiohttp server on a free
loopback port (ep_helpers' ServerThread), with a short context so fuzzed requests stay quick."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ep_helpers import Server, engine_config, serve
from rel_helpers import Client

from xlaserve.engine.async_llm import AsyncLLM

FUZZ_MAX_MODEL_LEN = 48


@pytest.fixture(scope="session")
def rel_model_path(tiny_model_dir) -> str:  # noqa: ANN001
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def fuzz_server(rel_model_path: str) -> Iterator[Server]:
    """One engine + server shared by the fuzz and tokenizer-edge tests (owned: shut down at the end)."""
    eng = AsyncLLM.from_config(
        engine_config(
            rel_model_path,
            num_kv_blocks=256,
            max_model_len=FUZZ_MAX_MODEL_LEN,
            max_num_seqs=32,
            max_num_batched_tokens=256,
        )
    )
    yield from serve(eng, owns_engine=True)


@pytest.fixture(scope="session")
def fuzz_client(fuzz_server: Server) -> Iterator[Client]:
    c = Client(fuzz_server.base_url)
    yield c
    c.close()
