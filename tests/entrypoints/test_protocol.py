"""Request-body validation (no server): types, param names, defaults, SamplingParams mapping."""

from __future__ import annotations

import pytest

from xlaserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    TokenizeRequest,
    param_from_message,
    parse_body,
)


def _err(cls: type, body: object) -> ProtocolError:
    with pytest.raises(ProtocolError) as ei:
        parse_body(cls, body)
    return ei.value


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "x", "n": True}, "n"),  # booleans are not integers
        ({"prompt": "x", "stop": 3}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
    ],
)
def test_completion_bad_types_name_the_param(body: dict, param: str) -> None:
    assert _err(CompletionRequest, body).param == param


def test_body_must_be_object() -> None:
    assert "JSON object" in _err(CompletionRequest, [1, 2]).message


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "text": ""}]}]},
            "messages",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_chat_bad_bodies(body: dict, param: str) -> None:
    assert _err(ChatCompletionRequest, body).param == param


def test_unknown_fields_ignored_and_prompt_forms() -> None:
    r = parse_body(CompletionRequest, {"prompt": "hi", "frobnicate": 1, "max_tokens": 4.0})
    assert r.max_tokens == 4 and r.prompts() == ["hi"]
    assert parse_body(CompletionRequest, {"prompt": [1, 2, 3]}).prompts() == [[1, 2, 3]]
    assert parse_body(CompletionRequest, {"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert parse_body(CompletionRequest, {"prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]


def test_completion_to_sampling_params() -> None:
    r = parse_body(
        CompletionRequest,
        {
            "prompt": "x",
            "n": 2,
            "best_of": 2,
            "temperature": 0,
            "top_k": -1,
            "stop": "\n",
            "logit_bias": {"5": -100},
            "echo": True,
            "logprobs": 3,
            "seed": 7,
        },
    )
    p = r.to_sampling_params()
    assert (p.n, p.temperature, p.top_k, p.stop, p.seed) == (2, 0.0, 0, ["\n"], 7)
    assert p.logit_bias == {5: -100.0}
    assert (p.logprobs, p.prompt_logprobs, p.max_tokens) == (3, 3, 16)
    with pytest.raises(ValueError, match="top_p") as ei:
        parse_body(CompletionRequest, {"prompt": "x", "top_p": 1.5}).to_sampling_params()
    assert param_from_message(str(ei.value)) == "top_p"


def test_chat_to_sampling_params() -> None:
    base = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    }
    r = parse_body(
        ChatCompletionRequest,
        {**base, "max_tokens": 5, "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 4},
    )
    p = r.to_sampling_params()
    assert (p.max_tokens, p.logprobs) == (9, 4)
    assert r.messages[0].text() == "ab"
    assert parse_body(ChatCompletionRequest, base).to_sampling_params().max_tokens is None
    assert parse_body(ChatCompletionRequest, base).to_sampling_params().logprobs is None
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    p = parse_body(ChatCompletionRequest, {**base, "response_format": rf}).to_sampling_params()
    assert p.structured_outputs is not None and p.structured_outputs.json == {"type": "object"}


def test_tokenize_needs_exactly_one_input() -> None:
    assert _err(TokenizeRequest, {}).param == "prompt"
    assert parse_body(TokenizeRequest, {"prompt": "x"}).prompt == "x"
