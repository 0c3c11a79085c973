"""OpenAI request bodies as dataclasses, validated from JSON.

`parse_body(CompletionRequest, body)` checks every known field against its type hint and raises
`ProtocolError(message, param)` naming the first bad parameter; unknown fields are ignored, like
OpenAI does. Each request type turns itself into `SamplingParams` (`to_sampling_params`), whose
own range checks raise `ValueError` (the server maps both to HTTP 400).

Response bodies are plain dicts built by the server (see `api_server.py`); their shapes follow
OpenAI's reference: `text_completion`, `chat.completion`, `chat.completion.chunk`, `list`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from xlaserve.sampling_params import SamplingParams, StructuredOutputsParams

# One prompt: text or token ids. A request may carry a list of prompts.
PromptLike = str | list[str] | list[int] | list[list[int]]

# JSON integers must fit a signed 64-bit integer (seeds, token ids and counts end up in int64
# tensors; a bigger one would crash the engine thread, not the request).
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
# OpenAI's limits: choices per request, |logit_bias| per token.
MAX_N = 128
MAX_LOGIT_BIAS = 100.0
# Keys the chat template itself sets: `chat_template_kwargs` may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token"}
)


class ProtocolError(ValueError):
    """A request body that does not match the schema; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class _BadUnicode(ProtocolError):
    """A string holding lone surrogates (JSON escapes allow them; UTF-8 and tokenizers do not)."""


# ---------------------------------------------------------------------------------------------
# Generic dataclass-from-JSON validation.


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (arg,) = typing.get_args(tp)
        return f"array of {_type_name(arg)}"
    if origin is dict:
        return "object"
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "object"
    return {
        int: "integer",
        float: "number",
        str: "string",
        bool: "boolean",
        type(None): "null",
    }.get(tp, getattr(tp, "__name__", str(tp)))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(value: Any, tp: Any, param: str) -> Any:
    """Return `value` checked against (and, for nested dataclasses, converted to) `tp`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        for alt in typing.get_args(tp):
            try:
                return _convert(value, alt, param)
            except _BadUnicode:
                raise  # the right type with bad text: say so, not "must be X or Y"
            except ProtocolError:
                continue
        raise ProtocolError(f"'{param}' must be {_type_name(tp)}", param)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ProtocolError(f"'{param}' must be one of {list(typing.get_args(tp))}", param)
    if origin is list:
        (arg,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ProtocolError(f"'{param}' must be {_type_name(tp)}", param)
        return [_convert(v, arg, f"{param}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ProtocolError(f"'{param}' must be an object", param)
        return {k: _convert(v, val_tp, f"{param}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ProtocolError(f"'{param}' must be an object", param)
        return parse_body(tp, value, prefix=f"{param}.")
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        # JSON has one number type: accept 3.0 as 3, refuse booleans and 3.5.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT_MIN <= value <= INT_MAX:
                raise ProtocolError(f"'{param}' is out of the 64-bit integer range", param)
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                f = float(value)
            except OverflowError:  # an integer beyond float range
                f = math.inf
            if not math.isfinite(f):
                raise ProtocolError(f"'{param}' must be a finite number", param)
            return f
    elif tp is str:
        if isinstance(value, str):
            try:  # JSON's \ud800 escapes decode to lone surrogates: not text, refuse here
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise _BadUnicode(
                    f"'{param}' is not valid Unicode (lone surrogate code point)", param
                ) from None
            return value
    else:  # pragma: no cover - a schema bug, not a client error
        raise TypeError(f"unsupported schema type {tp!r}")
    raise ProtocolError(f"'{param}' must be {_type_name(tp)}, got {type(value).__name__}", param)


def parse_body(cls: type, body: Any, prefix: str = "") -> Any:
    """Build dataclass `cls` from a decoded JSON object, checking types; unknown keys ignored."""
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object", prefix.rstrip(".") or None)
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"'{prefix}{f.name}' is required", prefix + f.name)
            continue
        kwargs[f.name] = _convert(body[f.name], hints[f.name], prefix + f.name)
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------
# Requests.


@dataclass
class StreamOptions:
    include_usage: bool = False
    # vLLM extra: usage in every chunk too (with include_usage).
    continuous_usage_stats: bool = False


@dataclass
class ResponseFormat:
    # "text", "json_object" or "json_schema" ({"json_schema": {"name", "schema"}}).
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None


@dataclass
class _SamplingFields:
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # xlaserve extras.
    priority: int = 0
    cache_salt: str | None = None
    # vLLM extras: prompt log-probabilities (top k per prompt position, first None) returned
    # as `prompt_logprobs`; tokens written "token_id:<id>" in logprobs.
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    # Guided decoding (vLLM names).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's current name: {"json": ..., "json_object": true, "regex": ..., "choice": [...], "grammar": ...}
    structured_outputs: dict[str, Any] | None = None

    def _check_common(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise ProtocolError(f"'n' must be in [1, {MAX_N}], got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise ProtocolError(
                "'stream_options' is only allowed when 'stream' is true", "stream_options"
            )
        if self.logit_bias is not None:
            for k in self.logit_bias:
                try:
                    int(k)
                except ValueError:
                    raise ProtocolError(
                        f"'logit_bias' keys must be token ids, got {k!r}", "logit_bias"
                    ) from None
                if not -MAX_LOGIT_BIAS <= self.logit_bias[k] <= MAX_LOGIT_BIAS:
                    raise ProtocolError(
                        f"'logit_bias' values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                        "logit_bias",
                    )

    def _structured(self) -> StructuredOutputsParams | None:
        """One constraint from response_format / structured_outputs / guided_* (400 otherwise)."""
        from xlaserve.structured.openai_compat import structured_from_request

        body: dict[str, Any] = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
            "structured_outputs": self.structured_outputs,
        }
        if self.response_format is not None:
            rf = self.response_format
            body["response_format"] = {"type": rf.type, "json_schema": rf.json_schema}
        try:
            return structured_from_request(body)
        except (TypeError, ValueError) as e:
            param = "response_format" if self.response_format is not None else "structured_outputs"
            raise ProtocolError(str(e), param) from None

    def _sampling(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        def opt(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=opt(self.temperature, 1.0),
            top_p=opt(self.top_p, 1.0),
            top_k=opt(self.top_k, 0),
            min_p=opt(self.min_p, 0.0),
            presence_penalty=opt(self.presence_penalty, 0.0),
            frequency_penalty=opt(self.frequency_penalty, 0.0),
            repetition_penalty=opt(self.repetition_penalty, 1.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            structured_outputs=self._structured(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (vLLM: include_usage and continuous_usage_stats)."""
        so = self.stream_options
        return bool(so and so.include_usage and so.continuous_usage_stats)


@dataclass
class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: PromptLike | None = None  # required
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def __post_init__(self) -> None:
        self._check_common()
        if self.best_of is not None and self.best_of != self.n:
            raise ProtocolError("best_of != n is not supported; leave best_of unset", "best_of")
        if self.suffix:
            raise ProtocolError("suffix is not supported", "suffix")
        if self.max_tokens == 0 and not self.echo:
            raise ProtocolError("max_tokens=0 is only allowed with echo=true", "max_tokens")
        self.prompts()  # validates shape and emptiness

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each a string or a list of token ids."""
        p = self.prompt
        if p is None:
            raise ProtocolError("'prompt' is required", "prompt")
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            out = [list(p)]  # one prompt of token ids
        else:
            out = list(p)  # list of strings or list of token-id lists
        if not out:
            raise ProtocolError("'prompt' must not be empty", "prompt")
        for x in out:
            if len(x) == 0:
                raise ProtocolError("'prompt' must not contain an empty prompt", "prompt")
        return out

    def to_sampling_params(self) -> SamplingParams:
        # echo + logprobs: the prompt's logprobs are returned too (first position None).
        prompt_lp = self.logprobs if (self.echo and self.logprobs is not None) else None
        if self.prompt_logprobs is not None:
            prompt_lp = max(prompt_lp or 0, self.prompt_logprobs)
        # max_tokens=0 (echo only, scoring clients): the engine samples one token, which the
        # server drops (`echo_only`).
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self._sampling(max_tokens, self.logprobs, prompt_lp)

    @property
    def echo_only(self) -> bool:
        """echo=true with max_tokens=0: the prompt (and its logprobs) and nothing generated."""
        return self.echo and self.max_tokens == 0


@dataclass
class TextContentPart:
    type: str = "text"
    text: str = ""


@dataclass
class FunctionCallBody:
    name: str
    arguments: str = "{}"  # JSON text of an object, as OpenAI sends it


@dataclass
class MessageToolCall:
    """An assistant message's earlier tool call (`messages[i].tool_calls[j]`)."""

    function: FunctionCallBody
    id: str | None = None
    type: Literal["function"] = "function"


@dataclass
class FunctionDefinition:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


@dataclass
class ToolDefinition:
    """One entry of `tools`: {"type": "function", "function": {...}}."""

    function: FunctionDefinition
    type: Literal["function"] = "function"

    def to_dict(self) -> dict[str, Any]:
        f = self.function
        fn: dict[str, Any] = {"name": f.name}
        if f.description is not None:
            fn["description"] = f.description
        fn["parameters"] = f.parameters if f.parameters is not None else {"type": "object"}
        return {"type": "function", "function": fn}


@dataclass
class ChatMessage:
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this result answers

    def __post_init__(self) -> None:
        if self.tool_calls is not None and self.role != "assistant":
            raise ProtocolError("only assistant messages may carry 'tool_calls'", "messages")
        for tc in self.tool_calls or []:
            try:
                args = json.loads(tc.function.arguments)
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise ProtocolError(
                    "'tool_calls[].function.arguments' must be JSON text of an object", "messages"
                )
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text":
                    raise ProtocolError(
                        f"content part type {part.type!r} is not supported (only 'text')",
                        "messages",
                    )

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def to_template_dict(self) -> dict[str, Any]:
        role = "system" if self.role == "developer" else self.role
        d: dict[str, Any] = {"role": role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            # Templates index arguments as a mapping (`tool_call.arguments | tojson`, `.items()`):
            # they get the decoded object, as vLLM and transformers pass them.
            d["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {
                        "name": tc.function.name,
                        "arguments": json.loads(tc.function.arguments),
                    },
                }
                for tc in self.tool_calls
            ]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


@dataclass
class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = field(default_factory=list)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    echo: bool = False  # vLLM extra: prepend the last message's content when it is the assistant's
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling: "none" | "auto" | "required" | {"type": "function", "function": {"name"}};
    # unset means "auto" when tools are given, else "none" (as OpenAI and vLLM).
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extras: end the prompt inside the last (assistant) message so the model continues
    # it; a per-request template (only with --trust-request-chat-template).
    continue_final_message: bool = False
    chat_template: str | None = None

    def __post_init__(self) -> None:
        self._check_common()
        if not self.messages:
            raise ProtocolError("'messages' must be a non-empty array", "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise ProtocolError(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true "
                "(set add_generation_prompt to false)",
                "continue_final_message",
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ProtocolError(
                "'continue_final_message' needs the last message to be the assistant's",
                "continue_final_message",
            )
        self._check_tools()
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        reserved = RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {})
        if reserved:
            raise ProtocolError(
                f"'chat_template_kwargs' may not set {sorted(reserved)}", "chat_template_kwargs"
            )

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or []]
        if self.tools is not None and not self.tools:
            raise ProtocolError("'tools' must not be empty (leave it out)", "tools")
        if len(set(names)) != len(names):
            raise ProtocolError("'tools' has two functions of the same name", "tools")
        tc = self.tool_choice
        if tc is None:
            self.tool_choice = "auto" if self.tools else "none"
        elif isinstance(tc, str):
            if tc not in ("none", "auto", "required"):
                raise ProtocolError(
                    "'tool_choice' must be 'none', 'auto', 'required' or "
                    '{"type": "function", "function": {"name": ...}}',
                    "tool_choice",
                )
            if tc != "none" and not self.tools:
                raise ProtocolError(f"'tool_choice' {tc!r} needs 'tools'", "tool_choice")
        else:
            fn = tc.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if tc.get("type") != "function" or not isinstance(name, str):
                raise ProtocolError(
                    "'tool_choice' object must be "
                    '{"type": "function", "function": {"name": ...}}',
                    "tool_choice",
                )
            if name not in names:
                raise ProtocolError(
                    f"'tool_choice' names function {name!r}, which is not in 'tools'",
                    "tool_choice",
                )

    @property
    def named_tool(self) -> str | None:
        """The function `tool_choice` forces, if it names one."""
        tc = self.tool_choice
        return tc["function"]["name"] if isinstance(tc, dict) else None

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs, self.prompt_logprobs)


@dataclass
class TokenizeRequest:
    """POST /tokenize: either `prompt` or chat `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # Chat form only, as in /v1/chat/completions (vLLM's tokenize takes them too).
    tools: list[ToolDefinition] | None = None
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False  # vLLM extra: also each token's string (`token_strs`)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ProtocolError("give exactly one of 'prompt' or 'messages'", "prompt")
        if self.continue_final_message and self.add_generation_prompt:
            raise ProtocolError(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true "
                "(set add_generation_prompt to false)",
                "continue_final_message",
            )
        reserved = RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {})
        if reserved:
            raise ProtocolError(
                f"'chat_template_kwargs' may not set {sorted(reserved)}", "chat_template_kwargs"
            )


@dataclass
class DetokenizeRequest:
    """POST /detokenize."""

    tokens: list[int]
    model: str | None = None
    skip_special_tokens: bool = False


# Parameter names a SamplingParams ValueError message may start with -> request field name.
SAMPLING_PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)} | {
    "max_completion_tokens",
    "top_logprobs",
}


def param_from_message(message: str) -> str | None:
    """SamplingParams errors start with the field name ("top_p must be ..."): recover it."""
    first = message.split(" ", 1)[0].strip("'\":,")
    return first if first in SAMPLING_PARAM_NAMES else None
