"""Async request functions of `xlaserve bench serve`, one per backend API.

Each function sends one streaming request with aiohttp and returns a `RequestFuncOutput`; it never
raises for a failed request (HTTP error, refused connection, broken stream): the failure is recorded
in `success=False` and `error`, so one bad request cannot abort a benchmark run.

Timing: `ttft` is the time from sending the request to the first chunk that carries generated text;
`itl` holds the gaps between later text chunks (a chunk may carry several tokens); `latency` ends
when the stream ends. The `usage` chunk (`stream_options.include_usage`) gives the exact token
counts when the server reports them.

Add a backend by writing `async def f(req: RequestFuncInput, session, pbar) -> RequestFuncOutput`
and putting it in `REQUEST_FUNCS`.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# Generous: a benchmark at a high request rate may queue requests for a long time.
AIOHTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclass
class RequestFuncInput:
    """One request to send."""

    prompt: str
    api_url: str  # full URL, e.g. http://127.0.0.1:8000/v1/completions
    prompt_len: int | None  # prompt tokens when known (a tokenizer counted them), else None
    output_len: int | None  # max_tokens to ask for (None = the server's default)
    model: str
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into the JSON payload
    api_key: str | None = None


@dataclass
class RequestFuncOutput:
    """What one request measured. Times in seconds (perf_counter deltas)."""

    success: bool = False
    latency: float = 0.0  # request sent -> stream ended
    ttft: float = 0.0  # request sent -> first generated text chunk
    itl: list[float] = field(default_factory=list)  # gaps between later chunks
    prompt_len: int | None = None  # from the input, or the server's usage.prompt_tokens
    output_tokens: int | None = None  # the server's usage.completion_tokens when reported
    generated_text: str = ""
    error: str = ""
    start_time: float = 0.0  # perf_counter when sent (for plots / concurrency analysis)
    num_chunks: int = 0  # text-carrying chunks received (a fallback token count)


RequestFunc = Callable[[RequestFuncInput, aiohttp.ClientSession, Any], Awaitable[RequestFuncOutput]]


def iter_sse_data(buffer: str) -> tuple[list[str], str]:
    """Split SSE text into complete `data:` payloads and the unfinished rest.

    buffer: text received so far (may end mid-line). Returns (payloads, rest): payloads are the
    strings after the `data:` prefix of each complete line, including the `[DONE]` sentinel;
    comment lines (`:`), blank lines and other fields (`event:`, `id:`) are skipped.
    """
    payloads: list[str] = []
    *lines, rest = buffer.split("\n")
    for raw in lines:
        line = raw.rstrip("\r")
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :]
        if payload.startswith(" "):
            payload = payload[1:]
        payloads.append(payload)
    return payloads, rest


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _base_payload(req: RequestFuncInput) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": req.model,
        "temperature": req.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.output_len is not None:
        payload["max_tokens"] = req.output_len
    if req.ignore_eos:
        payload["ignore_eos"] = True  # an extension (vLLM, xlaserve); others ignore or refuse it
    payload.update(req.extra_body)
    return payload


async def _stream(
    req: RequestFuncInput,
    session: aiohttp.ClientSession,
    payload: dict[str, Any],
    text_of: Callable[[dict[str, Any]], tuple[str, bool]],
) -> RequestFuncOutput:
    """Send `payload`, read the SSE stream and time the text chunks.

    text_of(choice) -> (text, is_token_event): the text a choice carries and whether its arrival
    counts as generated tokens (role-only or finish-only chunks do not).
    """
    out = RequestFuncOutput(prompt_len=req.prompt_len)
    st = time.perf_counter()
    out.start_time = st
    last = st
    got_first = False
    done = False
    text_parts: list[str] = []
    try:
        async with session.post(req.api_url, json=payload, headers=_headers(req.api_key)) as resp:
            if resp.status != 200:
                body = (await resp.text())[:500]
                out.error = f"HTTP {resp.status}: {body or resp.reason}"
                out.latency = time.perf_counter() - st
                return out
            buffer = ""
            async for chunk_bytes in resp.content.iter_any():
                buffer += chunk_bytes.decode("utf-8", errors="replace")
                payloads, buffer = iter_sse_data(buffer)
                for data in payloads:
                    if data.strip() == "[DONE]":
                        done = True
                        continue
                    now = time.perf_counter()
                    obj = json.loads(data)
                    if "error" in obj and not obj.get("choices"):
                        err = obj["error"]
                        msg = err.get("message", err) if isinstance(err, dict) else err
                        raise RuntimeError(f"error in stream: {msg}")
                    for choice in obj.get("choices") or []:
                        text, is_token = text_of(choice)
                        text_parts.append(text)
                        if not is_token:
                            continue
                        out.num_chunks += 1
                        if not got_first:
                            got_first = True
                            out.ttft = now - st
                        else:
                            out.itl.append(now - last)
                        last = now
                    usage = obj.get("usage")
                    if usage:
                        if usage.get("completion_tokens") is not None:
                            out.output_tokens = int(usage["completion_tokens"])
                        if out.prompt_len is None and usage.get("prompt_tokens") is not None:
                            out.prompt_len = int(usage["prompt_tokens"])
            out.latency = time.perf_counter() - st
            out.generated_text = "".join(text_parts)
            if not done:
                out.error = "stream ended without the [DONE] sentinel"
            elif not got_first and not out.output_tokens:
                out.error = "no generated text in the stream"
            else:
                out.success = True
    except Exception as e:  # noqa: BLE001 -- every failure becomes a failed RequestFuncOutput
        out.latency = time.perf_counter() - st
        out.generated_text = "".join(text_parts)
        out.error = (
            f"{type(e).__name__}: {e}"
            if str(e)
            else "".join(traceback.format_exception(*sys.exc_info()))
        )
    return out


def _completion_text(choice: dict[str, Any]) -> tuple[str, bool]:
    text = choice.get("text") or ""
    return text, bool(text) or choice.get("finish_reason") is None


def _chat_text(choice: dict[str, Any]) -> tuple[str, bool]:
    delta = choice.get("delta") or {}
    text = delta.get("content") or ""
    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
    if text or reasoning:
        return text, True
    # A role-only first delta or a finish-only last delta is not a token arrival.
    return "", False


async def async_request_openai_completions(
    req: RequestFuncInput, session: aiohttp.ClientSession, pbar: Any = None
) -> RequestFuncOutput:
    """POST /v1/completions with `prompt`, streamed."""
    payload = _base_payload(req)
    payload["prompt"] = req.prompt
    out = await _stream(req, session, payload, _completion_text)
    if pbar is not None:
        pbar.update(1)
    return out


async def async_request_openai_chat(
    req: RequestFuncInput, session: aiohttp.ClientSession, pbar: Any = None
) -> RequestFuncOutput:
    """POST /v1/chat/completions with the prompt as one user message, streamed."""
    payload = _base_payload(req)  # max_tokens: accepted by every open-source server
    payload["messages"] = [{"role": "user", "content": req.prompt}]
    out = await _stream(req, session, payload, _chat_text)
    if pbar is not None:
        pbar.update(1)
    return out


# backend name -> request function. Others plug in here.
REQUEST_FUNCS: dict[str, RequestFunc] = {
    "openai": async_request_openai_completions,
    "openai-chat": async_request_openai_chat,
}

# endpoint -> default backend
ENDPOINT_BACKENDS: dict[str, str] = {
    "/v1/completions": "openai",
    "/v1/chat/completions": "openai-chat",
}
