"""POST /v1/responses: OpenAI's Responses API over the chat path (text in, text out).

Supported: `input` as a string or a list of items (messages with text content, `function_call`
and `function_call_output` items for tool round trips), `instructions` (a system message first),
`max_output_tokens`, `temperature`, `top_p` (and vLLM's sampling extras), `tools` (function tools,
Responses' flat form) with `tool_choice` as on /v1/chat/completions (same parsers and forcing),
`text.format` (json_schema / json_object through structured output), `stream` (the typed events
`response.created` ... `response.completed`), `store` (nothing is stored: the response says
`store: false`, as vLLM without a store).

Refused with 400 naming the field: `previous_response_id` and `conversation` (nothing is stored),
`background`, built-in tools (web_search, file_search, ...), non-text input parts (images,
files), item types other than the above. GET /v1/responses/{id} is 404 (nothing stored).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Any

from aiohttp import web

from xlaserve.entrypoints.openai import api_server as srv
from xlaserve.entrypoints.openai.protocol import ChatCompletionRequest, ProtocolError, parse_body

_UNSUPPORTED = {
    "previous_response_id": "responses are not stored on this server",
    "conversation": "conversations are not stored on this server",
    "background": "background responses are not supported",
    "prompt": "stored prompts are not supported",
}
# Fields passed to the chat path as they are (OpenAI's, and vLLM's sampling extras).
_PASS = (
    "model", "temperature", "top_p", "user", "parallel_tool_calls", "top_k", "min_p", "seed",
    "stop", "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
    "priority", "cache_salt", "chat_template_kwargs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "structured_outputs",
)  # fmt: skip


def _text_of(content: Any, where: str) -> str:  # noqa: ANN401
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProtocolError(f"'{where}.content' must be a string or a list of parts", "input")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ProtocolError(
                f"'{where}.content' part type {kind!r} is not supported (text only)", "input"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ProtocolError(f"'{where}.content[].text' must be a string", "input")
        out.append(text)
    return "".join(out)


def to_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request -> the equivalent /v1/chat/completions body (ProtocolError on what
    is not supported)."""
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    for key, why in _UNSUPPORTED.items():
        if body.get(key) not in (None, False):
            raise ProtocolError(f"'{key}' is not supported: {why}", key)
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ProtocolError("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    inp = body.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list) and inp:
        for i, item in enumerate(inp):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise ProtocolError(f"'{where}' must be an object", "input")
            kind = item.get("type", "message")
            if kind == "message":
                messages.append(
                    {"role": item.get("role"), "content": _text_of(item.get("content"), where)}
                )
            elif kind == "function_call":
                call = {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                }
                last = messages[-1] if messages else None
                if last and last["role"] == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                out = item.get("output")
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": item.get("call_id"),
                        "content": out if isinstance(out, str) else json.dumps(out),
                    }
                )
            else:
                raise ProtocolError(f"'{where}.type' {kind!r} is not supported", "input")
    else:
        raise ProtocolError("'input' must be a string or a non-empty list of items", "input")
    chat: dict[str, Any] = {k: body[k] for k in _PASS if k in body}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ProtocolError("'tools' must be an array", "tools")
        chat_tools = []
        for t in tools:
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise ProtocolError(
                    f"tool type {kind!r} is not supported (function tools only)", "tools"
                )
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
            chat_tools.append({"type": "function", "function": fn})
        chat["tools"] = chat_tools or None
    tc = body.get("tool_choice")
    if isinstance(tc, dict):
        if tc.get("type") != "function" or "name" not in tc:
            raise ProtocolError(
                "'tool_choice' must be 'none', 'auto', 'required' or "
                '{"type": "function", "name": ...}',
                "tool_choice",
            )
        chat["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
    elif tc is not None:
        chat["tool_choice"] = tc
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        if fmt.get("type") == "json_schema":
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")},
            }
        elif fmt.get("type") == "json_object":
            chat["response_format"] = {"type": "json_object"}
        else:
            raise ProtocolError(f"'text.format.type' {fmt.get('type')!r} is not supported", "text")
    return chat


def _usage(out: Any) -> dict[str, Any]:  # noqa: ANN401
    prompt = len(out.prompt_token_ids) if out is not None else 0
    completion = sum(len(c.token_ids) for c in out.outputs) if out is not None else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class _Response:
    """The response object, filled as generation goes."""

    def __init__(self, body: dict[str, Any], chat: ChatCompletionRequest, model: str) -> None:
        self.obj: dict[str, Any] = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": model,
            "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": body.get("temperature"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p"),
            "truncation": "disabled",
            "usage": None,
            "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> None:
        if finish_reason == "length":
            self.obj["status"] = "incomplete"
            self.obj["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            self.obj["status"] = "completed"
        self.obj["usage"] = usage


async def create_response(request: web.Request) -> web.StreamResponse:
    engine = srv._engine(request)
    body = await srv._json_body(request)
    chat_body = to_chat_body(body)
    req = parse_body(ChatCompletionRequest, chat_body)
    lora = srv._check_model(engine, req.model)
    cfg = request.app[srv.CONFIG_KEY]
    srv.apply_generation_defaults(req, request.app[srv.GEN_DEFAULTS_KEY])
    params = req.to_sampling_params()
    if params.n != 1:
        raise ProtocolError("'n' is not supported", "n")
    plan, params = srv.chat_tool_plan(req, params, cfg)
    srv._check_limits(request, engine, req, params, 1)
    prompt = await srv._offload(
        request, srv._chat_prompt, engine, req, cfg.allow_special_tokens_in_content
    )
    resp = _Response(body, req, engine.model_name)
    rid = resp.obj["id"]
    srv._log(request, rid, [prompt], params)
    salt = srv._cache_salt(request, req.cache_salt)
    deadline = srv._deadline(request)
    streams = await srv._add_all(engine, rid, [prompt], params, req.priority, salt, lora)

    if not body.get("stream"):
        (out,) = await srv._collect(engine, streams, deadline)
        assert out is not None
        c = out.outputs[0]
        content, calls = plan.message(c.text)
        if content:
            resp.obj["output"].append(_message_item(content))
        for call in calls:
            resp.obj["output"].append(_call_item(call.id, call.name, call.arguments, "completed"))
        resp.finish(c.finish_reason, _usage(out))
        return web.json_response(resp.obj)
    return await _stream(request, engine, streams, plan, resp, deadline)


class _EventStream:
    """Typed Server-Sent Events (`event: <type>` + `data: {...}`), numbered in order."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        self.seq = 0
        self.closed = False

    async def send(self, type_: str, **fields: Any) -> bool:
        if self.closed:
            return False
        data = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        try:
            payload = json.dumps(data, ensure_ascii=False)
            await self.resp.write(f"event: {type_}\ndata: {payload}\n\n".encode())
            return True
        except (ConnectionError, RuntimeError):
            self.closed = True
            return False


async def _stream(
    request: web.Request,
    engine: Any,  # noqa: ANN401
    streams: list[Any],
    plan: Any,  # noqa: ANN401
    resp: _Response,
    deadline: float | None,
) -> web.StreamResponse:
    ev = _EventStream(request)
    await ev.resp.prepare(request)
    await ev.send("response.created", response=resp.obj)
    await ev.send("response.in_progress", response=resp.obj)
    ts = plan.streamer()
    output = resp.obj["output"]
    msg: dict[str, Any] | None = None  # the open message item
    msg_text = ""
    calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its open item

    async def close_message() -> None:
        nonlocal msg
        if msg is None:
            return
        idx = output.index(msg)
        part = msg["content"][0]
        part["text"] = msg_text
        await ev.send(
            "response.output_text.done",
            item_id=msg["id"],
            output_index=idx,
            content_index=0,
            text=msg_text,
            logprobs=[],
        )
        await ev.send(
            "response.content_part.done",
            item_id=msg["id"],
            output_index=idx,
            content_index=0,
            part=part,
        )
        msg["status"] = "completed"
        await ev.send("response.output_item.done", output_index=idx, item=msg)
        msg = None

    final = None
    try:
        async with contextlib.aclosing(srv._merged(engine, streams)) as it:
            async for _, out in it:
                if deadline is not None and time.monotonic() > deadline:
                    raise srv.APIError(504, "request timed out", "timeout", code="timeout")
                if out.error:
                    raise srv._generation_error(out.error)
                final = out
                c = out.outputs[0]
                delta = ts.delta(c.text, c.finish_reason is not None)
                if delta.get("content"):
                    if msg is None:
                        msg = _message_item("", "in_progress")
                        output.append(msg)
                        idx = len(output) - 1
                        await ev.send("response.output_item.added", output_index=idx, item=msg)
                        await ev.send(
                            "response.content_part.added",
                            item_id=msg["id"],
                            output_index=idx,
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []},
                        )
                    msg_text += delta["content"]
                    ok = await ev.send(
                        "response.output_text.delta",
                        item_id=msg["id"],
                        output_index=output.index(msg),
                        content_index=0,
                        delta=delta["content"],
                        logprobs=[],
                    )
                    if not ok:
                        return ev.resp
                for entry in delta.get("tool_calls", []):
                    await close_message()
                    fn = entry.get("function", {})
                    item = calls.get(entry["index"])
                    if item is None:
                        item = _call_item(entry["id"], fn.get("name", ""), "", "in_progress")
                        calls[entry["index"]] = item
                        output.append(item)
                        await ev.send(
                            "response.output_item.added", output_index=len(output) - 1, item=item
                        )
                    piece = fn.get("arguments") or ""
                    if piece:
                        item["arguments"] += piece
                        await ev.send(
                            "response.function_call_arguments.delta",
                            item_id=item["id"],
                            output_index=output.index(item),
                            delta=piece,
                        )
        await close_message()
        for item in calls.values():
            idx = output.index(item)
            await ev.send(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=idx,
                arguments=item["arguments"],
            )
            item["status"] = "completed"
            await ev.send("response.output_item.done", output_index=idx, item=item)
        resp.finish(final.outputs[0].finish_reason if final else None, _usage(final))
        kind = "response.completed" if resp.obj["status"] == "completed" else "response.incomplete"
        await ev.send(kind, response=resp.obj)
    except Exception as e:
        err = srv._to_api_error(e)
        resp.obj["status"] = "failed"
        resp.obj["error"] = {"code": str(err.code), "message": err.message}
        await ev.send("error", code=str(err.code), message=err.message, param=err.param)
        await ev.send("response.failed", response=resp.obj)
    with contextlib.suppress(ConnectionError, RuntimeError):
        await ev.resp.write_eof()
    return ev.resp


async def retrieve_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}: nothing is stored, so always 404."""
    raise srv.APIError(
        404,
        f"response '{request.match_info['response_id']}' not found (responses are not stored)",
        param="response_id",
        code="not_found",
    )


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
