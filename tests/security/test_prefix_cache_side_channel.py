"""Attack class 5: the prefix cache as a cross-client side channel. `cached_tokens` is reported
only with `enable_prompt_tokens_details`; with several API keys each key gets its own cache salt,
so one tenant's cache hits say nothing about what another tenant sent."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from ep_helpers import MODEL_NAME, Server, http, serve
from sec_helpers import KEY_A, KEY_B

from xlaserve.config import ServerConfig
from xlaserve.engine.async_llm import AsyncLLM

SECRET = "The password of the vault in the house of the Lord is seventy seven times seven. " * 3


def _cached(server: Server, key: str | None, prompt: str) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}
    status, _, raw = http("POST", server.base_url + "/v1/completions", body, headers)
    assert status == 200, raw
    return json.loads(raw)["usage"]


@pytest.fixture(scope="module")
def shared_server(sec_engine: AsyncLLM) -> Iterator[Server]:
    cfg = ServerConfig(
        api_key=[KEY_A, KEY_B],
        enable_prompt_tokens_details=True,
        share_prefix_cache_across_keys=True,
    )
    yield from serve(sec_engine, cfg)


def test_cached_tokens_are_not_reported_by_default(sec_server: Server) -> None:
    _cached(sec_server, None, SECRET + "one")
    usage = _cached(sec_server, None, SECRET + "two")
    assert "prompt_tokens_details" not in usage
    assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_each_api_key_has_its_own_prefix_cache(tenant_server: Server) -> None:
    secret = SECRET + "alpha beta"
    _cached(tenant_server, KEY_A, secret + " a1")
    # Tenant B guesses A's prefix: no hit (its own salt).
    assert _cached(tenant_server, KEY_B, secret + " b1")["prompt_tokens_details"] == {
        "cached_tokens": 0
    }
    # Tenant A itself still hits its own prefix.
    assert (
        _cached(tenant_server, KEY_A, secret + " a2")["prompt_tokens_details"]["cached_tokens"] > 0
    )


def test_operator_can_share_the_cache_between_keys(shared_server: Server) -> None:
    secret = SECRET + "gamma delta"
    _cached(shared_server, KEY_A, secret + " a1")
    assert (
        _cached(shared_server, KEY_B, secret + " b1")["prompt_tokens_details"]["cached_tokens"] > 0
    )
