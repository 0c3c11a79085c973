"""Fixtures for the attack tests: one AsyncLLM over the tiny Llama (ChatML template with real
special tokens), served by real aiohttp servers on 127.0.0.1 with the production runner settings
(`RUNNER_KWARGS`: bodies inflated by the app, bounded). Every request has a client timeout and
every loop is bounded, so an attack that works fails the test instead of hanging it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ep_helpers import Server, engine_config, serve
from sec_helpers import KEY_A, KEY_B

from xlaserve.config import ServerConfig
from xlaserve.engine.async_llm import AsyncLLM


@pytest.fixture(scope="session")
def sec_engine(tiny_model_dir) -> Iterator[AsyncLLM]:  # noqa: ANN001
    eng = AsyncLLM.from_config(
        engine_config(
            tiny_model_dir("llama"),
            # Big enough for the 100k-entry choice list (1.3 MB), whose compile must be
            # cut off by the 3 s timeout (it takes 20-60 s even on the tiny vocabulary).
            max_grammar_bytes=2 * 1024 * 1024,
            compile_timeout=3.0,
            compile_workers=2,
        )
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def sec_server(sec_engine: AsyncLLM) -> Iterator[Server]:
    """Default server settings (the safe defaults are what is under test)."""
    yield from serve(sec_engine)


@pytest.fixture(scope="session")
def tenant_server(sec_engine: AsyncLLM) -> Iterator[Server]:
    """Two API keys, prompt-token details on (so the side channel would be visible)."""
    cfg = ServerConfig(api_key=[KEY_A, KEY_B], enable_prompt_tokens_details=True)
    yield from serve(sec_engine, cfg)
