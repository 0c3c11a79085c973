"""--runner pooling: /v1/embeddings (official openai client), /pooling, /score, /rerank on the
tiny Llama, checked against transformers' final hidden states pooled the same way."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from ep_helpers import MODEL_NAME, Server, http, serve

from xlaserve.config import ServerConfig
from xlaserve.engine.async_llm import AsyncLLM
from xlaserve.entrypoints.openai.serving_pooling import pool

TEXTS = ["In the beginning God created the heaven and the earth.", "And God said", "light"]


@pytest.fixture(scope="module")
def last_server(engine: AsyncLLM) -> Iterator[Server]:
    yield from serve(engine, ServerConfig(runner="pooling"))


@pytest.fixture(scope="module")
def mean_server(engine: AsyncLLM) -> Iterator[Server]:
    yield from serve(
        engine, ServerConfig(runner="pooling", pooling_type="MEAN", pooling_normalize=False)
    )


@pytest.fixture(scope="module")
def hf_hidden(model_path: str, last_server: Server) -> list[np.ndarray]:
    import torch
    import transformers as tf

    model = tf.AutoModel.from_pretrained(model_path, dtype=torch.float32)
    out = []
    for t in TEXTS:
        ids = json.loads(http("POST", last_server.base_url + "/tokenize", {"prompt": t})[2])
        with torch.no_grad():
            h = model(torch.tensor([ids["tokens"]])).last_hidden_state[0]
        out.append(h.numpy())
    return out


def _client(s: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0)


def test_pool_rules() -> None:
    h = np.array([[3.0, 4.0], [0.0, 2.0]], dtype=np.float32)
    assert pool(h, "LAST", False).tolist() == [0.0, 2.0]
    assert pool(h, "CLS", True).tolist() == pytest.approx([0.6, 0.8])
    assert pool(h, "MEAN", False).tolist() == [1.5, 3.0]


def test_embeddings_equal_transformers_last(last_server: Server, hf_hidden: list) -> None:
    c = _client(last_server)
    r = c.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the client asks for base64
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, h in zip(r.data, hf_hidden, strict=True):
        want = h[-1] / np.linalg.norm(h[-1])
        np.testing.assert_allclose(d.embedding, want, atol=1e-4)
    assert r.usage.prompt_tokens == sum(len(h) for h in hf_hidden)
    f = c.embeddings.create(model=MODEL_NAME, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(f.data[0].embedding, r.data[0].embedding, atol=1e-6)


def test_embeddings_equal_transformers_mean(mean_server: Server, hf_hidden: list) -> None:
    r = _client(mean_server).embeddings.create(
        model=MODEL_NAME, input=TEXTS, encoding_format="float"
    )
    for d, h in zip(r.data, hf_hidden, strict=True):
        np.testing.assert_allclose(d.embedding, h.mean(0), atol=1e-4)


def test_pooling_score_rerank(last_server: Server) -> None:
    base = last_server.base_url
    st, _, raw = http("POST", base + "/pooling", {"input": TEXTS[:2]})
    pooled = [d["data"] for d in json.loads(raw)["data"]]
    assert st == 200 and len(pooled) == 2
    st, _, raw = http("POST", base + "/score", {"text_1": TEXTS[0], "text_2": TEXTS})
    scores = [d["score"] for d in json.loads(raw)["data"]]
    assert st == 200 and scores[0] == pytest.approx(1.0, abs=1e-5)
    assert scores[1] == pytest.approx(float(np.dot(pooled[0], pooled[1])), abs=1e-5)
    st, _, raw = http(
        "POST", base + "/v1/rerank", {"query": TEXTS[0], "documents": TEXTS[::-1], "top_n": 2}
    )
    res = json.loads(raw)["results"]
    assert st == 200 and len(res) == 2
    assert res[0]["index"] == 2 and res[0]["document"]["text"] == TEXTS[0]
    assert res[0]["relevance_score"] >= res[1]["relevance_score"]


def test_pooling_errors(last_server: Server) -> None:
    c = _client(last_server)
    with pytest.raises(openai.BadRequestError, match="runner pooling"):
        c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="input"):
        c.embeddings.create(model=MODEL_NAME, input=[])
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        c.embeddings.create(model=MODEL_NAME, input="x", dimensions=3)
    with pytest.raises(openai.NotFoundError):
        c.embeddings.create(model="other", input="x")
    st, _, _ = http("POST", last_server.base_url + "/v1/embeddings", {"input": [[10**9]]})
    assert st == 400


@pytest.fixture(scope="module")
def xla_server(model_path: str) -> Iterator[Server]:
    """The XLA backend in-process (small buckets: few programs to compile)."""
    from ep_helpers import engine_config
    from optional_deps import backend_available

    if not backend_available("xla"):
        pytest.skip("jax is not installed")
    eng = AsyncLLM.from_config(
        engine_config(
            model_path, backend="xla", max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64
        )
    )
    try:
        yield from serve(eng, ServerConfig(runner="pooling", pooling_type="MEAN"))
    finally:
        eng.shutdown()


def test_xla_embeddings_equal_transformers(xla_server: Server, hf_hidden: list) -> None:
    r = _client(xla_server).embeddings.create(model=MODEL_NAME, input=TEXTS)
    for d, h in zip(r.data, hf_hidden, strict=True):
        want = h.mean(0) / np.linalg.norm(h.mean(0))
        np.testing.assert_allclose(d.embedding, want, atol=1e-4)
