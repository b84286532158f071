"""Repetition bounds of a JSON schema (`wire.schema_bounds`), checked by the node before any grammar
is built (issue 19 row 1: one `maxLength` of 20,000 killed llama.cpp with SIGSEGV), and the grammar's
JSON strings without raw control characters (row 8)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from darkbloom.provider.backends.base import BackendError
from darkbloom.provider.backends.llama_chat import chat_job
from darkbloom.provider.backends.llama_decode import check_grammar
from darkbloom.provider.backends.llama_model import LoadedModel
from darkbloom.provider.backends.tool_params import schema_grammar
from darkbloom.wire.schema_bounds import MAX_NODES, MAX_REPETITION, repetition_problem

ASK = [{"role": "user", "content": "x"}]
RF = "response_format.json_schema.schema"


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "b", "schema": schema}}


def tool(parameters: dict[str, Any], name: str = "f") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.fixture(scope="module")
def vocab(gguf: Path) -> LoadedModel:
    return LoadedModel(gguf, vocab_only=True)


@pytest.mark.parametrize("schema, where", [
    ({"type": "string", "maxLength": 20_000}, "p.maxLength"),
    ({"type": "string", "minLength": 1001}, "p.minLength"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 50_000}, "p.maxItems"),
    ({"type": "object", "minProperties": 5000}, "p.minProperties"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 30_000}}}, "p.properties.a.maxLength"),
    ({"type": "string", "pattern": "^[a-z]{3,20000}$"}, "p.pattern"),
    ({"type": "string", "pattern": "^x{" + "9" * 5000 + "}$"}, "p.pattern"),  # digits past int()'s own limit
    ({"anyOf": [{"type": "null"}, {"type": "array", "items": {"maxLength": 9999}}]}, "p.anyOf[1].items.maxLength"),
    ({"$defs": {"big": {"type": "string", "maxLength": 1e9}}, "$ref": "#/$defs/big"}, "p.$defs.big.maxLength"),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"maxItems": 2000}]}, "p.prefixItems[1].maxItems"),
    ({"additionalProperties": {"type": "string", "maxLength": float("nan")}}, "p.additionalProperties.maxLength"),
    ({"not": {"allOf": [{"oneOf": [{"maxLength": 1001}]}]}}, "p.not.allOf[0].oneOf[0].maxLength"),
])
def test_a_bound_over_the_cap_is_named(schema: dict[str, Any], where: str) -> None:
    problem = repetition_problem(schema, "p")
    assert problem is not None and problem[0] == where and str(MAX_REPETITION) in problem[1]


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": MAX_REPETITION, "minLength": 10, "pattern": "^[a-z]{0,1000}$"},
    {"type": "array", "items": {"type": "string", "maxLength": 200}, "maxItems": 1000},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "maxProperties": True},
    {"type": "string", "pattern": "^{not a quantifier}$"},
])
def test_schemas_under_the_caps_pass(schema: dict[str, Any]) -> None:
    assert repetition_problem(schema, "p") is None


def test_hostile_shapes_are_refused_cheaply() -> None:
    nested: dict[str, Any] = {}
    inner = nested
    for _ in range(5000):
        inner["items"] = {}
        inner = inner["items"]
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200_000)},
            "required": [f"p{i}" for i in range(200_000)]}
    many_bounds = {"type": "object", "properties": {f"p{i}": {"maxLength": 1000} for i in range(100)},
                   "required": [f"p{i}" for i in range(100)]}
    optional = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
    assert "deeper than" in (repetition_problem(nested, "p") or ("", ""))[1]
    assert f"more than {MAX_NODES}" in (repetition_problem(wide, "p") or ("", ""))[1]
    assert "add up to" in (repetition_problem(many_bounds, "p") or ("", ""))[1]
    assert (repetition_problem(optional, "p") or ("", ""))[0] == "p.properties"


def bounded(n: int) -> list[dict[str, Any]]:
    return [{"type": "string", "maxLength": n}, {"type": "array", "items": {"type": "integer"}, "maxItems": n},
            {"type": "string", "pattern": f"^(ab|c){{0,{n}}}$"}]


@pytest.mark.parametrize("kind", range(3))
def test_at_the_cap_llama_cpp_builds_the_grammar_and_one_more_it_refuses(vocab: LoadedModel, kind: int) -> None:
    """Why the cap is 1,000: llama.cpp's grammar parser accepts that many repetitions and no more
    (beyond ~20,000 it never gets to refuse: the process dies)."""
    assert check_grammar(vocab, schema_grammar(bounded(MAX_REPETITION)[kind], "p"))
    with pytest.raises(BackendError) as info:
        schema_grammar(bounded(MAX_REPETITION + 1)[kind], "p")
    assert (info.value.status_code, info.value.param) == (400, "p")


def test_the_caps_reason_holds_in_llama_cpp(vocab: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("darkbloom.provider.backends.tool_params.repetition_problem", lambda *a: None)
    for schema in bounded(MAX_REPETITION + 1):  # past the cap llama.cpp's parser refuses (far past it, crashes)
        assert not check_grammar(vocab, schema_grammar(schema, "p"))


@pytest.mark.parametrize("body, param", [
    ({"response_format": schema_format({"type": "string", "maxLength": 20_000})}, f"{RF}.maxLength"),
    ({"response_format": {"type": "json_object", "schema": {"type": "array", "maxItems": 50_000}}},
     "response_format.schema.maxItems"),
    ({"tools": [tool({"type": "object"}), tool({"type": "object", "properties": {
        "q": {"type": "string", "maxLength": 30_000}}}, "g")], "tool_choice": "required"},
     "tools[1].function.parameters.properties.q.maxLength"),
    ({"functions": [{"name": "f", "parameters": {"type": "array", "minItems": 50_000}}]},
     "functions[0].parameters.minItems"),
    ({"tools": [tool({"type": "object", "properties": {f"{'k' * 100}": {"maxLength": 99_999}}})]}, "tools[0].function.parameters"),
])
def test_the_node_refuses_before_any_grammar_naming_the_param(body: dict[str, Any], param: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def no_conversion(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the converter must never see this schema")

    monkeypatch.setattr("llama_cpp.llama_grammar.SchemaConverter.visit", no_conversion)
    with pytest.raises(BackendError) as info:
        chat_job({"messages": ASK, **body}, None, 2048)
    assert (info.value.status_code, info.value.param) == (400, param)
    assert len(info.value.param or "") <= 128


def test_the_union_of_tools_is_bounded_too() -> None:
    tools = [tool({"type": "object", "properties": {f"a{j}": {"maxLength": 1000} for j in range(15)},
                   "required": [f"a{j}" for j in range(15)]}, f"t{i}") for i in range(2)]
    with pytest.raises(BackendError) as info:  # each under the total, both together over it
        chat_job({"messages": ASK, "tools": tools, "tool_choice": "required"}, None, 2048)
    assert (info.value.status_code, info.value.param) == (400, "tools")


def test_json_strings_admit_no_raw_control_character(vocab: LoadedModel) -> None:
    grammar = schema_grammar({"type": "object", "properties": {"a": {"type": "string"},
                                                               "b": {"type": "string", "pattern": "^x.y$"}}}, "p")
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines())
    assert rules["char"].startswith(r'[^"\\\x7F\x00-\x1F]') and rules["dot"] == r'[^"\\\x7F\x00-\x1F]'
    assert check_grammar(vocab, grammar)
