"""Grammar repetition bounds are capped at the coordinator (issue 19, row 1): a schema whose bound no
grammar could hold — the 38-byte `maxLength: 20000` that crashed every node it was retried on — is a
400 naming the bound by its path in the caller's own body, on every API that carries schemas, before
anything is reserved or sent."""

from __future__ import annotations

import json
from typing import Any

import pytest

from darkbloom.coordinator.inference.calls import parse_call
from darkbloom.wire.openai.edges import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Edge
from darkbloom.wire.openai.errors import ApiError

HUGE = {"type": "string", "maxLength": 20000}
FINE = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 64}}}
MESSAGES_BODY = [{"role": "user", "content": "hi"}]


def _tool(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": schema}}


CASES: list[tuple[Edge, dict[str, Any], str]] = [
    (CHAT, {"messages": MESSAGES_BODY, "response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "b", "schema": HUGE}}},
     "response_format.json_schema.schema.maxLength"),
    (CHAT, {"messages": MESSAGES_BODY, "response_format": {"type": "json_object", "schema": HUGE}},
     "response_format.schema.maxLength"),
    (CHAT, {"messages": MESSAGES_BODY, "tool_choice": "required",
            "tools": [_tool(FINE), _tool({"type": "object", "properties": {"x": {"type": "string",
                                                                                 "maxLength": 30000}}})]},
     "tools[1].function.parameters.properties.x.maxLength"),
    (CHAT, {"messages": MESSAGES_BODY, "tools": [_tool({"type": "array", "maxItems": 50000})]},
     "tools[0].function.parameters.maxItems"),
    (CHAT, {"messages": MESSAGES_BODY, "functions": [{"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"type": "string", "pattern": "^a{1,20000}$"}}}}]},
     "functions[0].parameters.properties.p.pattern"),
    (RESPONSES, {"input": "hi", "text": {"format": {"type": "json_schema", "name": "b", "schema": HUGE}}},
     "text.format.schema.maxLength"),
    (RESPONSES, {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {
        "type": "string", "minLength": 25000}}]}, "tools[0].parameters.minLength"),
    (MESSAGES, {"max_tokens": 8, "messages": MESSAGES_BODY, "tools": [{"name": "f", "input_schema": {
        "type": "object", "properties": {"q": HUGE}}}]}, "tools[0].input_schema.properties.q.maxLength"),
]


@pytest.mark.parametrize("edge,body,param", CASES, ids=[param for _, _, param in CASES])
def test_a_bound_no_grammar_holds_is_refused_naming_its_path(edge: Edge, body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_call(json.dumps({"model": "m", **body}).encode(), edge)
    error = refused.value
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", param)
    assert "1000" in error.message


@pytest.mark.parametrize("edge,body", [
    (CHAT, {"messages": MESSAGES_BODY, "tools": [_tool(FINE)],
            "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": FINE}}}),
    (RESPONSES, {"input": "hi", "text": {"format": {"type": "json_schema", "name": "b", "schema": FINE}}}),
    (MESSAGES, {"max_tokens": 8, "messages": MESSAGES_BODY, "tools": [{"name": "f", "input_schema": FINE}]}),
    (COMPLETIONS, {"prompt": "x", "response_format": {"type": "json_object", "schema": HUGE}}),  # no grammar there
])
def test_bounds_a_grammar_holds_pass(edge: Edge, body: dict[str, Any]) -> None:
    parse_call(json.dumps({"model": "m", **body}).encode(), edge)
