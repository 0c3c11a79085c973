"""POST /v1/responses through the official openai client (client.responses): text in and out,
instructions, streaming events, tools, store=false, and clear 400s for what is not supported."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from ep_helpers import MODEL_NAME, Server, http, serve

from xlaserve.config import ServerConfig
from xlaserve.engine.async_llm import AsyncLLM

TOOLS = [
    {
        "type": "function",
        "name": "get_time",
        "description": "Time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    }
]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def test_text_in_text_out(client: openai.OpenAI, server: Server) -> None:
    r = client.responses.create(
        model=MODEL_NAME, input="In the beginning", max_output_tokens=6, temperature=0,
        instructions="Speak as the KJV.",
    )  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage.output_tokens == 6 and r.store is False
    # the same text as the chat endpoint gives for the same messages
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": "Speak as the KJV."},
            {"role": "user", "content": "In the beginning"},
        ],
        max_tokens=6,
        temperature=0,
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    # input as a list of items, with text parts
    r2 = client.responses.create(
        model=MODEL_NAME,
        input=[
            {"role": "system", "content": "Speak as the KJV."},
            {"role": "user", "content": [{"type": "input_text", "text": "In the beginning"}]},
        ],
        max_output_tokens=6,
        temperature=0,
    )
    assert r2.output_text == r.output_text


def test_streaming_events(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL_NAME, input="And God said", max_output_tokens=5, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.incomplete"
    assert "response.output_item.added" in types and "response.output_text.done" in types
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == text


def test_forced_tool_call(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL_NAME, input="What time is it?", tools=TOOLS, tool_choice="required",
        max_output_tokens=80, temperature=0,
    )  # fmt: skip
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_time"
    assert json.loads(calls[0].arguments)["tz"] in ("UTC", "CET")
    # streamed: a function_call item with its arguments
    events = list(
        client.responses.create(
            model=MODEL_NAME, input="What time is it?", tools=TOOLS,
            tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=40,
            temperature=0, stream=True,
        )
    )  # fmt: skip
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments)["tz"] in ("UTC", "CET")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == done[0].arguments
    # the round trip: the call and its output go back in as items
    r = client.responses.create(
        model=MODEL_NAME,
        input=[
            {"role": "user", "content": "What time is it?"},
            {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": '{"tz": "UTC"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=3,
    )  # fmt: skip
    assert r.output_text


def test_auto_tools_need_a_parser(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        client.responses.create(model=MODEL_NAME, input="x", tools=TOOLS)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": []}, "input"),
    ],
)  # fmt: skip
def test_unsupported_is_400(server: Server, extra: dict, param: str) -> None:
    body = {"model": MODEL_NAME, "input": "hi", **extra}
    status, _, raw = http("POST", server.base_url + "/v1/responses", body)
    assert status == 400
    assert json.loads(raw)["error"]["param"] == param


def test_nothing_is_stored(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_abc")


@pytest.fixture(scope="module")
def auto_client(engine: AsyncLLM) -> Iterator[openai.OpenAI]:
    cfg = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    for s in serve(engine, cfg):
        yield openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0)


def test_auto_tool_call_parsed(auto_client: openai.OpenAI) -> None:
    regex = r'<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "(UTC|CET)"\}\}\n</tool_call>'
    r = auto_client.responses.create(
        model=MODEL_NAME, input="What time is it?", tools=TOOLS, max_output_tokens=150,
        temperature=0, extra_body={"guided_regex": regex},
    )  # fmt: skip
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_time" and json.loads(call.arguments)["tz"] in ("UTC", "CET")
