"""Tool calling for /v1/chat/completions (and /v1/responses): what a request's `tools` and
`tool_choice` mean for its sampling and how its output text becomes `tool_calls`.

Modes (`ToolPlan.mode`), as vLLM serves them:
- "none": tools (if any) are shown to the template; the output is plain content.
- "auto": needs `--enable-auto-tool-choice --tool-call-parser NAME` (else 400); the parser reads
  tool calls out of free text (finish_reason "tool_calls" when it found some).
- "required": the output is forced by the structured-output engine into a JSON array of
  `{"name": <one of the tools>, "parameters": {...its schema}}` (at least one).
- named (`{"type": "function", "function": {"name": F}}`): the output is forced into F's
  parameters schema and is F's `arguments` (finish_reason "stop", as OpenAI).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xlaserve.entrypoints.openai.tools.parsers import (
    ToolCall,
    ToolParser,
    ToolStreamer,
    _args_text,
    _call_from_obj,
    _json_objects,
    get_tool_parser,
)
from xlaserve.sampling_params import StructuredOutputsParams

AUTO_NEEDS_PARSER = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


class ToolRequestError(ValueError):
    """A tool request the server cannot honour (HTTP 400, param `tool_choice`)."""


def _params_schema(fn: dict[str, Any]) -> dict[str, Any]:
    p = fn.get("parameters")
    return p if isinstance(p, dict) and p else {"type": "object"}


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """JSON schema of `tool_choice="required"` output: a non-empty array of calls (one call
    when `parallel` is False: parallel_tool_calls=false)."""
    alts = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _params_schema(t["function"]),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    item = alts[0] if len(alts) == 1 else {"anyOf": alts}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass
class ToolPlan:
    """How one request's tools shape its sampling and its answer."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]] | None = None  # as given to the chat template
    function: str | None = None  # the named function
    parser: ToolParser | None = None  # mode "auto"
    parallel: bool = True  # parallel_tool_calls: False keeps one call

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def structured(self) -> StructuredOutputsParams | None:
        """The constraint that forces a call ("required" / named), else None."""
        if self.mode == "named":
            fn = next(
                t["function"] for t in self.tools or [] if t["function"]["name"] == self.function
            )
            return StructuredOutputsParams(json=_params_schema(fn))
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.tools or [], self.parallel))
        return None

    def finish_reason(self, reason: str | None, made_calls: bool) -> str | None:
        if made_calls and reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def message(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of one finished choice."""
        if self.mode == "named":
            args = _args_text(text)
            if args is None:  # cut short (max_tokens): give the text back, no call
                return text, []
            return None, [ToolCall(self.function or "", args)]
        if self.mode == "required":
            # The calls complete so far: an array cut short (max_tokens) keeps its whole items.
            body = text.lstrip()
            values, _, _ = _json_objects(body[1:] if body.startswith("[") else body)
            calls = [_call_from_obj(v, ("parameters", "arguments")) for v in values]
            if not calls or any(c is None for c in calls):
                return text, []
            return None, calls  # type: ignore[return-value]
        if self.mode == "auto" and self.parser is not None:
            r = self.parser.extract(text)
            return r.content, r.tool_calls if self.parallel else r.tool_calls[:1]
        return text, []

    def streamer(self) -> ChoiceToolStream:
        return ChoiceToolStream(self)


@dataclass
class ChoiceToolStream:
    """Streamed deltas of one choice: `delta(text, final)` -> the chat delta dict to send
    (empty when there is nothing new). Tool calls go out as OpenAI's `delta.tool_calls`
    entries, each with its `index`; a named call streams its arguments as they are written."""

    plan: ToolPlan
    sent: int = 0
    n_calls: int = 0
    _auto: ToolStreamer | None = None
    _named_id: str = ""
    _calls: list[ToolCall] = field(default_factory=list)

    def _entries(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out = []
        for c in calls:
            out.append({"index": self.n_calls, **c.to_openai()})
            self.n_calls += 1
        return out

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        plan = self.plan
        if plan.mode == "named":
            piece = text[self.sent :]
            self.sent = len(text)
            if not self.n_calls:
                call = ToolCall(plan.function or "", piece)
                self.n_calls = 1
                return {"tool_calls": [{"index": 0, **call.to_openai()}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if piece else {}
        if plan.mode == "required":
            body = text.lstrip()
            values, _, _ = _json_objects(body[1:] if body.startswith("[") else body)
            new = []
            for v in values[self.n_calls :]:
                c = _call_from_obj(v, ("parameters", "arguments"))
                if c is None:
                    break
                new.append(c)
            return {"tool_calls": self._entries(new)} if new else {}
        if plan.mode == "auto" and plan.parser is not None:
            if self._auto is None:
                self._auto = ToolStreamer(plan.parser)
            content, calls = self._auto.feed(text, final)
            if not plan.parallel:
                calls = calls[: max(0, 1 - self.n_calls)]
            d: dict[str, Any] = {}
            if content:
                d["content"] = content
            if calls:
                d["tool_calls"] = self._entries(calls)
            return d
        piece = text[self.sent :]
        self.sent = len(text)
        return {"content": piece} if piece else {}


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
    parallel_tool_calls: bool | None = None,
) -> ToolPlan:
    """The plan of a request (already shape-checked by the protocol); ToolRequestError when the
    server is not set up for it ("auto" without a parser)."""
    parallel = parallel_tool_calls is not False
    if not tools or tool_choice in (None, "none"):
        return ToolPlan("none", tools or None)
    if isinstance(tool_choice, dict):
        return ToolPlan("named", tools, function=tool_choice["function"]["name"])
    if tool_choice == "required":
        return ToolPlan("required", tools, parallel=parallel)
    if not (enable_auto_tool_choice and tool_call_parser):
        raise ToolRequestError(AUTO_NEEDS_PARSER)
    return ToolPlan("auto", tools, parser=get_tool_parser(tool_call_parser), parallel=parallel)
