"""OpenAI / vLLM request fields -> StructuredOutputsParams.

Accepted (at most one constraint in total, else ValueError):
- OpenAI `response_format`: {"type": "text"} (no constraint), {"type": "json_object"},
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}.
- vLLM `structured_outputs`: {"json" | "json_object" | "regex" | "choice" | "grammar": ...}
  (vLLM's tuning options in it, e.g. "backend" or "disable_any_whitespace", are ignored).
- vLLM legacy `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
  (`guided_decoding_backend`, `guided_whitespace_pattern` are ignored).
Shape errors raise ValueError naming the field, so the server can answer 400 with it.
"""

from __future__ import annotations

from typing import Any

from xlaserve.sampling_params import StructuredOutputsParams

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# vLLM options inside `structured_outputs` that do not change which outputs are valid.
_IGNORED_SO_KEYS = {
    "backend",
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
}
_LEGACY = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _check_kind(field: str, kind: str, value: Any) -> Any:
    if kind == "json":
        if not isinstance(value, dict | str):
            raise ValueError(f"'{field}' must be a JSON schema (an object or its JSON text)")
    elif kind == "json_object":
        if not isinstance(value, bool):
            raise ValueError(f"'{field}' must be a boolean")
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise ValueError(f"'{field}' must be a non-empty string")
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ValueError(f"'{field}' must be a non-empty list of strings")
    return value


def _from_response_format(rf: Any) -> tuple[str, Any] | None:
    if not isinstance(rf, dict):
        raise ValueError("'response_format' must be an object with a 'type'")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ValueError(
                "'response_format.json_schema' must be an object with 'name' and 'schema'"
            )
        schema = js.get("schema")
        if not isinstance(schema, dict):
            raise ValueError("'response_format.json_schema.schema' must be a JSON schema object")
        if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
            raise ValueError("'response_format.json_schema.strict' must be a boolean")
        return ("json", schema)
    raise ValueError(
        f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}"
    )


def structured_from_request(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The structured-output constraint of a /v1/completions or /v1/chat/completions body."""
    found: dict[str, tuple[str, Any]] = {}  # request field -> (kind, value)

    rf = body.get("response_format")
    if rf is not None:
        got = _from_response_format(rf)
        if got is not None:
            found["response_format"] = got

    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise ValueError("'structured_outputs' must be an object")
        unknown = set(so) - set(_KINDS) - _IGNORED_SO_KEYS
        if unknown:
            raise ValueError(
                f"'structured_outputs' has unsupported keys {sorted(unknown)}; "
                f"supported: {', '.join(_KINDS)}"
            )
        for kind in _KINDS:
            value = so.get(kind)
            if value is None or (kind == "json_object" and value is False):
                continue
            found[f"structured_outputs.{kind}"] = (
                kind,
                _check_kind(f"structured_outputs.{kind}", kind, value),
            )

    for field, kind in _LEGACY.items():
        value = body.get(field)
        if value is not None:
            found[field] = (kind, _check_kind(field, kind, value))

    if not found:
        return None
    if len(found) > 1:
        raise ValueError(
            "give at most one structured output constraint; got "
            + ", ".join(f"'{f}'" for f in found)
        )
    kind, value = next(iter(found.values()))
    return StructuredOutputsParams(**{kind: value})


def grammar_source_bytes(params: StructuredOutputsParams) -> int:
    """Size of a constraint's source in UTF-8 bytes (the JSON schema's text, the regex, the
    choice list as JSON, the EBNF): what `max_grammar_bytes` bounds before any parsing. A schema
    given as text counts as sent (its cache key is the parsed, re-serialized form)."""
    if isinstance(params.json, str):
        return len(params.json.encode("utf-8", "replace"))
    return len(params.key()[1].encode("utf-8", "replace"))
