"""Property-based fuzzing of every endpoint's request body, against the real aiohttp app on
loopback with a real tiny model behind it.

Every reply must be 2xx, or 4xx with OpenAI's error JSON; never 5xx, never a hang (each request
has a client timeout). A stream that started (200) may only end in `[DONE]`, and an error event in
it must not be a server error. After each endpoint's batch a valid request still succeeds, the
engine is alive and every KV block is free again.

Budget: XLASERVE_FUZZ_EXAMPLES examples per endpoint (default 60; e.g. 1000 for a long run).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
from ep_helpers import MODEL_NAME
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rel_helpers import Client, Reply, check_error_body

from xlaserve.entrypoints.openai.protocol import MAX_N

EXAMPLES = int(os.environ.get("XLASERVE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("XLASERVE_FUZZ_RANDOM") is None,  # CI: reproducible
    suppress_health_check=list(HealthCheck),
    database=None,
)
VOCAB = 384  # tests/tiny_models.py
POST_ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]

# ---------------------------------------------------------------------------------- strategies

# Text with everything JSON can carry: any code point, lone surrogates, controls, NULs.
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
huge_ints = st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63) - 1])
ints = st.one_of(st.integers(-(10**6), 10**6), huge_ints)
floats = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e308, -1e308, 5e-324, -0.0, 1e-30]),
)
# Arbitrary JSON values (numbers stay JSON-legal here; NaN/inf are fuzzed on the raw bytes).
json_scalar = st.one_of(st.none(), st.booleans(), ints, floats, any_text)
json_garbage = st.recursive(
    json_scalar,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(any_text, kids, max_size=4)),
    max_leaves=12,
)


def field(valid: st.SearchStrategy, edge: st.SearchStrategy | None = None) -> st.SearchStrategy:
    """A field's plausible values; `mutate` later swaps a few fields for their edge values or
    for any JSON at all (kept on the strategy as `.edge`)."""
    valid.edge = st.one_of(edge, json_garbage) if edge is not None else json_garbage  # type: ignore[attr-defined]
    return valid


token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)
bad_token_ids = st.lists(st.one_of(st.integers(-5, VOCAB + 5), huge_ints), min_size=1, max_size=4)
prompt_text = st.one_of(
    st.text(min_size=1, max_size=60),
    st.text(st.characters(codec=None, exclude_categories=()), min_size=1, max_size=40),
    st.sampled_from(["In the beginning", "And God said", "🙂 日本語", "\ud800", "a\x00b"]),
)
model_names = st.one_of(
    st.just(MODEL_NAME),
    st.sampled_from(["/etc/passwd", "../../model", "gpt-4", "", "~/.cache/huggingface", "."]),
    any_text,
)
small_schema = st.sampled_from(
    [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "string", "maxLength": 3},
        {"type": "nonsense"},
        {"properties": 5},
        {},
    ]
)
sampling_fields: dict[str, st.SearchStrategy] = {
    "model": field(st.sampled_from([MODEL_NAME, None]), model_names),
    "n": field(st.integers(1, 3), st.sampled_from([0, -1, MAX_N + 1, 10**9])),
    "temperature": field(st.floats(0, 2), st.sampled_from([-1.0, 1e-30, 1e30, 1e308])),
    "top_p": field(st.floats(0.01, 1), st.floats(-1, 2)),
    "top_k": field(st.integers(-1, 600), huge_ints),
    "min_p": field(st.floats(0, 1), st.floats(-0.5, 1.5)),
    "presence_penalty": field(st.floats(-2, 2), st.floats(-3, 3)),
    "frequency_penalty": field(st.floats(-2, 2), st.floats(-3, 3)),
    "repetition_penalty": field(st.floats(0.01, 3), st.sampled_from([0.0, 1e30, 1e-30, 1e308])),
    "seed": field(st.integers(0, 2**63 - 1), ints),
    "stop": field(st.one_of(st.text(min_size=1, max_size=4), st.lists(any_text, max_size=3))),
    "stop_token_ids": field(st.lists(st.integers(0, VOCAB - 1), max_size=3), bad_token_ids),
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(st.integers(0, 2), st.integers(-1, 10)),
    "logit_bias": field(
        st.dictionaries(
            st.one_of(st.integers(-3, VOCAB + 3).map(str), any_text, huge_ints.map(str)),
            st.floats(-100, 100),
            max_size=3,
        ),
        st.dictionaries(
            st.integers(0, VOCAB - 1).map(str), st.one_of(st.floats(-150, 150), floats)
        ),
    ),
    "skip_special_tokens": field(st.booleans()),
    "include_stop_str_in_output": field(st.booleans()),
    "stream": field(st.booleans()),
    "stream_options": field(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    "user": field(any_text),
    "priority": field(ints),
    "cache_salt": field(any_text),
    "guided_choice": field(st.lists(st.text(min_size=0, max_size=5), max_size=3)),
    "guided_regex": field(st.sampled_from(["[ab]{1,3}", "(", "a*", "[z-a]", "\\d+"])),
    "guided_json": field(small_schema),
    "guided_grammar": field(st.sampled_from(['root ::= "a" | "b"', "root ::=", "x"])),
    "response_format": field(
        st.one_of(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "xml"])}),
            st.fixed_dictionaries(
                {
                    "type": st.just("json_schema"),
                    "json_schema": st.fixed_dictionaries(
                        {"name": any_text, "schema": small_schema}
                    ),
                }
            ),
        )
    ),
}
completion_fields = {
    **sampling_fields,
    "prompt": field(
        st.one_of(
            prompt_text,
            token_ids,
            st.lists(prompt_text, max_size=3),
            st.lists(token_ids, max_size=3),
        ),
        st.one_of(bad_token_ids, st.just([[]]), st.just([]), st.just("")),
    ),
    "max_tokens": field(st.integers(1, 6), huge_ints | st.sampled_from([0, -1, 10**4])),
    "echo": field(st.booleans()),
    "logprobs": field(st.integers(0, 5), st.integers(-1, 21)),
    "best_of": field(st.just(1), st.integers(0, 3)),
    "suffix": field(st.just(""), st.just("x")),
}
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", 7, "x"]),
        "content": st.one_of(
            prompt_text,
            st.none(),
            st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "text", "image_url"]), "text": any_text}
                ),
                max_size=2,
            ),
        ),
    },
    optional={"name": st.one_of(any_text, any_text, any_text, any_text, json_garbage)},
)
chat_fields = {
    **sampling_fields,
    "messages": field(st.lists(message, min_size=1, max_size=3), st.just([])),
    "max_tokens": field(st.integers(1, 6), huge_ints | st.integers(-1, 0)),
    "max_completion_tokens": field(st.integers(1, 6), st.integers(-1, 0)),
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(0, 5), st.integers(-1, 21)),
    "add_generation_prompt": field(st.booleans()),
    "echo": field(st.booleans()),
    "chat_template_kwargs": field(
        st.dictionaries(
            st.sampled_from(["messages", "bos_token", "foo", "add_generation_prompt"]),
            json_garbage,
            max_size=2,
        )
    ),
}
tokenize_fields = {
    "model": field(st.sampled_from([MODEL_NAME, None]), model_names),
    "prompt": field(prompt_text),
    "messages": field(st.lists(message, max_size=2)),
    "add_special_tokens": field(st.booleans()),
    "add_generation_prompt": field(st.booleans()),
}
detokenize_fields = {
    "model": field(st.sampled_from([MODEL_NAME, None]), model_names),
    "tokens": field(st.one_of(token_ids, st.just([])), bad_token_ids),
    "skip_special_tokens": field(st.booleans()),
}


@st.composite
def _body(draw: st.DrawFn, fields: dict[str, st.SearchStrategy], required: tuple[str, ...]) -> Any:
    if draw(st.sampled_from([False] * 7 + [True])):
        return draw(json_garbage)  # not an object at all, most likely
    opt = sorted(k for k in fields if k not in required)
    names = list(required) + draw(st.lists(st.sampled_from(opt), max_size=5, unique=True))
    body = {k: draw(fields[k]) for k in names}
    # Mutate 0-2 fields (present or not) into edge values / any JSON, or drop a required one.
    # (sampled_from leans to its first entries: the common case comes first.)
    n_mut = draw(st.sampled_from([0, 0, 1, 0, 1, 2]))
    for k in draw(
        st.lists(st.sampled_from(sorted(fields)), min_size=n_mut, max_size=n_mut, unique=True)
    ):
        body[k] = draw(fields[k].edge)
    if required and draw(st.sampled_from([False] * 9 + [True])):
        body.pop(required[0], None)
    if draw(st.sampled_from([False] * 9 + [True])):
        body.update(draw(st.dictionaries(any_text, json_garbage, max_size=2)))  # unknown keys
    return body


def bodies(fields: dict[str, st.SearchStrategy], required: tuple[str, ...]) -> st.SearchStrategy:
    """Mostly valid bodies with a few fields mutated; sometimes any JSON at all."""
    return _body(fields, required)


# ---------------------------------------------------------------------------------- checks

STATS: dict[str, dict[str, int]] = {}
SLOW: list[tuple[float, int, str]] = []


def check_reply(route: str, reply: Reply) -> None:
    """The property every reply must have."""
    counts = STATS.setdefault(route, {})
    key = f"{reply.status // 100}xx"
    counts[key] = counts.get(key, 0) + 1
    assert reply.status < 500, (reply.status, reply.body[:500])
    if reply.status >= 400:
        check_error_body(reply)
        return
    assert 200 <= reply.status < 300, reply.status
    if reply.events is None:
        json.loads(reply.body)  # a JSON document
        return
    assert reply.events and reply.events[-1] == "[DONE]", reply.body[-300:]
    for ev in reply.events[:-1]:
        assert isinstance(ev, dict), ev
        if "error" in ev:
            counts["stream-error"] = counts.get("stream-error", 0) + 1
            code = ev["error"]["code"]
            assert not (isinstance(code, int) and code >= 500), ev


def check_still_serving(client: Client, engine: Any) -> None:
    """A valid request succeeds, the engine is alive, and every KV block is free again."""
    r = client.send(
        "POST",
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "In the beginning", "max_tokens": 4, "temperature": 0},
    )
    assert r.status == 200, r.body
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] == 4
    assert client.send("GET", "/health").status == 200
    assert not engine.errored
    end = time.monotonic() + 20
    while time.monotonic() < end and (
        engine.stats.kv_cache_usage > 0 or engine.stats.num_running or engine.stats.num_waiting
    ):
        time.sleep(0.05)
    assert engine.stats.kv_cache_usage == 0.0
    assert engine.stats.num_running == 0 and engine.stats.num_waiting == 0


def run_fuzz(client: Client, engine: Any, route: str, strategy: st.SearchStrategy) -> None:
    @FUZZ
    @given(body=strategy)
    def one(body: Any) -> None:
        t0 = time.monotonic()
        reply = client.send("POST", route, body)
        SLOW.append((time.monotonic() - t0, reply.status, json.dumps(body)[:300]))
        check_reply(route, reply)

    one()
    check_still_serving(client, engine)
    print(f"\nfuzz {route}: {EXAMPLES} examples, replies {STATS.get(route)}")
    if os.environ.get("XLASERVE_FUZZ_SLOW"):
        for row in sorted(SLOW, reverse=True)[:5]:
            print("slow:", row)
    SLOW.clear()


# ---------------------------------------------------------------------------------- tests


def test_fuzz_completions(fuzz_client: Client, fuzz_server) -> None:  # noqa: ANN001
    run_fuzz(
        fuzz_client,
        fuzz_server.engine,
        "/v1/completions",
        bodies(completion_fields, ("prompt", "max_tokens")),
    )


def test_fuzz_chat_completions(fuzz_client: Client, fuzz_server) -> None:  # noqa: ANN001
    run_fuzz(
        fuzz_client,
        fuzz_server.engine,
        "/v1/chat/completions",
        bodies(chat_fields, ("messages", "max_tokens")),
    )


def test_fuzz_tokenize(fuzz_client: Client, fuzz_server) -> None:  # noqa: ANN001
    run_fuzz(fuzz_client, fuzz_server.engine, "/tokenize", bodies(tokenize_fields, ("prompt",)))


def test_fuzz_detokenize(fuzz_client: Client, fuzz_server) -> None:  # noqa: ANN001
    run_fuzz(fuzz_client, fuzz_server.engine, "/detokenize", bodies(detokenize_fields, ("tokens",)))


# Raw bytes: malformed JSON, NaN/Infinity, deep nesting, invalid UTF-8, any content type.
raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.sampled_from(
        [
            b"",
            b"{",
            b"null",
            b"[]",
            b'"prompt"',
            b'{"prompt": NaN, "max_tokens": 2}',
            b'{"prompt": "x", "temperature": NaN}',
            b'{"prompt": "x", "temperature": Infinity}',
            b'{"prompt": "x", "top_p": -Infinity}',
            b'{"prompt": "x", "max_tokens": 1e999}',
            b'{"prompt": "x", "logit_bias": {"5": NaN}}',
            b'{"prompt": "x", "seed": 123456789012345678901234567890}',
            b'{"prompt": "x", "max_tokens": 2, "max_tokens": "two"}',
            b'{"prompt": "\\ud800\\udfff\\ud800", "max_tokens": 2}',
            b'{"prompt": "\xff\xfe", "max_tokens": 2}',
            b'{"tokens": [1, 2e400]}',
            b"[" * 100_000 + b"]" * 100_000,
            b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
            b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": '
            + b'{"x": ' * 5000
            + b"1"
            + b"}" * 5001,
        ]
    ),
    json_garbage.map(lambda v: json.dumps(v).encode()),
)
content_types = st.sampled_from(
    [
        None,
        "application/json",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json; charset=latin-1",
        "\x7f",
    ]
)


def test_fuzz_raw_bytes_and_content_types(fuzz_client: Client, fuzz_server) -> None:  # noqa: ANN001
    @FUZZ
    @given(
        route=st.sampled_from(POST_ROUTES + ["/v1/models", "/nope"]),
        raw=raw_bodies,
        ctype=content_types,
        method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE"]),
    )
    def one(route: str, raw: bytes, ctype: str | None, method: str) -> None:
        if ctype == "\x7f":
            ctype = "application/json"  # aiohttp refuses control characters in headers itself
        reply = fuzz_client.send(method, route, raw=raw, content_type=ctype)
        check_reply("raw", reply)
        if route == "/v1/models" and method == "GET":
            assert reply.status == 200 and reply.json()["data"][0]["id"] == MODEL_NAME

    one()
    check_still_serving(fuzz_client, fuzz_server.engine)
    print(f"\nfuzz raw bytes: {EXAMPLES} examples, replies {STATS.get('raw')}")


@pytest.mark.parametrize(
    "route,body,status",
    [
        # ~1 MB of text (under the 4 MiB limit): tokenized, then refused for the context length.
        ("/v1/completions", {"prompt": "And God said, " * 70_000, "max_tokens": 2}, 400),
        ("/tokenize", {"prompt": "light " * 150_000}, 200),
        # a 1 MB stop string: over --max-stop-string-chars (issue 32), refused before any work
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": ["z" * 1_000_000]}, 400),
        ("/v1/completions", {"prompt": list(range(3)) * 300_000, "max_tokens": 2}, 400),
        ("/detokenize", {"tokens": [5] * 500_000}, 200),
        # over the 4 MiB limit: 413 before anything is parsed
        ("/v1/completions", {"prompt": "x" * 5_000_000}, 413),
    ],
    ids=["long-prompt", "long-tokenize", "long-stop", "many-token-ids", "long-detok", "too-big"],
)
def test_very_long_bodies(
    fuzz_client: Client, fuzz_server, route: str, body: dict, status: int
) -> None:  # noqa: ANN001, E501
    reply = fuzz_client.send("POST", route, body)
    assert reply.status == status, reply.body[:300]
    if status >= 400:
        err = check_error_body(reply)
        if status == 400:
            assert "context length" in err["message"] or err["param"] == "stop"
    check_reply("long", reply)
