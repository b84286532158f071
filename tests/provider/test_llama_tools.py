"""Structured output, tools and logprobs on the in-process llama.cpp backend (the bundled SmolLM2).

The tiny model's answers are often silly; these tests assert on the protocol (shapes, a call that
a grammar forced, JSON valid against its schema), never on wording."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from darkbloom.provider.backends.base import BackendError
from darkbloom.provider.backends.llama_cpp import LlamaCppBackend

MODEL = "smollm2-135m"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}},
                   "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


pytestmark = pytest.mark.llama(max_concurrency=1, n_ctx=1024)  # the backend fixture's size (conftest)


async def collect(backend: LlamaCppBackend, body: dict[str, Any]) -> list[dict[str, Any]]:
    return [chunk async for chunk in backend.stream_chat(MODEL, {"temperature": 0, **body})]


def content(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def tool_calls(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The streamed tool_calls deltas merged the way the openai SDK merges them."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for delta in (chunk["choices"][0]["delta"].get("tool_calls") or []) if chunk["choices"] else []:
            call = calls.setdefault(delta["index"], {"function": {"name": "", "arguments": ""}})
            for key in ("id", "type"):
                if key in delta:
                    call[key] = delta[key]
            call["function"]["name"] += delta.get("function", {}).get("name", "")
            call["function"]["arguments"] += delta.get("function", {}).get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def finish_reason(chunks: list[dict[str, Any]]) -> str:
    return [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    {"type": "json_object"},
])
async def test_structured_output_is_valid_json(backend: LlamaCppBackend, fmt: dict[str, Any]) -> None:
    chunks = await collect(backend, {"messages": [{"role": "user", "content": "Describe a person as JSON."}],
                                     "response_format": fmt, "max_tokens": 120})
    assert finish_reason(chunks) == "stop"
    answer = json.loads(content(chunks))
    assert isinstance(answer, dict)
    if fmt["type"] == "json_schema":
        jsonschema.validate(answer, PERSON)


async def test_a_schema_llama_cpp_cannot_follow_is_400_response_format(backend: LlamaCppBackend) -> None:
    schema = {"type": "object", "properties": {"x": {"$ref": "https://example.com/elsewhere.json"}}}
    with pytest.raises(BackendError) as info:
        await collect(backend, {"messages": ASK, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert (info.value.status_code, info.value.param) == (400, "response_format")


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
async def test_a_forced_tool_call_is_streamed_in_openai_shape(backend: LlamaCppBackend, choice: Any) -> None:
    chunks = await collect(backend, {"messages": ASK, "tools": [TIME, WEATHER] if choice == "required" else
                                     [WEATHER, TIME], "tool_choice": choice, "max_tokens": 80})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    head = next(c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls"))
    [first] = head["choices"][0]["delta"]["tool_calls"]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["arguments"] == "" and first["function"]["name"]
    following = [d for c in chunks[chunks.index(head) + 1:] if c["choices"]
                 for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert following and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                             for d in following)
    assert finish_reason(chunks) == "tool_calls" and content(chunks) == ""
    [call] = tool_calls(chunks)
    tool = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
    if isinstance(choice, dict):
        assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
    assert chunks[-1]["usage"]["completion_tokens"] > 0


async def test_legacy_functions_answer_with_function_call(backend: LlamaCppBackend) -> None:
    chunks = await collect(backend, {"messages": ASK, "functions": [WEATHER["function"]],
                                     "function_call": {"name": "get_weather"}, "max_tokens": 80})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["function_call"] for d in deltas if d.get("function_call")]
    assert calls[0] == {"name": "get_weather", "arguments": ""}
    assert all(set(c) == {"arguments"} for c in calls[1:])
    assert not any(d.get("tool_calls") for d in deltas)
    assert finish_reason(chunks) == "function_call"
    arguments = json.loads("".join(c["arguments"] for c in calls))
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])


@pytest.mark.parametrize("extra", [{"tool_choice": "none"}, {"tool_choice": "auto"}, {"function_call": "none"}])
async def test_none_and_auto_answer_in_text_or_a_valid_call(backend: LlamaCppBackend, extra: dict[str, Any]) -> None:
    tools = {"functions": [WEATHER["function"]]} if "function_call" in extra else {"tools": [WEATHER]}
    chunks = await collect(backend, {"messages": [{"role": "user", "content": "Say hello."}], **tools, **extra,
                                     "max_tokens": 40})
    calls = tool_calls(chunks)
    if extra.get("tool_choice") == "auto" and calls:  # the model chose a call: a valid one
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER["function"]["parameters"])
        assert finish_reason(chunks) == "tool_calls"
    else:
        assert not calls and content(chunks).strip()
        assert finish_reason(chunks) in ("stop", "length")


async def test_tool_results_in_the_history_are_accepted(backend: LlamaCppBackend) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
               {"role": "developer", "content": "Be brief."}]
    chunks = await collect(backend, {"messages": history, "tools": [WEATHER], "tool_choice": "none",
                                     "max_tokens": 20})
    assert content(chunks).strip() and chunks[-1]["usage"]["prompt_tokens"] > 40


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": {"get_weather": {}}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"functions": [WEATHER["function"]], "function_call": {"name": "nope"}}, "function_call"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "response_format"),
    ({"parallel_tool_calls": "yes", "tools": [WEATHER]}, "parallel_tool_calls"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"messages": [{"role": "assistant", "tool_calls": "call it"}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "tool", "content": "18 degrees"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"n": 3}, "n"),
    ({"messages": "hi"}, "messages"),
])
async def test_every_400_names_its_param(backend: LlamaCppBackend, body: dict[str, Any], param: str) -> None:
    with pytest.raises(BackendError) as info:
        await collect(backend, {"messages": ASK, **body})
    assert (info.value.status_code, info.value.param) == (400, param)


async def test_logprobs_in_openai_chat_shape(backend: LlamaCppBackend) -> None:
    chunks = await collect(backend, {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6,
                                     "logprobs": True, "top_logprobs": 3})
    entries = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
               for e in c["choices"][0]["logprobs"]["content"]]
    assert len(entries) == chunks[-1]["usage"]["completion_tokens"]  # one per sampled token (EOG aside)
    assert "".join(e["token"] for e in entries) == content(chunks)
    for entry in entries:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] <= 0 and bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        assert len(entry["top_logprobs"]) == 3
        assert [t["logprob"] for t in entry["top_logprobs"]] == sorted((t["logprob"] for t in entry["top_logprobs"]),
                                                                       reverse=True)
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
    # greedy: the sampled token is the most likely one
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in entries)
    plain = await collect(backend, {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6})
    assert all(c["choices"][0]["logprobs"] is None for c in plain if c["choices"])
    assert content(plain) == content(chunks)


async def test_logit_bias_bans_a_token(backend: LlamaCppBackend) -> None:
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "logprobs": True}
    first = [e for c in await collect(backend, body) if c["choices"] and c["choices"][0]["logprobs"]
             for e in c["choices"][0]["logprobs"]["content"]][0]
    engine = backend._residency.engine(MODEL, "chat")
    assert engine is not None
    [token] = engine.model.tokenize(bytes(first["bytes"]), add_bos=False, special=False)
    biased = [e for c in await collect(backend, {**body, "logit_bias": {str(token): -100}})
              if c["choices"] and c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert biased[0]["bytes"] != first["bytes"]
