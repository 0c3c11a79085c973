"""Pooling endpoints (`--runner pooling`): POST /v1/embeddings, /pooling, /score (/v1/score),
/rerank (/v1/rerank, /v2/rerank), as vLLM serves a decoder model as an embedding model.

Each input is tokenized (special tokens as the tokenizer adds them), run through the model in
one prefill batch (backends_torch/pooling.py or backends_xla/pooling.py: final-norm hidden
states), then pooled (`pool`: LAST token, MEAN over tokens or CLS = first token) and
L2-normalised (unless --no-pooling-normalize). /score and /rerank score pairs by the cosine
similarity of their embeddings (a bi-encoder, as vLLM does for embedding models; no
cross-encoder head).

Shapes: embeddings response `{"object": "list", "data": [{"object": "embedding", "index",
"embedding": [H floats] or base64 of float32 little-endian}], "model", "usage"}`; /score
`{"data": [{"index", "object": "score", "score"}]}`; /rerank `{"results": [{"index",
"document": {"text"}, "relevance_score"}]}` by decreasing score, cut to `top_n`.
"""

from __future__ import annotations

import base64
import threading
import time
import uuid
from typing import Any

import numpy as np
from aiohttp import web

from xlaserve.entrypoints.openai import api_server as srv
from xlaserve.entrypoints.openai.protocol import ProtocolError

POOLER_KEY = web.AppKey("pooler", object)

# Most inputs one pooling request may carry.
MAX_INPUTS = 256


def pool(hidden: np.ndarray, kind: str, normalize: bool) -> np.ndarray:
    """hidden [T, H] -> [H]: LAST (last token), MEAN (all tokens), CLS (first token); then
    divided by its L2 norm when `normalize` (a zero vector stays zero)."""
    if kind == "LAST":
        v = hidden[-1]
    elif kind == "MEAN":
        v = hidden.mean(axis=0)
    elif kind == "CLS":
        v = hidden[0]
    else:
        raise ValueError(f"unknown pooling type {kind!r}")
    v = v.astype(np.float32)
    if normalize:
        n = float(np.linalg.norm(v))
        if n > 0:
            v = v / n
    return v


class Pooler:
    """The model's pooling forward (one batch at a time) and the pooling settings."""

    def __init__(self, engine: Any, kind: str, normalize: bool) -> None:  # noqa: ANN401
        core = getattr(getattr(engine, "engine", None), "core", None)
        runner = getattr(core, "runner", None)
        self.max_tokens = engine.config.scheduler.max_num_batched_tokens
        self.max_seqs = engine.config.scheduler.max_num_seqs
        self.states: Any
        if runner is not None and hasattr(runner, "_build_inputs"):  # torch
            from xlaserve.backends_torch.pooling import TorchHiddenStates

            self.states = TorchHiddenStates(runner, self.max_tokens)
        elif runner is not None and hasattr(runner, "token_buckets"):  # xla
            from xlaserve.backends_xla.pooling import XlaHiddenStates

            self.states = XlaHiddenStates(runner, self.max_tokens)
            self.max_tokens = self.states.max_tokens
        else:
            raise ValueError(
                "--runner pooling needs one engine in the server's process (torch or xla "
                "backend, no data parallelism)"
            )
        self.kind, self.normalize = kind, normalize
        self.max_model_len = engine.max_model_len
        self._lock = threading.Lock()

    def embed(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """Pooled vectors of token-id prompts (batched up to max_num_batched_tokens)."""
        out: list[np.ndarray] = []
        batch: list[list[int]] = []
        size = 0

        def flush() -> None:
            nonlocal batch, size
            if batch:
                with self._lock:
                    hs = self.states.forward(batch)
                out.extend(pool(h, self.kind, self.normalize) for h in hs)
            batch, size = [], 0

        for p in prompts:
            if size + len(p) > self.max_tokens or len(batch) >= self.max_seqs:
                flush()
            batch.append(p)
            size += len(p)
        flush()
        return out


def _inputs(value: Any, param: str) -> list[str | list[int]]:  # noqa: ANN401
    """A str, list of str, list of ids or list of id lists -> list of inputs (400 otherwise)."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(isinstance(x, int) for x in value):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise ProtocolError(f"'{param}' must be a string, a list of strings or of token ids", param)
    if len(items) > MAX_INPUTS:
        raise ProtocolError(f"'{param}' may hold at most {MAX_INPUTS} inputs", param)
    for x in items:
        ok = (isinstance(x, str) and x) or (
            isinstance(x, list)
            and x
            and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        )
        if not ok:
            raise ProtocolError(f"'{param}' holds an empty or malformed input", param)
    return items


def _tokenize(request: web.Request, items: list[str | list[int]], param: str) -> list[list[int]]:
    engine = request.app[srv.ENGINE_KEY]
    pooler: Pooler = request.app[POOLER_KEY]  # type: ignore[assignment]
    vocab = engine.engine.spec.vocab_size
    out = []
    for x in items:
        ids = engine.tokenizer.encode(x) if isinstance(x, str) else list(x)
        if any(t < 0 or t >= vocab for t in ids):
            raise ProtocolError(f"token ids in '{param}' must be in [0, {vocab})", param)
        if len(ids) > min(pooler.max_model_len, pooler.max_tokens):
            raise ProtocolError(
                f"an input of '{param}' has {len(ids)} tokens; the limit is "
                f"{min(pooler.max_model_len, pooler.max_tokens)}",
                param,
            )
        if not ids:
            raise ProtocolError(f"an input of '{param}' tokenizes to nothing", param)
        out.append(ids)
    return out


async def _body(request: web.Request) -> dict[str, Any]:
    body = await srv._json_body(request)
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    srv._check_model(request.app[srv.ENGINE_KEY], body.get("model"))
    return body


async def _embed(request: web.Request, items: list[str | list[int]], param: str) -> tuple:
    ids = await srv._offload(request, _tokenize, request, items, param)
    pooler: Pooler = request.app[POOLER_KEY]  # type: ignore[assignment]
    vecs = await srv._offload(request, pooler.embed, ids)
    return vecs, sum(len(i) for i in ids)


def _usage(n: int) -> dict[str, int]:
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}


async def create_embedding(request: web.Request) -> web.Response:
    body = await _body(request)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise ProtocolError("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    vecs, n = await _embed(request, _inputs(body.get("input"), "input"), "input")
    dims = body.get("dimensions")
    if dims is not None and dims != len(vecs[0]):
        raise ProtocolError(
            f"'dimensions' {dims} is not supported: this model's embeddings have {len(vecs[0])}",
            "dimensions",
        )

    def enc(v: np.ndarray) -> Any:  # noqa: ANN401
        if fmt == "base64":
            return base64.b64encode(v.astype("<f4").tobytes()).decode()
        return v.tolist()

    engine = request.app[srv.ENGINE_KEY]
    return web.json_response(
        {
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": engine.model_name,
            "data": [
                {"object": "embedding", "index": i, "embedding": enc(v)} for i, v in enumerate(vecs)
            ],
            "usage": _usage(n),
        }
    )


async def create_pooling(request: web.Request) -> web.Response:
    body = await _body(request)
    vecs, n = await _embed(request, _inputs(body.get("input"), "input"), "input")
    engine = request.app[srv.ENGINE_KEY]
    return web.json_response(
        {
            "id": f"pool-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": engine.model_name,
            "data": [
                {"object": "pooling", "index": i, "data": v.tolist()} for i, v in enumerate(vecs)
            ],
            "usage": _usage(n),
        }
    )


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return float(a @ b / (na * nb)) if na and nb else 0.0


async def create_score(request: web.Request) -> web.Response:
    """text_1 (one or N) against text_2 (N): one score per pair (one text_1 is broadcast)."""
    body = await _body(request)
    t1 = _inputs(body.get("text_1", body.get("queries")), "text_1")
    t2 = _inputs(body.get("text_2", body.get("documents")), "text_2")
    if len(t1) not in (1, len(t2)):
        raise ProtocolError("'text_1' must hold one input or as many as 'text_2'", "text_1")
    vecs, n = await _embed(request, t1 + t2, "text_1")
    v1, v2 = vecs[: len(t1)], vecs[len(t1) :]
    scores = [_cosine(v1[0 if len(v1) == 1 else i], b) for i, b in enumerate(v2)]
    engine = request.app[srv.ENGINE_KEY]
    return web.json_response(
        {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": engine.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": _usage(n),
        }
    )


async def create_rerank(request: web.Request) -> web.Response:
    body = await _body(request)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise ProtocolError("'query' must be a non-empty string", "query")
    raw_docs = body.get("documents")
    if isinstance(raw_docs, list):  # Cohere-style {"text": ...} documents are accepted too
        raw_docs = [d.get("text") if isinstance(d, dict) else d for d in raw_docs]
    docs = _inputs(raw_docs, "documents")
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or top_n < 0):
        raise ProtocolError("'top_n' must be a non-negative integer", "top_n")
    vecs, n = await _embed(request, [query, *docs], "documents")
    scores = [_cosine(vecs[0], v) for v in vecs[1:]]
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    if top_n:
        order = order[:top_n]
    engine = request.app[srv.ENGINE_KEY]
    return web.json_response(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": engine.model_name,
            "results": [
                {
                    "index": i,
                    "document": {"text": docs[i]} if isinstance(docs[i], str) else None,
                    "relevance_score": scores[i],
                }
                for i in order
            ],
            "usage": {"total_tokens": n},
        }
    )


# The pooling endpoints: path -> handler name (a generation server answers them with a 400).
POOLING_PATHS: dict[str, str] = {
    "/v1/embeddings": "create_embedding",
    "/pooling": "create_pooling",
    "/score": "create_score",
    "/v1/score": "create_score",
    "/rerank": "create_rerank",
    "/v1/rerank": "create_rerank",
    "/v2/rerank": "create_rerank",
}


def add_routes(app: web.Application, engine: Any, kind: str, normalize: bool) -> None:  # noqa: ANN401
    """Load the pooling forward over `engine`'s model and register the pooling routes."""
    app[POOLER_KEY] = Pooler(engine, kind, normalize)
    for path, handler in POOLING_PATHS.items():
        app.router.add_post(path, globals()[handler])
