"""Jump-forward over the OpenAI API (official client, loopback): the forced tokens are streamed
and counted as completion tokens, and the text equals the token-by-token server's."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from ep_helpers import Server, engine_config, serve

from xlaserve.engine.async_llm import AsyncLLM

SCHEMA = {
    "type": "object",
    "properties": {
        "description_of_the_field_with_a_long_name": {"type": "string", "maxLength": 5},
        "another_quite_long_forced_key_name": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["description_of_the_field_with_a_long_name", "another_quite_long_forced_key_name"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def jf_server(model_path: str) -> Iterator[Server]:
    eng = AsyncLLM.from_config(engine_config(model_path, jump_forward=True, compile_workers=0))
    yield from serve(eng, owns_engine=True)


def _client(s: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.timeout(600)
def test_streamed_and_counted_like_token_by_token(jf_server: Server, server: Server) -> None:
    body = {
        "prompt": "In the beginning",
        "max_tokens": 120,
        "temperature": 0,
        "extra_body": {"structured_outputs": {"json": SCHEMA}},
    }
    plain, jf = _client(server), _client(jf_server)
    model = jf.models.list().data[0].id
    want = plain.completions.create(model=plain.models.list().data[0].id, **body)
    got = jf.completions.create(model=model, **body)
    assert got.choices[0].text == want.choices[0].text
    assert got.usage.completion_tokens == want.usage.completion_tokens
    obj = json.loads(got.choices[0].text)
    assert set(obj) == set(SCHEMA["properties"])
    stream = jf.completions.create(
        model=model, stream=True, stream_options={"include_usage": True}, **body
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == want.choices[0].text
    assert usage is not None and usage.completion_tokens == want.usage.completion_tokens
    assert jf_server.engine.engine.core.num_jump_forward_tokens > 0
