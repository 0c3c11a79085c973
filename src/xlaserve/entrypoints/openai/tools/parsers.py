"""Tool-call parsers: model output text -> (content, tool calls), whole or streamed.

Each parser knows one family's format, exactly as that family's chat template and model emit it:

- `hermes` (Hermes 2 Pro, Qwen2.5, `qwen3` is the same):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` (one block per call).
- `qwen3_coder`: `<tool_call>\\n<function=f>\\n<parameter=x>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`.
- `llama3_json` (Llama 3.1/3.2 JSON tool use): the whole output is `{"name": "f", "parameters":
  {...}}` (optionally after `<|python_tag|>`), several separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (tokenizer <= v7) or
  `[TOOL_CALLS]f[ARGS]{...}` (v11+), repeated per call.
- `pythonic` (Llama 3.2 / Llama 4): the whole output is `[f(x=1, y='a'), g()]` (Llama 4 may wrap
  it in `<|python_start|>` ... `<|python_end|>`).
- `deepseek_v3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}
  \\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; `deepseek_v31`: `<｜tool▁call▁begin｜>f<｜tool▁sep｜>
  {...}<｜tool▁call▁end｜>`.

Rules: text before the first tool-call marker is content; output that does not parse as tool
calls stays content (never an error: a model may write anything). Arguments are returned as JSON
text (OpenAI's `function.arguments`). Streaming (`ToolStreamer`) emits content until a marker
could begin, holds the rest, and emits each tool call once it is complete.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    """One parsed call: `arguments` is JSON text of an object."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ExtractedToolCalls:
    """Non-streaming result: `content` is None when only tool calls were written."""

    content: str | None
    tool_calls: list[ToolCall]


def _args_text(args: Any) -> str | None:
    """Arguments (an object, or JSON text of one) as JSON text; None when not an object."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def _call_from_obj(
    obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")
) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    text = _args_text(args)
    return None if text is None else ToolCall(obj["name"], text)


def _json_objects(text: str, sep: str = ",") -> tuple[list[Any], int, bool]:
    """Decode consecutive JSON values in `text` separated by `sep` (and whitespace).

    Returns (values, end offset of the last value, clean): clean is False when something that
    is not a JSON value was met (a value cut short counts as clean: more text may complete it).
    """
    dec = json.JSONDecoder()
    out: list[Any] = []
    pos, end, n = 0, 0, len(text)
    while True:
        while pos < n and (text[pos].isspace() or text[pos] == sep):
            pos += 1
        if pos >= n:
            return out, end, True
        try:
            value, pos = dec.raw_decode(text, pos)
        except ValueError:
            # Truncated (could still complete) or garbage: garbage when a full parse of a
            # closed prefix is impossible; we cannot tell cheaply, so call it clean and let the
            # final parse decide.
            return out, end, True
        out.append(value)
        end = pos


class ToolParser:
    """Base: `markers` are the texts a tool-call section starts with; `at_start_only` parsers
    (llama3_json, pythonic) only read tool calls when the output starts with one."""

    name: str = ""
    markers: tuple[str, ...] = ()
    at_start_only: bool = False

    def region_start(self, text: str) -> int | None:
        """Offset where the tool-call section starts, or None (no section in `text`)."""
        if self.at_start_only:
            stripped = len(text) - len(text.lstrip())
            for m in self.markers:
                if text.startswith(m, stripped):
                    return stripped
            return None
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def could_start(self, text: str) -> int:
        """Length of the longest suffix of `text` that may still grow into a marker (hold it
        back from streamed content)."""
        if self.at_start_only:
            s = text.lstrip()
            if not s or any(m.startswith(s) for m in self.markers):
                return len(text)
            return 0
        best = 0
        for m in self.markers:
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    best = max(best, k)
                    break
        return best

    def parse_region(self, region: str, final: bool) -> list[ToolCall] | None:
        """Tool calls complete in `region` (the text from the marker on). With `final` the
        region is all there is: None means it is not tool calls after all (it is content)."""
        raise NotImplementedError

    def extract(self, text: str) -> ExtractedToolCalls:
        start = self.region_start(text)
        if start is None:
            return ExtractedToolCalls(text, [])
        calls = self.parse_region(text[start:], final=True)
        if not calls:
            return ExtractedToolCalls(text, [])
        content = text[:start]
        return ExtractedToolCalls(content if content.strip() else None, calls)


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse_region(self, region: str, final: bool) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        for m in self._block.finditer(region):
            closed = m.group(0).endswith("</tool_call>")
            if not closed and not final:
                break
            try:
                call = _call_from_obj(json.loads(m.group(1).strip()))
            except ValueError:
                call = None
            if call is None:
                if final:
                    return calls or None
                continue
            calls.append(call)
        return calls


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>", re.S)
    _param = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    @staticmethod
    def _value(text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            return text  # strings are written bare

    def parse_region(self, region: str, final: bool) -> list[ToolCall] | None:
        calls = []
        for m in self._block.finditer(region):
            args = {
                p.group(1).strip(): self._value(p.group(2))
                for p in self._param.finditer(m.group(2))
            }
            calls.append(ToolCall(m.group(1).strip(), json.dumps(args, ensure_ascii=False)))
        if final and not calls:
            return None
        return calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    at_start_only = True

    def parse_region(self, region: str, final: bool) -> list[ToolCall] | None:
        body = region.lstrip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>") :]
        values, end, _ = _json_objects(body, sep=";")
        calls = [_call_from_obj(v) for v in values]
        if any(c is None for c in calls):
            return None if final else []
        if final and (not calls or body[end:].strip()):
            return None
        return calls  # type: ignore[return-value]


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def parse_region(self, region: str, final: bool) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        for part in region.split("[TOOL_CALLS]")[1:]:
            if "[ARGS]" in part:  # v11+: name[ARGS]{...}
                name, args = part.split("[ARGS]", 1)
                values, _, _ = _json_objects(args)
                if not values:
                    if final:
                        return calls or None
                    break
                text = _args_text(values[0])
                if text is None:
                    return calls or None if final else calls
                calls.append(ToolCall(name.strip(), text))
                continue
            s = part.lstrip()
            if s.startswith("["):  # a JSON array of calls
                values, _, _ = _json_objects(s[1:])
            else:
                values, _, _ = _json_objects(s)
            for v in values:
                c = _call_from_obj(v)
                if c is None:
                    return (calls or None) if final else calls
                calls.append(c)
        if final and not calls:
            return None
        return calls


class PythonicParser(ToolParser):
    name = "pythonic"
    markers = ("<|python_start|>", "[")
    at_start_only = True

    def parse_region(self, region: str, final: bool) -> list[ToolCall] | None:
        body = region.strip()
        if body.startswith("<|python_start|>"):
            body = body[len("<|python_start|>") :]
        body = body.replace("<|python_end|>", "").strip()
        try:
            tree = ast.parse(body, mode="eval")
        except SyntaxError:
            return None if final else []
        if not isinstance(tree.body, ast.List):
            return None
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or node.args:
                return None
            fn = node.func
            if isinstance(fn, ast.Name):
                name = fn.id
            elif isinstance(fn, ast.Attribute):
                name = ast.unparse(fn)
            else:
                return None
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                return None
            if None in args:  # **kwargs
                return None
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls


_DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
_DS_SEP = "<｜tool▁sep｜>"
_DS_CALL_END = "<｜tool▁call▁end｜>"


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    markers = (_DS_CALLS_BEGIN, _DS_CALL_BEGIN)
    _call = re.compile(
        re.escape(_DS_CALL_BEGIN)
        + r"(?:function)?"
        + re.escape(_DS_SEP)
        + r"(.*?)\n```(?:json)?\n(.*?)\n```\s*"
        + re.escape(_DS_CALL_END),
        re.S,
    )

    def _calls(self, region: str) -> list[ToolCall | None]:
        out: list[ToolCall | None] = []
        for m in self._call.finditer(region):
            text = _args_text(m.group(2).strip())
            out.append(None if text is None else ToolCall(m.group(1).strip(), text))
        return out

    def parse_region(self, region: str, final: bool) -> list[ToolCall] | None:
        calls = self._calls(region)
        if any(c is None for c in calls) or (final and not calls):
            return None if final else [c for c in calls if c is not None]
        return calls  # type: ignore[return-value]


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseek_v31"
    _call = re.compile(
        re.escape(_DS_CALL_BEGIN)
        + r"(.*?)"
        + re.escape(_DS_SEP)
        + r"(.*?)"
        + re.escape(_DS_CALL_END),
        re.S,
    )


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen3": HermesParser,  # Qwen3's template writes Hermes-style <tool_call> blocks
    "qwen3_coder": Qwen3CoderParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "deepseek_v3": DeepSeekV3Parser,
    "deepseek_v31": DeepSeekV31Parser,
}


def get_tool_parser(name: str) -> ToolParser:
    """A parser by its `--tool-call-parser` name (ValueError listing the names otherwise)."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}")
    return cls()


class ToolStreamer:
    """Streaming extraction over the growing output text of one choice.

    `feed(text, final)` takes the whole text so far and returns (content delta, new complete
    tool calls). Content is emitted up to where a marker could begin; once the tool-call section
    starts, its calls are emitted as each completes; at `final`, a section that does not parse
    is emitted as content (as the non-streaming path does).
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent = 0  # characters of text emitted as content
        self.start: int | None = None  # offset of the tool-call section
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        if self.start is None:
            self.start = self.parser.region_start(text)
            if self.start is not None and self.start < self.sent:
                self.start = None  # a marker inside content already sent: stays content
        if self.start is None:
            hold = 0 if final else self.parser.could_start(text)
            end = len(text) - hold
            delta = text[self.sent : end] if end > self.sent else ""
            self.sent = max(self.sent, end)
            return delta, []
        delta = text[self.sent : self.start]
        self.sent = self.start
        calls = self.parser.parse_region(text[self.start :], final)
        if calls is None:  # final and not tool calls after all: the rest is content
            delta += text[self.sent :]
            self.sent = len(text)
            return delta, []
        new = calls[len(self.calls) :]
        self.calls.extend(new)
        return delta, new
