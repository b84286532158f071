"""Every public inference API becomes one `InferenceCall`: the node body, its capabilities, its bounds."""

from __future__ import annotations

import json
from typing import Any

import pytest

from darkbloom.coordinator.inference.calls import output_token_bound, parse_call, prompt_token_bound
from darkbloom.wire.openai.edges import CHAT, COMPLETIONS, EMBEDDINGS, MESSAGES, RESPONSES, Edge
from darkbloom.wire.catalog import CatalogModel
from darkbloom.wire.openai.errors import ApiError
from darkbloom.wire.openai.legacy import LEGACY_DEFAULT_MAX_TOKENS
from darkbloom.wire.token_bounds import TEMPLATE_ALLOWANCE

MODEL = CatalogModel(id="smollm2-135m", input_price=1, output_price=1, max_output_tokens=512)
HELLO = [{"role": "user", "content": "hi"}]


def _call(edge: Edge, **body: Any):  # type: ignore[no-untyped-def]
    return parse_call(json.dumps({"model": "smollm2-135m", **body}).encode(), edge)


def test_legacy_completions_go_to_the_node_as_completions_with_openais_default_bound() -> None:
    call = _call(COMPLETIONS, prompt="Once upon a time")
    assert call.api == "completions" and call.needs == {"completions"}
    assert call.max_tokens == LEGACY_DEFAULT_MAX_TOKENS and output_token_bound(call, MODEL) == 16
    forwarded = call.node_body(16)
    assert forwarded["prompt"] == "Once upon a time" and forwarded["stream"] is True
    assert prompt_token_bound(call) >= len("Once upon a time")
    assert _call(COMPLETIONS, prompt="x", logprobs=2).needs == {"completions", "logprobs"}
    assert _call(COMPLETIONS, prompt="x", logprobs=0).needs == {"completions"}


def test_embeddings_reserve_no_output_and_bound_every_input() -> None:
    call = _call(EMBEDDINGS, input=["a", "bb"], encoding_format="base64")
    assert call.api == "embeddings" and call.needs == {"embeddings"} and call.stream is False
    assert output_token_bound(call, MODEL) == 0
    # no max_tokens, floats from the node (the node's own model id replaces the caller's at dispatch)
    assert call.node_body(0) == {"model": "smollm2-135m", "input": ["a", "bb"]}
    assert prompt_token_bound(call) == (1 + 4) + (2 + 4) + TEMPLATE_ALLOWANCE
    tokens = _call(EMBEDDINGS, input=[1, 2, 3])
    assert prompt_token_bound(tokens) == 3 + 4 + TEMPLATE_ALLOWANCE
    assert prompt_token_bound(_call(EMBEDDINGS, input=[[1, 2], [3]])) == (2 + 4) + (1 + 4) + TEMPLATE_ALLOWANCE


def test_embeddings_are_never_streamed() -> None:
    with pytest.raises(ApiError) as caught:
        _call(EMBEDDINGS, input="x", stream=True)
    assert caught.value.param == "stream"


def test_the_responses_api_and_anthropic_messages_become_chat() -> None:
    responses = _call(RESPONSES, input="hi", instructions="Be brief.", max_output_tokens=8, stream=True)
    assert responses.api == "chat" and responses.stream and responses.max_tokens == 8
    assert [m["role"] for m in responses.body["messages"]] == ["system", "user"]
    messages = _call(MESSAGES, max_tokens=8, messages=HELLO, system="Be brief.")
    assert messages.api == "chat" and messages.max_tokens == 8 and messages.stream is False
    assert messages.body["messages"][0]["role"] == "system"


def test_a_translated_body_needs_what_the_chat_body_needs() -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    assert "tools" in _call(RESPONSES, input="hi", tools=[tool]).needs
    schema = {"type": "json_schema", "name": "x", "schema": {"type": "object"}}
    assert "structured_output" in _call(RESPONSES, input="hi", text={"format": schema}).needs
    anthropic_tool = {"name": "get_weather", "input_schema": {"type": "object"}}
    assert "tools" in _call(MESSAGES, max_tokens=8, messages=HELLO, tools=[anthropic_tool]).needs


@pytest.mark.parametrize("edge, body, param", [
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "temperature": 3}, "temperature"),
    (RESPONSES, {"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    (RESPONSES, {"input": "x", "store": True}, "store"),
    (RESPONSES, {"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    (MESSAGES, {"messages": HELLO}, "max_tokens"),
    (EMBEDDINGS, {"input": []}, "input"),
    (CHAT, {"messages": HELLO, "stream": "yes"}, "stream"),
    (EMBEDDINGS, {"input": "x", "model": ""}, "model"),
])
def test_bad_bodies_are_refused_naming_the_parameter(edge: Edge, body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        _call(edge, **body)
    assert caught.value.status == 400
    assert caught.value.param is not None and caught.value.param.startswith(param), caught.value.param


def test_every_edge_has_its_own_id_prefix_and_path() -> None:
    from darkbloom.wire.openai.edges import EDGES

    assert len({edge.path for edge in EDGES}) == len({edge.id_prefix for edge in EDGES}) == len(EDGES)


@pytest.mark.parametrize("edge, body, param", [
    (COMPLETIONS, {"prompt": "hi", "max_completion_tokens": -1}, "max_completion_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_completion_tokens": 0}, "max_completion_tokens"),
    (RESPONSES, {"input": [{"type": "message", "role": ["user"], "content": "hi"}]}, "input[0].role"),
    (RESPONSES, {"input": [{"type": "message", "role": {"a": 1}, "content": "hi"}]}, "input[0].role"),
])
def test_review_findings_are_named_400s(edge: Edge, body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        _call(edge, **body)
    assert caught.value.status == 400 and caught.value.param == param
