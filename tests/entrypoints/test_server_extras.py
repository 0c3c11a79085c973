"""vLLM details of the server: --generation-config defaults, CORS, GET /v1/models/{id}."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import openai
import pytest
from ep_helpers import Server, http, metric, serve, wait_until

from xlaserve.config import ServerConfig
from xlaserve.engine.async_llm import AsyncLLM
from xlaserve.entrypoints.openai.generation_defaults import (
    apply_generation_defaults,
    load_generation_defaults,
)
from xlaserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)

MSGS = [{"role": "user", "content": "In the beginning"}]


def test_demo_model_generation_defaults() -> None:
    import xlaserve

    demo = os.path.join(os.path.dirname(xlaserve.__file__), "assets", "demo-kjv")
    d = load_generation_defaults("auto", demo)
    assert d == {"temperature": 0.8, "top_p": 0.95, "max_tokens": 128}  # top_k 0 = none
    assert load_generation_defaults("vllm", demo) == {}
    with pytest.raises(ValueError, match="generation_config.json"):
        load_generation_defaults("/nonexistent", demo)


def test_defaults_fill_only_unset_fields() -> None:
    d = {"temperature": 0.5, "top_k": 7, "max_tokens": 9}
    chat = parse_body(ChatCompletionRequest, {"messages": MSGS, "temperature": 1.5})
    apply_generation_defaults(chat, d)
    p = chat.to_sampling_params()
    assert (p.temperature, p.top_k, p.max_tokens) == (1.5, 7, 9)
    chat = parse_body(ChatCompletionRequest, {"messages": MSGS, "max_completion_tokens": 3})
    apply_generation_defaults(chat, d)
    assert chat.to_sampling_params().max_tokens == 3
    cmpl = parse_body(CompletionRequest, {"prompt": "x"})
    apply_generation_defaults(cmpl, d)
    assert cmpl.to_sampling_params().max_tokens == 16  # OpenAI's completions default stays


@pytest.fixture(scope="module")
def gen_server(engine: AsyncLLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("genconf")
    with open(d / "generation_config.json", "w") as f:
        json.dump({"top_k": 1, "max_new_tokens": 5, "do_sample": True}, f)
    yield from serve(
        engine, ServerConfig(generation_config=str(d), allowed_origins=["https://a.example"])
    )


def test_generation_config_dir_applies(gen_server: Server, server: Server) -> None:
    c = openai.OpenAI(base_url=gen_server.base_url + "/v1", api_key="none", max_retries=0)
    r = c.chat.completions.create(model="tiny", messages=MSGS, seed=1)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    # top_k=1 from the file: greedy, whatever the seed
    greedy = c.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=5)
    assert r.choices[0].message.content == greedy.choices[0].message.content
    # the request's own value wins
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_cors(server: Server, gen_server: Server) -> None:
    pre = {
        "Origin": "https://x.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    status, headers, _ = http("OPTIONS", server.base_url + "/v1/chat/completions", headers=pre)
    assert status == 200
    assert headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "authorization" in headers["Access-Control-Allow-Headers"].lower()
    status, headers, _ = http(
        "GET", server.base_url + "/v1/models", headers={"Origin": "https://x.example"}
    )
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    # a listed origin only
    url = gen_server.base_url + "/v1/models"
    status, headers, _ = http("GET", url, headers={"Origin": "https://a.example"})
    assert headers["Access-Control-Allow-Origin"] == "https://a.example"
    status, headers, _ = http("GET", url, headers={"Origin": "https://evil.example"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = http("OPTIONS", url, headers={**pre, "Origin": "https://evil.example"})
    assert status == 403


def test_cors_preflight_needs_no_api_key(strict_server: Server) -> None:
    pre = {"Origin": "https://x.example", "Access-Control-Request-Method": "POST"}
    status, headers, _ = http("OPTIONS", strict_server.base_url + "/v1/completions", headers=pre)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    # errors carry the CORS header too (a browser client can read the 401)
    status, headers, _ = http(
        "GET", strict_server.base_url + "/v1/models", headers={"Origin": "https://x.example"}
    )
    assert status == 401 and headers["Access-Control-Allow-Origin"] == "*"


def test_retrieve_model(server: Server) -> None:
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    m = c.models.retrieve("tiny")
    assert m.id == "tiny" and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("other")


VLLM_SERIES = (
    "inter_token_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_params_n",
)


def test_vllm_metric_series(engine: AsyncLLM) -> None:
    for s in serve(engine):  # a fresh app: its own registry, counts start at 0
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0)
        c.completions.create(
            model="tiny", prompt="And God", max_tokens=4, n=2, extra_body={"ignore_eos": True}
        )
        for _ in c.completions.create(
            model="tiny", prompt="And God", max_tokens=4, stream=True,
            extra_body={"ignore_eos": True},
        ):  # fmt: skip
            pass

        url = s.base_url + "/metrics"

        def scraped(url: str = url) -> str:
            return http("GET", url)[2].decode()

        assert wait_until(lambda: metric(scraped(), "xlaserve:request_params_n_count") == 2)
        text = scraped()
        for name in VLLM_SERIES:
            assert metric(text, f"xlaserve:{name}_count") > 0, name
        assert metric(text, "xlaserve:request_params_n_sum") == 3  # n=2 and n=1
        # 4 tokens streamed: at least one gap between deliveries (coalescing may merge some)
        assert 1 <= metric(text, "xlaserve:inter_token_latency_seconds_count") <= 3 + 3
        assert metric(text, "xlaserve:request_decode_time_seconds_sum") >= 0
        # engine-wide (the shared engine's steps so far): tokens per step, a histogram
        steps = metric(text, "xlaserve:iteration_tokens_total_count")
        assert steps > 0 and metric(text, "xlaserve:iteration_tokens_total_sum") >= steps
        inf = [ln for ln in text.splitlines() if 'iteration_tokens_total_bucket{le="+Inf"' in ln]
        assert inf and float(inf[0].rsplit(" ", 1)[1]) == steps


def test_iteration_tokens_over_the_wire_and_summed() -> None:
    """The per-step histogram survives the core process's msgpack and the DP replicas' sum."""
    from xlaserve.engine.core import EngineStats
    from xlaserve.engine.core_proc import pack, stats_from_wire, stats_to_wire, unpack

    s = EngineStats(1, 2, 0.5, 10, 5, 0, 0, 0, 3, 4)
    s.iteration_tokens_buckets = type(s.iteration_tokens_buckets)([1] + [0] * 12 + [2])
    t = stats_from_wire(unpack(pack(stats_to_wire(s))))
    assert t.iteration_tokens_buckets == s.iteration_tokens_buckets
    assert sum([t.iteration_tokens_buckets, s.iteration_tokens_buckets]) == tuple(
        [2] + [0] * 12 + [4]
    )
