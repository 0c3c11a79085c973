"""OpenAI / vLLM request fields -> StructuredOutputsParams."""

from __future__ import annotations

import pytest

from xlaserve.sampling_params import StructuredOutputsParams
from xlaserve.structured import structured_from_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputsParams(json=SCHEMA),
        ),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutputsParams(regex="a+")),
        (
            {"structured_outputs": {"choice": ["a", "b"], "backend": "xgrammar"}},
            StructuredOutputsParams(choice=["a", "b"]),
        ),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_json": '{"type": "string"}'}, StructuredOutputsParams(json='{"type": "string"}')),
        ({"guided_regex": r"\d+"}, StructuredOutputsParams(regex=r"\d+")),
        ({"guided_choice": ["x", "y"]}, StructuredOutputsParams(choice=["x", "y"])),
        (
            {"guided_grammar": 'root ::= "a"', "guided_decoding_backend": "xgrammar"},
            StructuredOutputsParams(grammar='root ::= "a"'),
        ),
        # "text" plus a vLLM constraint is not a conflict.
        (
            {"response_format": {"type": "text"}, "guided_regex": "b"},
            StructuredOutputsParams(regex="b"),
        ),
    ],
)
def test_mapping(body: dict, expected: StructuredOutputsParams | None) -> None:
    assert structured_from_request(body) == expected


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "at most one"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "at most one"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
            "json_schema.schema",
        ),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"guided_json": [1]}, "guided_json"),
        ({"structured_outputs": {"xml": "a"}}, "unsupported keys"),
        ({"structured_outputs": "a+"}, "structured_outputs"),
    ],
)
def test_bad_shapes_raise(body: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        structured_from_request(body)
