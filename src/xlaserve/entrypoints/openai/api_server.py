"""OpenAI-compatible HTTP server (aiohttp) over one AsyncLLM.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id},
POST /v1/responses (serving_responses.py), GET /health, GET /version, GET /metrics,
POST /tokenize, POST /detokenize; CORS preflight on every route (--allowed-origins).

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 bad parameters,
JSON or body encoding, a request over a per-request bound (ServerConfig: sequences, logprobs,
stop strings; grammar bytes) or a grammar that does not compile in time, 401 API key, 404 unknown
model or route, 413 body too large (sent or inflated), 415 unsupported Content-Encoding, 503
engine down or waiting queue full (with Retry-After), 500 anything unexpected.

Hardening (docs/security.md): CPU-heavy request work (inflating, decoding large JSON, chat
templating, tokenization) runs on a thread pool, never on the event loop; chat content is
tokenized as plain text; with several API keys each key gets its own prefix-cache salt. Streams are Server-Sent Events
(`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`); a client that goes away mid-request has its
request aborted (its KV blocks are freed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import os
import signal
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from xlaserve.config import EngineConfig, ServerConfig
from xlaserve.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineQueueFullError,
    RequestFailedError,
)
from xlaserve.entrypoints.openai.generation_defaults import (
    apply_generation_defaults,
    load_generation_defaults,
)
from xlaserve.entrypoints.openai.generation_defaults import (
    describe as describe_generation_defaults,
)
from xlaserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ProtocolError,
    TokenizeRequest,
    param_from_message,
    parse_body,
)
from xlaserve.entrypoints.openai.tools import ToolPlan, ToolRequestError, plan_tools
from xlaserve.metrics import CONTENT_TYPE, ServerMetrics
from xlaserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from xlaserve.sampling_params import SamplingParams
from xlaserve.structured.openai_compat import grammar_source_bytes

logger = logging.getLogger("xlaserve.server")

ENGINE_KEY = web.AppKey("engine", AsyncLLM)
CONFIG_KEY = web.AppKey("server_config", ServerConfig)
METRICS_KEY = web.AppKey("metrics", ServerMetrics)
STARTED_KEY = web.AppKey("started", float)
KEYS_KEY = web.AppKey("api_keys", list)  # list[bytes]: accepted API keys
POOL_KEY = web.AppKey("cpu_pool", cf.ThreadPoolExecutor)
ORIGINS_KEY = web.AppKey("allowed_origins", frozenset)  # CORS origins; "*" = any
GEN_DEFAULTS_KEY = web.AppKey("generation_defaults", dict)  # request field -> default value
# Which API key a request authenticated with (index into KEYS_KEY).
KEY_INDEX: Any = (
    web.RequestKey("api_key_index", int) if hasattr(web, "RequestKey") else "api_key_index"
)

# aiohttp server settings the app expects (run_server and the tests' runners use them):
# bodies arrive compressed and are inflated on the CPU pool, with a bound on the inflated size.
RUNNER_KWARGS: dict[str, Any] = {"handler_cancellation": True, "auto_decompress": False}
# Bodies at least this large are JSON-decoded on the CPU pool, not on the event loop.
LARGE_BODY_BYTES = 64 * 1024

# Reachable without an API key (probes and scrapers).
OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code if code is not None else status
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def _to_api_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ProtocolError):
        return APIError(400, e.message, param=e.param)
    if isinstance(e, EngineQueueFullError):
        return APIError(
            503,
            str(e),
            "service_unavailable",
            code="queue_full",
            headers={"Retry-After": str(e.retry_after)},
        )
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "service_unavailable", code="engine_dead")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), "server_error")
    if isinstance(e, ValueError):
        return APIError(400, str(e), param=param_from_message(str(e)))
    if isinstance(e, web.HTTPException):
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        msg = {413: "request body too large"}.get(e.status, e.reason)
        return APIError(e.status, msg, kind)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


# ------------------------------------------------------------------------------- middlewares


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        err = _to_api_error(e)
        if err.status >= 500 and not isinstance(e, (EngineDeadError, EngineQueueFullError)):
            logger.exception("request failed: %s %s", request.method, request.path)
        return err.response()


def _allowed_origins(cfg: ServerConfig) -> frozenset[str]:
    """--allowed-origins as a set: each value an origin or vLLM's JSON list of them."""
    raw = cfg.allowed_origins
    if raw is None:
        return frozenset({"*"})
    out: set[str] = set()
    for v in [raw] if isinstance(raw, str) else raw:
        v = v.strip()
        if v.startswith("["):
            try:
                out.update(str(x) for x in json.loads(v))
            except ValueError:
                raise ValueError(f"--allowed-origins: {v!r} is not a JSON list") from None
        elif v:
            out.add(v)
    return frozenset(out)


def _cors_origin(request: web.Request) -> str | None:
    """The Access-Control-Allow-Origin value for this request's Origin, or None (no CORS
    headers: not a cross-origin request, or an origin not in --allowed-origins)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return None
    allowed = request.app[ORIGINS_KEY]
    if "*" in allowed:
        return "*"
    return origin if origin in allowed else None


@web.middleware
async def _cors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """CORS preflight (OPTIONS with Access-Control-Request-Method) answered before routing and
    auth, as vLLM's CORSMiddleware: 200 for an allowed origin, 403 otherwise. The headers of
    ordinary responses are added in `_cors_headers` (streams included)."""
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        allow = _cors_origin(request)
        if allow is None:
            return web.Response(status=403, text="CORS origin not allowed")
        headers = {
            "Access-Control-Allow-Origin": allow,
            "Access-Control-Allow-Methods": "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT",
            "Access-Control-Allow-Headers": request.headers.get(
                "Access-Control-Request-Headers", "*"
            ),
            "Access-Control-Max-Age": "600",
        }
        if allow != "*":
            headers["Vary"] = "Origin"
        return web.Response(status=200, headers=headers)
    return await handler(request)


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    allow = _cors_origin(request)
    if allow is not None:
        response.headers["Access-Control-Allow-Origin"] = allow
        if allow != "*":
            response.headers["Vary"] = "Origin"


def _match_key(token: bytes, keys: list[bytes]) -> int | None:
    """Index of the key equal to `token`; every key is compared (constant time per key)."""
    found = None
    for i, k in enumerate(keys):
        if hmac.compare_digest(token, k):
            found = i
    return found


@web.middleware
async def _guard(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    cfg = request.app[CONFIG_KEY]
    keys = request.app[KEYS_KEY]
    if keys and request.path not in OPEN_PATHS:
        auth = request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        idx = _match_key(token.encode("utf-8", "replace"), keys)
        if idx is None:
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")
        request[KEY_INDEX] = idx
    if request.content_length is not None and request.content_length > cfg.max_request_bytes:
        raise APIError(
            413, f"request body over {cfg.max_request_bytes} bytes", code="request_too_large"
        )
    return await handler(request)


# ------------------------------------------------------------------------------- helpers


# Deeper JSON than this is refused (400) before any field is looked at: nothing in the schema
# nests past a few levels, and deep nesting costs recursion in every later walk of the value.
MAX_JSON_DEPTH = 64


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _json_depth_ok(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            if d > limit:
                return False
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return True


def _inflate(raw: bytes, encoding: str, limit: int) -> bytes:
    """Decode a `Content-Encoding` body, refusing (413) more than `limit` inflated bytes and
    (400) bytes that do not decode. Runs on the CPU pool. Bytes that are not compressed (an
    aiohttp runner that decoded them already) pass through: JSON never starts with the gzip
    magic or a zlib header."""
    if encoding in ("", "identity"):
        return raw
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise APIError(415, f"unsupported Content-Encoding {encoding!r}", code="bad_encoding")
    if encoding == "deflate":
        wbits = 15 if raw[:1] == b"\x78" else -15  # zlib stream, else raw deflate
        if raw[:1] in (b"{", b"["):
            return raw
    else:
        if raw[:2] != b"\x1f\x8b":
            if raw.lstrip()[:1] in (b"{", b"["):
                return raw
            raise APIError(400, "request body is not valid gzip", code="bad_encoding")
        wbits = 31
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(raw, limit + 1)
        if len(out) > limit or d.unconsumed_tail:
            raise APIError(
                413, f"request body inflates past {limit} bytes", code="request_too_large"
            )
        out += d.flush()
    except zlib.error as e:
        raise APIError(
            400, f"request body failed to decode ({encoding}): {e}", code="bad_encoding"
        ) from None
    if len(out) > limit:
        raise APIError(413, f"request body inflates past {limit} bytes", code="request_too_large")
    if not d.eof:
        raise APIError(400, f"request body is a truncated {encoding} stream", code="bad_encoding")
    return out


def _decode_json(raw: bytes) -> Any:
    try:
        # NaN / Infinity are not JSON; Python's decoder would accept them as floats.
        body = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, NaN
        msg = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise APIError(400, f"malformed JSON body: {msg}") from None
    if not _json_depth_ok(body):
        raise APIError(400, f"JSON body nested deeper than {MAX_JSON_DEPTH} levels")
    return body


def _decode_body(raw: bytes, encoding: str, limit: int) -> Any:
    return _decode_json(_inflate(raw, encoding, limit))


async def _offload(request: web.Request, fn: Callable[..., Any], *args: Any) -> Any:
    """Run CPU-heavy `fn(*args)` on the app's worker threads: the event loop keeps serving
    /health and small requests meanwhile (the GIL is handed over every few milliseconds;
    zlib, tokenizers and large copies release it)."""
    return await asyncio.get_running_loop().run_in_executor(request.app[POOL_KEY], fn, *args)


async def _json_body(request: web.Request) -> Any:
    try:
        raw = await request.read()  # raises HTTPRequestEntityTooLarge past client_max_size
    except web.HTTPException:
        raise
    except Exception as e:  # aiohttp's own decoding of a bad body (ContentEncodingError, ...)
        raise APIError(400, f"request body could not be read: {type(e).__name__}") from None
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    limit = request.app[CONFIG_KEY].max_request_bytes
    if encoding in ("", "identity") and len(raw) < LARGE_BODY_BYTES:
        return _decode_json(raw)  # small and plain: cheaper inline than a thread hop
    return await _offload(request, _decode_body, raw, encoding, limit)


def _render_chat(
    engine: AsyncLLM,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    allow_special: bool,
    **kwargs: Any,
) -> tuple[str, list[int]]:
    """(text, token ids) of the chat; message content is plain text unless `allow_special`
    (see Tokenizer.chat_prompt). Any template failure is the request's fault (400). CPU-heavy:
    called on the pool."""
    try:
        return engine.tokenizer.chat_prompt(
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens_in_content=allow_special,
            **kwargs,
        )
    except (ValueError, TypeError, LookupError, AttributeError, RecursionError) as e:
        raise APIError(400, f"chat template failed: {e}", param="messages") from None
    except Exception as e:  # jinja2.TemplateError and friends (jinja2 is imported lazily)
        if type(e).__module__.startswith("jinja2"):
            raise APIError(400, f"chat template failed: {e}", param="messages") from None
        raise


def _check_model(engine: AsyncLLM, model: str | None) -> Any:  # noqa: ANN401
    """None for the base model; the LoRARequest of a served adapter name (serving_lora.py);
    404 for any other name."""
    if model is None or model == engine.model_name:
        return None
    reg = getattr(engine, "lora_registry", None)
    lora = reg.get(model) if reg is not None else None
    if lora is None:
        raise APIError(
            404, f"the model '{model}' does not exist", param="model", code="model_not_found"
        )
    return lora


def _engine(request: web.Request) -> AsyncLLM:
    """The engine of a generation request (completions, chat, responses)."""
    if request.app[CONFIG_KEY].runner == "pooling":
        raise APIError(
            400,
            "this server runs --runner pooling: use /v1/embeddings, /pooling, /score or /rerank",
            code="wrong_runner",
        )
    engine = request.app[ENGINE_KEY]
    if engine.errored:
        raise engine.dead_error  # type: ignore[misc]
    return engine


async def _not_pooling(request: web.Request) -> web.Response:
    raise APIError(
        400,
        f"{request.path} needs a pooling model server: this one runs --runner generate "
        "(start it with --runner pooling to serve embeddings, pooling, score and rerank)",
        code="wrong_runner",
    )


def _sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


def _usage(outs: list[RequestOutput | None], details: bool) -> dict[str, Any]:
    """OpenAI usage; `prompt_tokens_details.cached_tokens` only with `details`
    (--enable-prompt-tokens-details): prefix-cache hits leak what other clients sent."""
    prompt = sum(len(o.prompt_token_ids) for o in outs if o is not None)
    completion = sum(len(c.token_ids) for o in outs if o is not None for c in o.outputs)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if details:
        cached = sum(o.num_cached_tokens for o in outs if o is not None)
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _cache_salt(request: web.Request, salt: str | None) -> str | None:
    """The prefix-cache salt: with several API keys each key gets its own (a hash of the key,
    joined with the client's own salt), unless the operator shares the cache between keys."""
    cfg = request.app[CONFIG_KEY]
    keys = request.app[KEYS_KEY]
    idx = request.get(KEY_INDEX)
    if len(keys) < 2 or idx is None or cfg.share_prefix_cache_across_keys:
        return salt
    tag = hashlib.sha256(b"xlaserve-cache-salt:" + keys[idx]).hexdigest()[:32]
    return f"key:{tag}" if salt is None else f"key:{tag}:{salt}"


def _structured_param(req: Any) -> str:
    """The request field that carried the structured-output constraint (for error `param`)."""
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        return "response_format"
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(req, name, None) is not None:
            return name
    return "structured_outputs"


def _check_limits(
    request: web.Request, engine: AsyncLLM, req: Any, params: SamplingParams, num_prompts: int
) -> None:
    """The server's per-request bounds (ServerConfig), before any work: 400 naming the field."""
    cfg = request.app[CONFIG_KEY]
    seqs = num_prompts * params.n
    if seqs > cfg.max_sequences_per_request:
        raise APIError(
            400,
            f"this request would start {seqs} sequences ({num_prompts} prompt(s) x n={params.n}); "
            f"the limit is {cfg.max_sequences_per_request}",
            param="n" if num_prompts == 1 else "prompt",
            code="too_many_sequences",
        )
    k = max(params.logprobs or 0, params.prompt_logprobs or 0)
    if params.logprobs is not None or params.prompt_logprobs is not None:
        k = max(k, 1)  # logprobs=0 still returns the sampled token's logprob
        if seqs * k > cfg.max_logprobs_per_response:
            raise APIError(
                400,
                f"logprobs x sequences = {k} x {seqs} = {seqs * k} is over the limit of "
                f"{cfg.max_logprobs_per_response} per response",
                param="logprobs",
                code="too_many_logprobs",
            )
    stops = params.stop or []
    if len(stops) > cfg.max_stop_strings:
        raise APIError(
            400,
            f"at most {cfg.max_stop_strings} stop strings, got {len(stops)}",
            param="stop",
            code="too_many_stop_strings",
        )
    if any(len(s) > cfg.max_stop_string_chars for s in stops):
        raise APIError(
            400,
            f"stop strings may be at most {cfg.max_stop_string_chars} characters",
            param="stop",
            code="stop_string_too_long",
        )
    so = params.structured_outputs
    if so is not None:
        limit = engine.config.structured.max_grammar_bytes
        size = grammar_source_bytes(so)
        if size > limit:
            raise APIError(
                400,
                f"the structured output grammar is {size} bytes; the limit is {limit}",
                param=_structured_param(req),
                code="grammar_too_large",
            )


def _finish(c: CompletionOutput) -> str | None:
    return c.finish_reason


@dataclass
class _Tok:
    """One position's logprobs, decoded: the actual token and the top alternatives."""

    token: str
    logprob: float | None  # None: the first prompt position (nothing before it to condition on)
    top: list[tuple[str, float]]  # (token, logprob) by rank


def _token_id_str(t: int) -> str:
    """return_tokens_as_token_ids: a token written by id (vLLM's form)."""
    return f"token_id:{t}"


def _positions(
    token_ids: list[int],
    logprobs: list[PositionLogprobs | None],
    k: int,
    decode: Callable[[int], str],
    as_ids: bool = False,
) -> list[_Tok | None]:
    """One `_Tok` per position (zip of ids and logprobs); `as_ids` writes tokens by id."""
    out: list[_Tok | None] = []
    if as_ids:
        decode = _token_id_str
    for tid, pos in zip(token_ids, logprobs, strict=False):
        if pos is None:
            out.append(_Tok(decode(tid), None, []))
            continue
        lp = pos.get(tid)
        tok = (
            None if as_ids or lp is None or lp.decoded_token is None else lp.decoded_token
        ) or decode(tid)
        ranked = sorted(
            (
                (p.rank or 0, t, p)
                for t, p in pos.items()
                if p.rank is not None and 1 <= p.rank <= k
            ),
            key=lambda x: x[0],
        )
        top = [
            (
                p.decoded_token if p.decoded_token is not None and not as_ids else decode(t),
                p.logprob,
            )
            for _, t, p in ranked
        ]
        out.append(_Tok(tok, lp.logprob if lp else float("-inf"), top))
    return out


def _completion_logprobs(
    toks: list[_Tok | None], text_start: int, include_sampled: bool = True
) -> dict[str, Any]:
    """Legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_start
    for t in toks:
        if t is None:
            continue
        if t.logprob is None:  # first prompt position: its token, no logprob (as OpenAI)
            tokens.append(t.token)
            token_lps.append(None)
            tops.append(None)
            offsets.append(off)
            off += len(t.token)
            continue
        tokens.append(t.token)
        token_lps.append(t.logprob)
        top: dict[str, float] = {}
        for tok_str, lp in t.top:  # rank order: tokens that decode alike keep the best one
            top.setdefault(tok_str, lp)
        if include_sampled:
            top.setdefault(t.token, t.logprob)
        tops.append(top)
        offsets.append(off)
        off += len(t.token)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _echo_only(out: RequestOutput | None) -> RequestOutput | None:
    """echo with max_tokens=0: drop the one token the engine sampled (no text, no token, no
    usage); a finished choice ends with "length", as OpenAI's does."""
    if out is None:
        return None
    outs = [
        dataclasses.replace(
            c,
            text="",
            token_ids=[],
            logprobs=[] if c.logprobs is not None else None,
            cumulative_logprob=None,
            finish_reason="length" if c.finish_reason in ("stop", "length") else c.finish_reason,
            stop_reason=None,
        )
        for c in out.outputs
    ]
    return dataclasses.replace(out, outputs=outs)


def _prompt_logprobs_json(
    out: RequestOutput, decode: Callable[[int], str]
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or
    {token id: {"logprob", "rank", "decoded_token"}} (the prompt's token and the top k)."""
    res: list[dict[str, Any] | None] = []
    for pos in out.prompt_logprobs or [None] * len(out.prompt_token_ids):
        if pos is None:
            res.append(None)
            continue
        res.append(
            {
                str(t): {
                    "logprob": max(p.logprob, -9999.0),
                    "rank": p.rank,
                    "decoded_token": p.decoded_token if p.decoded_token is not None else decode(t),
                }
                for t, p in pos.items()
            }
        )
    return res


def _chat_logprobs(toks: list[_Tok | None]) -> list[dict[str, Any]]:
    def entry(tok: str, lp: float) -> dict[str, Any]:
        return {"token": tok, "logprob": max(lp, -9999.0), "bytes": list(tok.encode("utf-8"))}

    return [
        {**entry(t.token, t.logprob), "top_logprobs": [entry(a, b) for a, b in t.top]}
        for t in toks
        if t is not None and t.logprob is not None
    ]


async def _merged(engine: AsyncLLM, streams: list[Any]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the outputs of several requests as (prompt index, output); closing aborts all."""
    if len(streams) == 1:
        async with contextlib.aclosing(engine.iterate(streams[0])) as it:
            async for out in it:
                yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: Any) -> None:
        try:
            async with contextlib.aclosing(engine.iterate(stream)) as it:
                async for out in it:
                    q.put_nowait((i, out))
        except Exception as e:
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _add_all(
    engine: AsyncLLM,
    base_id: str,
    prompts: list[Any],
    params: SamplingParams,
    priority: int,
    salt: str | None,
    lora: Any = None,  # noqa: ANN401 - a LoRARequest (None: the base model)
) -> list[Any]:
    """Add every prompt as its own request; on any failure abort the ones already added."""
    streams = []
    kw = {"lora_request": lora} if lora is not None else {}
    try:
        for i, p in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(
                await engine.add_request(rid, p, params, priority=priority, cache_salt=salt, **kw)
            )
    except BaseException:
        for s in streams:
            engine.abort(s.request_id)
        raise
    return streams


def _generation_error(error: str) -> APIError:
    """A request that failed in the engine: a grammar that would not compile (too slow, or
    refused by xgrammar) is the request's fault (400); anything else is ours (500)."""
    if "grammar failed to compile" in error:
        code = "grammar_compile_timeout" if "longer than" in error else "grammar_compile_failed"
        return APIError(400, error, param="structured_outputs", code=code)
    return APIError(500, f"generation failed: {error}", "server_error")


def _deadline(request: web.Request) -> float | None:
    t = request.app[CONFIG_KEY].request_timeout
    return time.monotonic() + t if t else None


async def _collect(
    engine: AsyncLLM, streams: list[Any], deadline: float | None
) -> list[RequestOutput | None]:
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def run() -> None:
        async with contextlib.aclosing(_merged(engine, streams)) as it:
            async for i, out in it:
                finals[i] = out

    if deadline is None:
        await run()
    else:
        try:
            await asyncio.wait_for(run(), max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            raise APIError(504, "request timed out", "timeout", code="timeout") from None
    for out in finals:
        if out is not None and out.error:
            raise _generation_error(out.error)
    return finals


class _SSE:
    """A Server-Sent Events response; `send` returns False once the client is gone."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "Connection": "keep-alive",
            }
        )
        self.closed = False

    async def start(self) -> None:
        await self.resp.prepare(self.request)

    async def send(self, data: dict[str, Any] | str) -> bool:
        if self.closed:
            return False
        try:
            await self.resp.write(_sse(data))
            return True
        except (ConnectionError, RuntimeError):  # reset by peer / transport closed
            self.closed = True
            return False

    async def finish(self) -> web.StreamResponse:
        if not self.closed:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.resp.write(_sse("[DONE]"))
                await self.resp.write_eof()
        return self.resp


def _log(request: web.Request, rid: str, prompts: list[Any], params: SamplingParams) -> None:
    if request.app[CONFIG_KEY].log_requests:
        logger.info("request %s: %d prompt(s), params=%s", rid, len(prompts), params)


# ------------------------------------------------------------------------------- completions


def _completion_prompts(engine: AsyncLLM, texts: list[str | list[int]], group: str) -> list[dict]:
    """Prompt dicts for the engine, text prompts tokenized here (on the CPU pool) instead of
    on the engine thread; `group` ties the prompts of one HTTP request together (fairness)."""
    tok = engine.tokenizer
    out = []
    for p in texts:
        if isinstance(p, str):
            out.append({"prompt": p, "prompt_token_ids": tok.encode(p), "group": group})
        else:
            out.append({"prompt_token_ids": p, "group": group})
    return out


async def create_completion(request: web.Request) -> web.StreamResponse:
    engine = _engine(request)
    req = parse_body(CompletionRequest, await _json_body(request))
    lora = _check_model(engine, req.model)
    served = lora.lora_name if lora is not None else engine.model_name  # the response's model
    apply_generation_defaults(req, request.app[GEN_DEFAULTS_KEY])
    params = req.to_sampling_params()
    texts = req.prompts()
    _check_limits(request, engine, req, params, len(texts))
    rid = f"cmpl-{uuid.uuid4().hex}"
    prompts = await _offload(request, _completion_prompts, engine, texts, rid)
    _log(request, rid, prompts, params)
    created = int(time.time())
    tok = engine.tokenizer
    deadline = _deadline(request)
    details = request.app[CONFIG_KEY].enable_prompt_tokens_details
    salt = _cache_salt(request, req.cache_salt)
    streams = await _add_all(engine, rid, prompts, params, req.priority, salt, lora)
    n = params.n

    def echo_text(out: RequestOutput) -> str:
        return (
            out.prompt
            if out.prompt is not None
            else tok.decode(out.prompt_token_ids, skip_special_tokens=False)
        )

    def decode(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False)

    def logprobs_of(
        out: RequestOutput, c: CompletionOutput, start_tok: int, echo: bool, text_start: int
    ) -> dict | None:
        if req.logprobs is None:
            return None
        toks: list[_Tok | None] = []
        as_ids = req.return_tokens_as_token_ids
        if echo:
            plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            toks += _positions(out.prompt_token_ids, plp, req.logprobs, decode, as_ids)
        toks += _positions(
            c.token_ids[start_tok:], (c.logprobs or [])[start_tok:], req.logprobs, decode, as_ids
        )
        return _completion_logprobs(toks, text_start)

    def extras(choice: dict[str, Any], out: RequestOutput, first: bool) -> dict[str, Any]:
        if req.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = _prompt_logprobs_json(out, decode)
        return choice

    if not req.stream:
        finals = [
            _echo_only(o) if req.echo_only else o for o in await _collect(engine, streams, deadline)
        ]
        choices = []
        for i, out in enumerate(finals):
            assert out is not None
            prefix = echo_text(out) if req.echo else ""
            for c in out.outputs:
                choices.append(
                    extras(
                        {
                            "index": i * n + c.index,
                            "text": prefix + c.text,
                            "logprobs": logprobs_of(out, c, 0, req.echo, 0),
                            "finish_reason": _finish(c),
                            "stop_reason": c.stop_reason,
                        },
                        out,
                        True,
                    )
                )
        return web.json_response(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": served,
                "choices": choices,
                "usage": _usage(finals, details),
            }
        )

    sse = _SSE(request)
    await sse.start()
    sent_text: dict[int, int] = {}  # choice index -> chars of generated text sent
    sent_off: dict[int, int] = {}  # choice index -> text_offset of its next token
    sent_toks: dict[int, int] = {}
    done: set[int] = set()
    finals: list[RequestOutput | None] = [None] * len(streams)

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": served,
            "choices": choices,
        }

    try:
        async with contextlib.aclosing(_merged(engine, streams)) as it:
            async for i, out in it:
                if deadline is not None and time.monotonic() > deadline:
                    raise APIError(504, "request timed out", "timeout", code="timeout")
                if out.error:
                    raise _generation_error(out.error)
                if req.echo_only:
                    out = _echo_only(out)
                finals[i] = out
                for c in out.outputs:
                    idx = i * n + c.index
                    if idx in done:
                        continue
                    first = idx not in sent_text
                    t0, k0 = sent_text.get(idx, 0), sent_toks.get(idx, 0)
                    delta = c.text[t0:]
                    prefix = echo_text(out) if (first and req.echo) else ""
                    new_toks = len(c.token_ids) - k0
                    fin = _finish(c)
                    if not (delta or prefix or fin or (new_toks and req.logprobs is not None)):
                        continue
                    sent_text[idx], sent_toks[idx] = len(c.text), len(c.token_ids)
                    if fin:
                        done.add(idx)
                    # text_offset counts from the start of the choice's whole text (echo
                    # included): each chunk continues where the last one ended (offsets add
                    # token lengths, as the whole response's do).
                    lp = None
                    if req.logprobs is not None:
                        lp = logprobs_of(out, c, k0, first and req.echo, sent_off.get(idx, 0))
                        if lp["tokens"]:
                            sent_off[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                    choice = {
                        "index": idx,
                        "text": prefix + delta,
                        "logprobs": lp,
                        "finish_reason": fin,
                        "stop_reason": c.stop_reason if fin else None,
                    }
                    body = chunk([extras(choice, out, first)])
                    if req.continuous_usage:
                        body["usage"] = _usage(finals, details)
                    if not await sse.send(body):
                        return sse.resp  # client gone: leaving the loop aborts the requests
        if req.include_usage:
            await sse.send({**chunk([]), "usage": _usage(finals, details)})
    except Exception as e:
        await sse.send(_to_api_error(e).body())
    return await sse.finish()


# ------------------------------------------------------------------------------- chat


def _template_kwargs(req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """Keyword arguments of Tokenizer.chat_prompt for a chat request (tools, continuation,
    per-request template, chat_template_kwargs)."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.tools:
        kwargs["tools"] = [t.to_dict() for t in req.tools]
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    if req.chat_template is not None:
        kwargs["chat_template"] = req.chat_template
    return kwargs


def _check_request_template(template: str | None, cfg: ServerConfig) -> None:
    if template is not None and not cfg.trust_request_chat_template:
        raise APIError(
            400,
            "per-request 'chat_template' is not allowed on this server "
            "(start it with --trust-request-chat-template)",
            param="chat_template",
        )


def _chat_prompt(
    engine: AsyncLLM, req: ChatCompletionRequest, allow_special: bool
) -> dict[str, Any]:
    """The chat's prompt dict (templated and tokenized: runs on the CPU pool)."""
    messages = [m.to_template_dict() for m in req.messages]
    kwargs = _template_kwargs(req)
    text, ids = _render_chat(engine, messages, req.add_generation_prompt, allow_special, **kwargs)
    # The template writes BOS itself: no special tokens added on top.
    return {"prompt": text, "prompt_token_ids": ids}


def chat_tool_plan(
    req: ChatCompletionRequest, params: SamplingParams, cfg: ServerConfig
) -> tuple[ToolPlan, SamplingParams]:
    """The request's tool plan (tools/chat.py) and its sampling params adjusted for it: a
    forced call gets its JSON schema as the structured-output constraint; "auto" keeps
    special tokens in the text (parsers read markers such as <tool_call>). Also refuses a
    per-request chat template unless the server trusts them."""
    _check_request_template(req.chat_template, cfg)
    try:
        plan = plan_tools(
            [t.to_dict() for t in req.tools] if req.tools else None,
            req.tool_choice,
            cfg.enable_auto_tool_choice,
            cfg.tool_call_parser,
            req.parallel_tool_calls,
        )
    except ToolRequestError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    if plan.forced:
        if params.structured_outputs is not None:
            raise APIError(
                400,
                "a forced tool call ('required' or a named function) cannot be combined with "
                "response_format or structured outputs",
                param="tool_choice",
            )
        params = dataclasses.replace(params, structured_outputs=plan.structured())
    elif plan.mode == "auto":
        params = dataclasses.replace(params, skip_special_tokens=False)
    return plan, params


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    engine = _engine(request)
    req = parse_body(ChatCompletionRequest, await _json_body(request))
    lora = _check_model(engine, req.model)
    served = lora.lora_name if lora is not None else engine.model_name  # the response's model
    cfg = request.app[CONFIG_KEY]
    apply_generation_defaults(req, request.app[GEN_DEFAULTS_KEY])
    params = req.to_sampling_params()
    plan, params = chat_tool_plan(req, params, cfg)
    _check_limits(request, engine, req, params, 1)
    prompt = await _offload(request, _chat_prompt, engine, req, cfg.allow_special_tokens_in_content)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    _log(request, rid, [prompt], params)
    created = int(time.time())
    tok = engine.tokenizer
    deadline = _deadline(request)
    details = cfg.enable_prompt_tokens_details
    k = req.top_logprobs or 0
    salt = _cache_salt(request, req.cache_salt)
    streams = await _add_all(engine, rid, [prompt], params, req.priority, salt, lora)
    echo = ""
    if req.echo and req.messages[-1].role == "assistant":
        echo = req.messages[-1].text()

    def decode(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False)

    def lp_of(c: CompletionOutput, start: int) -> dict[str, Any] | None:
        if not req.logprobs:
            return None
        return {
            "content": _chat_logprobs(
                _positions(
                    c.token_ids[start:],
                    (c.logprobs or [])[start:],
                    k,
                    decode,
                    req.return_tokens_as_token_ids,
                )
            )
        }

    if not req.stream:
        finals = await _collect(engine, streams, deadline)
        out = finals[0]
        assert out is not None
        choices = []
        for c in out.outputs:
            content, calls = plan.message(c.text)
            message: dict[str, Any] = {
                "role": "assistant",
                "content": echo + content if content is not None else (echo or None),
            }
            if plan.mode != "none":
                message["tool_calls"] = [tc.to_openai() for tc in calls]
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": lp_of(c, 0),
                    "finish_reason": plan.finish_reason(_finish(c), bool(calls)),
                    "stop_reason": c.stop_reason,
                }
            )
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": served,
            "choices": choices,
            "usage": _usage(finals, details),
        }
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = _prompt_logprobs_json(out, decode)
        return web.json_response(body)

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": served,
            "choices": choices,
        }

    sse = _SSE(request)
    await sse.start()
    for i in range(params.n):  # the role comes first, before any token
        first = {"role": "assistant", "content": echo}
        await sse.send(
            chunk([{"index": i, "delta": first, "logprobs": None, "finish_reason": None}])
        )
    sent_text: dict[int, int] = {}
    sent_toks: dict[int, int] = {}
    done: set[int] = set()
    final: RequestOutput | None = None
    tool_streams = {i: plan.streamer() for i in range(params.n)}
    try:
        async with contextlib.aclosing(_merged(engine, streams)) as it:
            async for _, out in it:
                if deadline is not None and time.monotonic() > deadline:
                    raise APIError(504, "request timed out", "timeout", code="timeout")
                if out.error:
                    raise _generation_error(out.error)
                final = out
                for c in out.outputs:
                    if c.index in done:
                        continue
                    t0, k0 = sent_text.get(c.index, 0), sent_toks.get(c.index, 0)
                    fin = _finish(c)
                    new_toks = len(c.token_ids) - k0
                    if not (len(c.text) > t0 or fin or (new_toks and req.logprobs)):
                        continue
                    ts = tool_streams[c.index]
                    delta = ts.delta(c.text, fin is not None)
                    sent_text[c.index], sent_toks[c.index] = len(c.text), len(c.token_ids)
                    if fin:
                        done.add(c.index)
                        fin = plan.finish_reason(fin, ts.n_calls > 0)
                    elif not (delta or (new_toks and req.logprobs)):
                        continue  # held back (a tool-call marker may be starting)
                    choice = {
                        "index": c.index,
                        "delta": delta,
                        "logprobs": lp_of(c, k0),
                        "finish_reason": fin,
                        "stop_reason": c.stop_reason if fin else None,
                    }
                    body = chunk([choice])
                    if req.continuous_usage:
                        body["usage"] = _usage([final], details)
                    if not await sse.send(body):
                        return sse.resp
        if req.include_usage:
            await sse.send({**chunk([]), "usage": _usage([final], details)})
    except Exception as e:
        await sse.send(_to_api_error(e).body())
    return await sse.finish()


# ------------------------------------------------------------------------------- small routes


def _model_card(request: web.Request) -> dict[str, Any]:
    engine = request.app[ENGINE_KEY]
    return {
        "id": engine.model_name,
        "object": "model",
        "created": int(request.app[STARTED_KEY]),
        "owned_by": "xlaserve",
        # The served name only: the model's filesystem path is the operator's business.
        "root": engine.model_name,
        "max_model_len": engine.max_model_len,
    }


async def list_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    reg = getattr(engine, "lora_registry", None)
    adapters = reg.cards(engine.max_model_len) if reg is not None else []
    return web.json_response({"object": "list", "data": [_model_card(request), *adapters]})


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: the served model's (or a LoRA adapter's) card, 404 for any other."""
    engine = request.app[ENGINE_KEY]
    lora = _check_model(engine, request.match_info["model"])
    if lora is not None:
        return web.json_response(engine.lora_registry.card(lora.lora_name, engine.max_model_len))
    return web.json_response(_model_card(request))


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if engine.errored:
        return _to_api_error(engine.dead_error).response()  # type: ignore[arg-type]
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    from xlaserve import __version__

    return web.json_response({"version": __version__})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def tokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    req = parse_body(TokenizeRequest, await _json_body(request))
    _check_model(engine, req.model)
    tok = engine.tokenizer
    if req.messages is not None:
        cfg = request.app[CONFIG_KEY]
        _check_request_template(req.chat_template, cfg)
        messages = [m.to_template_dict() for m in req.messages]
        kwargs = _template_kwargs(req)
        allow = cfg.allow_special_tokens_in_content
        _, ids = await _offload(
            request,
            functools.partial(
                _render_chat, engine, messages, req.add_generation_prompt, allow, **kwargs
            ),
        )
    else:
        ids = await _offload(request, tok.encode, req.prompt or "", req.add_special_tokens)
    body: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}
    if req.return_token_strs:
        body["token_strs"] = [tok.id_to_token(i) for i in ids]
    return web.json_response(body)


async def detokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    req = parse_body(DetokenizeRequest, await _json_body(request))
    _check_model(engine, req.model)
    vocab = engine.engine.spec.vocab_size
    if any(t < 0 or t >= vocab for t in req.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    text = engine.tokenizer.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)
    return web.json_response({"prompt": text})


# ------------------------------------------------------------------------------- app


class _OneLineErrors(logging.Filter):
    """aiohttp logs each malformed HTTP request (bad request line, header, chunking) with a
    full traceback: one line instead, so a client cannot fill the log 11 lines at a time."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and type(exc).__module__.startswith("aiohttp"):
            from aiohttp.http_exceptions import HttpProcessingError

            if isinstance(exc, HttpProcessingError):
                msg = str(getattr(exc, "message", "") or exc).splitlines()
                record.msg = f"{record.getMessage()}: {type(exc).__name__}: {msg[0] if msg else ''}"
                record.args = None
                record.exc_info = None
                record.exc_text = None
        return True


_ONE_LINE = _OneLineErrors()


def _quiet_malformed_http() -> None:
    """Install the one-line filter on aiohttp's server logger (once per process)."""
    log = logging.getLogger("aiohttp.server")
    if _ONE_LINE not in log.filters:
        log.addFilter(_ONE_LINE)


def build_app(
    engine: AsyncLLM, config: ServerConfig | None = None, *, owns_engine: bool = False
) -> web.Application:
    """The aiohttp app over `engine`; with `owns_engine` the app's cleanup shuts the engine down."""
    config = config or ServerConfig()
    _quiet_malformed_http()
    app = web.Application(
        middlewares=[_cors, _errors, _guard], client_max_size=config.max_request_bytes
    )
    app.on_response_prepare.append(_cors_headers)
    app[ENGINE_KEY] = engine
    app[CONFIG_KEY] = config
    app[ORIGINS_KEY] = _allowed_origins(config)
    app[KEYS_KEY] = [k.encode("utf-8") for k in config.api_keys()]
    pool = cf.ThreadPoolExecutor(config.cpu_workers, thread_name_prefix="xlaserve-cpu")
    app[POOL_KEY] = pool

    async def _stop_pool(app: web.Application) -> None:
        pool.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(_stop_pool)
    app[STARTED_KEY] = time.time()
    model_dir = getattr(getattr(engine, "engine", None), "model_dir", None)
    app[GEN_DEFAULTS_KEY] = load_generation_defaults(config.generation_config, model_dir)
    logger.info("%s", describe_generation_defaults(config.generation_config, app[GEN_DEFAULTS_KEY]))
    m = ServerMetrics(lambda: engine.stats, engine.model_name)
    engine.add_finish_listener(m.observe_request)
    if hasattr(engine, "metrics_collector"):  # data parallel: per-replica series (engine/dp.py)
        m.registry.register(engine.metrics_collector())
    app[METRICS_KEY] = m
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    from xlaserve.entrypoints.openai import serving_responses  # imports this module

    serving_responses.add_routes(app)
    from xlaserve.entrypoints.openai import serving_lora

    # LoRA adapters (--enable-lora, --lora-modules; runtime loading behind an env var).
    engine.lora_registry = serving_lora.build_registry(engine, config.lora_modules)
    if engine.lora_registry is not None:
        serving_lora.add_routes(app, engine.lora_registry)
    from xlaserve.entrypoints.openai import serving_pooling

    if config.runner == "pooling":
        serving_pooling.add_routes(app, engine, config.pooling_type, config.pooling_normalize)
    else:  # a clear error, not a bare 404, for the pooling endpoints of a generation server
        for path in serving_pooling.POOLING_PATHS:
            app.router.add_post(path, _not_pooling)

    if owns_engine:

        async def _stop_engine(app: web.Application) -> None:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

        app.on_cleanup.append(_stop_engine)
    return app


async def _log_stats(app: web.Application) -> None:
    """The periodic stats line (xlaserve/stats_logger.py) every `log_stats_interval` seconds."""
    from xlaserve.stats_logger import StatsLogger

    engine = app[ENGINE_KEY]
    stats = StatsLogger(lambda: engine.stats)
    stats.log(time.monotonic())  # the baseline reading
    while True:
        await asyncio.sleep(app[CONFIG_KEY].log_stats_interval)
        try:
            stats.log(time.monotonic())
        except Exception as e:  # noqa: BLE001 - a stats reading never takes the server down
            logger.debug("stats line skipped: %s", e)


async def _watch_engine(app: web.Application) -> None:
    """Once the engine dies (the core process crashed): /health is 503 and requests fail with
    5xx at once (the engine fails them); after a short grace for those answers to go out, stop
    the server, which then exits non-zero (run_server)."""
    engine = app[ENGINE_KEY]
    while not engine.errored:
        await asyncio.sleep(0.1)
    logger.error("engine is down (%s); the server stops", engine.dead_error)
    await asyncio.sleep(DEAD_ENGINE_GRACE_S)
    raise web.GracefulExit()


# Seconds between the engine's death and the server's exit (in-flight requests get their 5xx).
DEAD_ENGINE_GRACE_S = 1.0


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Load the engine and serve until SIGINT/SIGTERM (then stop the engine). With
    `server_config.engine_process` (the default) the engine core runs in its own process;
    if it dies, the server exits with status 1. `api_server_count` > 1: that many front
    processes share the port (entrypoints/openai/fronts.py). `--runner pooling`: one front
    with the engine in this process (the pooling forward runs on its runner)."""
    if server_config.runner == "pooling":
        server_config = dataclasses.replace(server_config, engine_process=False, api_server_count=1)
    n = resolve_api_server_count(engine_config, server_config)
    server_config = dataclasses.replace(server_config, api_server_count=n)
    if n > 1:
        from xlaserve.entrypoints.openai.fronts import run_fronts

        raise SystemExit(run_fronts(engine_config, server_config))
    from xlaserve.engine.dp import build_async_engine

    # data_parallel_size > 1: N replicas behind the prefix-aware balancer (same AsyncLLM surface).
    engine = build_async_engine(engine_config, engine_process=server_config.engine_process)
    serve_engine(engine, server_config)


def resolve_api_server_count(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """`api_server_count`, or for None (auto) 2 front processes where a second one measured
    faster (a CUDA host with >= 8 CPU cores, the engine core in its own process, one
    data-parallel rank) and 1 elsewhere."""
    if server_config.api_server_count is not None:
        return server_config.api_server_count
    if not server_config.engine_process or engine_config.parallel.data_parallel_size > 1:
        return 1
    from xlaserve.platforms import current_platform

    return 2 if current_platform.is_cuda() and (os.cpu_count() or 1) >= 8 else 1


def serve_engine(engine: Any, server_config: ServerConfig, reuse_port: bool = False) -> None:  # noqa: ANN401
    """Serve an engine built by the caller until SIGINT/SIGTERM; raises SystemExit(1) when the
    engine died (after in-flight requests got their 5xx)."""
    app = build_app(engine, server_config, owns_engine=True)
    watch: list[asyncio.Task] = []

    async def _start_watch(app: web.Application) -> None:
        # A task that raises GracefulExit (SystemExit) stops the loop like a signal does.
        watch.append(asyncio.get_running_loop().create_task(_watch_engine(app)))
        if not server_config.disable_log_stats:
            watch.append(asyncio.get_running_loop().create_task(_log_stats(app)))

    async def _stop_watch(app: web.Application) -> None:
        # Stopping: a repeated SIGTERM (a supervisor signalling the process and then its group)
        # must not interrupt the engine's shutdown half-way (tensor-parallel workers would be
        # left mid-collective and the stop would end in tracebacks).
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for t in watch:
            t.cancel()

    app.on_startup.append(_start_watch)
    app.on_shutdown.append(_stop_watch)
    host, port = server_config.host, server_config.port
    ssl_context = server_config.ssl_context()  # None: plain HTTP
    scheme = "https" if ssl_context is not None else "http"

    def _listening(msg: str) -> None:
        # run_app prints once its sites are bound: only then is the server reachable.
        if msg.startswith("======== Running on"):
            logger.info("serving %s on %s://%s:%d", engine.model_name, scheme, host, port)
        else:
            logger.debug("%s", msg)

    try:
        web.run_app(
            app,
            host=host,
            port=port,
            reuse_port=reuse_port or None,
            ssl_context=ssl_context,
            # handler_cancellation: a client that disconnects cancels its handler -> abort;
            # auto_decompress off: bodies are inflated on the CPU pool, bounded (see _inflate).
            **RUNNER_KWARGS,
            shutdown_timeout=5.0,
            access_log=logging.getLogger("aiohttp.access") if server_config.log_requests else None,
            print=_listening,
        )
    finally:
        with contextlib.suppress(Exception):  # run_app's cleanup normally did it already
            engine.shutdown()
    if _engine_crashed(engine):
        logger.error("server stopped: the engine died (%s)", engine.dead_error)
        raise SystemExit(1)
    logger.info("server stopped")


def _engine_crashed(engine: Any) -> bool:  # noqa: ANN401
    err = engine.dead_error
    return err is not None and "shut down" not in str(err)
