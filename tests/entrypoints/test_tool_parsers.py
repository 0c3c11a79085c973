"""Tool-call parsers on the exact text each model family's template / model emits, whole and
streamed (fed in small pieces, as detokenized text grows)."""

from __future__ import annotations

import json

import pytest

from xlaserve.entrypoints.openai.tools import (
    TOOL_PARSERS,
    ToolPlan,
    ToolStreamer,
    get_tool_parser,
    plan_tools,
    required_schema,
)
from xlaserve.entrypoints.openai.tools.chat import AUTO_NEEDS_PARSER, ToolRequestError

W = {"city": "Paris", "unit": "celsius"}
T = {"tz": "UTC"}

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
        "Let me check.\n",
        [("get_weather", W), ("get_time", T)],
    ),
    (
        "qwen3",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>",
        None,
        [("get_weather", W)],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>",
        None,
        [("get_weather", W)],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"tz": "UTC"}}',
        None,
        [("get_weather", W), ("get_time", T)],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}',
        None,
        [("get_time", T)],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]',
        None,
        [("get_weather", W), ("get_time", T)],
    ),
    (
        "mistral",  # tokenizer v11+: name[ARGS]{...} per call
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}',
        None,
        [("get_weather", W), ("get_time", T)],
    ),
    (
        "pythonic",
        "[get_weather(city='Paris', unit='celsius'), get_time(tz=\"UTC\")]",
        None,
        [("get_weather", W), ("get_time", T)],
    ),
    (
        "pythonic",  # Llama 4
        "<|python_start|>[get_time(tz='UTC')]<|python_end|>",
        None,
        [("get_time", T)],
    ),
    (
        "deepseek_v3",
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
        '```json\n{"tz": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Sure.",
        [("get_weather", W), ("get_time", T)],
    ),
    (
        "deepseek_v31",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris", "unit": "celsius"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        None,
        [("get_weather", W)],
    ),
]


def _calls(calls: list) -> list[tuple[str, dict]]:  # noqa: ANN001
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_every_registered_parser_has_a_case() -> None:
    assert {c[0] for c in CASES} == set(TOOL_PARSERS)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_extract(name: str, text: str, content: str | None, calls: list) -> None:
    r = get_tool_parser(name).extract(text)
    assert r.content == content
    assert _calls(r.tool_calls) == calls


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed(name: str, text: str, content: str | None, calls: list, step: int) -> None:
    s = ToolStreamer(get_tool_parser(name))
    got_content, got_calls = "", []
    for end in range(step, len(text) + step, step):
        d, new = s.feed(text[:end], final=end >= len(text))
        got_content += d
        got_calls += new
    assert got_content == (content or "")
    assert _calls(got_calls) == calls
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_plain_text_stays_content(name: str) -> None:
    """Text that is not a tool call comes back whole, streamed or not."""
    text = "The weather in Paris is mild [citation] {not json} <tool_call maybe"
    p = get_tool_parser(name)
    r = p.extract(text)
    assert r.content == text and r.tool_calls == []
    s = ToolStreamer(p)
    out = "".join(s.feed(text[:i], final=i == len(text))[0] for i in range(1, len(text) + 1))
    assert out == text


def test_broken_tool_call_is_content() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"x": 1\n</tool_call>'
    r = get_tool_parser("hermes").extract(text)
    assert r.tool_calls == [] and r.content == text


def test_streamer_holds_back_a_marker_prefix() -> None:
    s = ToolStreamer(get_tool_parser("hermes"))
    assert s.feed("Hi <tool", final=False) == ("Hi ", [])
    assert s.feed("Hi <tools are fun", final=False)[0] == "<tools are fun"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
]


def test_plans() -> None:
    assert plan_tools(None, "none", False, None).mode == "none"
    assert plan_tools(TOOLS, "none", False, None).mode == "none"
    assert plan_tools(TOOLS, "required", False, None).mode == "required"
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False, None)
    assert named.mode == "named" and named.structured().json == {"type": "object"}
    with pytest.raises(ToolRequestError, match="enable-auto-tool-choice"):
        plan_tools(TOOLS, "auto", False, None)
    assert AUTO_NEEDS_PARSER
    assert plan_tools(TOOLS, "auto", True, "hermes").parser is not None


def test_required_schema_and_message() -> None:
    schema = required_schema(TOOLS)
    assert schema["minItems"] == 1
    names = [a["properties"]["name"]["enum"] for a in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    plan = ToolPlan("required", TOOLS)
    text = (
        '[{"name":"get_weather","parameters":{"city":"Rome"}},{"name":"get_time","parameters":{}}]'
    )
    content, calls = plan.message(text)
    assert content is None and _calls(calls) == [
        ("get_weather", {"city": "Rome"}),
        ("get_time", {}),
    ]
    assert plan.finish_reason("stop", True) == "tool_calls"
    # streamed: each call goes out once complete, with its index
    st = plan.streamer()
    entries = []
    for i in range(1, len(text) + 1):
        entries += st.delta(text[:i], i == len(text)).get("tool_calls", [])
    assert [(e["index"], e["function"]["name"]) for e in entries] == [
        (0, "get_weather"),
        (1, "get_time"),
    ]
    # cut short (max_tokens): the whole calls written so far, else the text back
    assert plan.message(text[:20]) == (text[:20], [])
    cut = text[: text.index(',{"name":"get_time"') + 5]
    content, calls = plan.message(cut)
    assert content is None and _calls(calls) == [("get_weather", {"city": "Rome"})]
    # parallel_tool_calls=false: at most one call
    assert required_schema(TOOLS, parallel=False)["maxItems"] == 1
    one = plan_tools(TOOLS, "auto", True, "hermes", parallel_tool_calls=False)
    two = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>'
    )
    assert [c.name for c in one.message(two)[1]] == ["a"]


def test_named_streams_arguments() -> None:
    plan = ToolPlan("named", TOOLS, function="get_weather")
    st = plan.streamer()
    text = '{"city":"Rome"}'
    deltas = [st.delta(text[:i], i == len(text)) for i in range(1, len(text) + 1)]
    first = deltas[0]["tool_calls"][0]
    assert first["function"]["name"] == "get_weather" and first["id"].startswith("chatcmpl-tool-")
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if d)
    assert args == text
    assert plan.finish_reason("stop", True) == "stop"  # OpenAI: a forced named call stops
