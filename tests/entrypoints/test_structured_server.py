"""Structured output over the OpenAI API: response_format, structured_outputs and guided_* extras."""

from __future__ import annotations

import json
import re

import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:  # noqa: ANN001
    """An `xlaserve serve` subprocess per backend (torch, xla)."""
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="none", max_retries=0)


def test_chat_json_schema(client: openai.OpenAI, model_path: str) -> None:
    r = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Give a person as JSON"}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
        max_tokens=60,
        temperature=0,
    )
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)
    assert r.choices[0].finish_reason == "stop"


def test_completions_extras(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    r = client.completions.create(
        model=model,
        prompt="Pick:",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["light", "darkness"]}},
    )
    assert r.choices[0].text in ("light", "darkness")
    r = client.completions.create(
        model=model,
        prompt="Digits:",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"},
    )
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].text)
    # /v1/completions takes response_format too (vLLM does); the openai client passes it as extra_body
    r = client.completions.create(
        model=model,
        prompt="Obj:",
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert r.choices[0].text.startswith("{")


def test_bad_constraints_get_400(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="regex|parse|Regex"):
        client.completions.create(
            model=model, prompt="x", max_tokens=4, extra_body={"guided_regex": "([a-z"}
        )
    with pytest.raises(openai.BadRequestError, match="at most one"):
        client.completions.create(
            model=model,
            prompt="x",
            max_tokens=4,
            extra_body={"guided_regex": "a", "guided_choice": ["b"]},
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "nope"}},
            },
        )
    # still serving
    assert (
        client.completions.create(model=model, prompt="x", max_tokens=2).choices[0].text is not None
    )
