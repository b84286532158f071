"""Parsing chat-completions bodies: validation and pass-through of unknown fields."""

from __future__ import annotations

import json

import pytest

from darkbloom.coordinator.inference.calls import InferenceCall, parse_call
from darkbloom.wire.openai.edges import CHAT
from darkbloom.wire.openai.errors import ApiError

HELLO = [{"role": "user", "content": "hi"}]


def _raw(**body: object) -> bytes:
    return json.dumps(body).encode()


def parse_chat_request(raw: bytes) -> InferenceCall:
    return parse_call(raw, CHAT)


def test_minimal_request() -> None:
    chat = parse_chat_request(_raw(model=" smollm2-135m ", messages=HELLO))
    assert chat.model == "smollm2-135m"
    assert chat.stream is False and chat.needs == frozenset() and chat.api == "chat"


def test_unknown_fields_pass_through_to_the_provider() -> None:
    chat = parse_chat_request(_raw(model="alias", messages=HELLO, stream=False, top_k=40,
                                   stream_options={"include_usage": True}, vendor={"x": [1, 2]}))
    forwarded = chat.node_body(max_tokens=64)  # its "model" is the provider's own at dispatch
    assert forwarded["max_tokens"] == 64
    assert forwarded["stream"] is True
    assert "stream_options" not in forwarded
    assert forwarded["top_k"] == 40 and forwarded["vendor"] == {"x": [1, 2]}
    assert forwarded["messages"] == HELLO
    assert chat.body["model"] == "alias"  # the caller's body is not modified


def test_the_capabilities_a_request_needs_are_named() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert parse_chat_request(_raw(model="m", messages=HELLO, tools=tools)).needs == {"tools"}
    assert parse_chat_request(_raw(model="m", messages=HELLO, tools=tools, tool_choice="none")).needs == set()
    assert parse_chat_request(_raw(model="m", messages=HELLO, functions=[{"name": "f"}])).needs == {"tools"}
    image = [{"role": "user", "content": [{"type": "text", "text": "what"},
                                          {"type": "image_url", "image_url": {"url": "data:"}}]}]
    assert parse_chat_request(_raw(model="m", messages=image)).needs == {"images"}
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert parse_chat_request(_raw(model="m", messages=HELLO, response_format=schema)).needs == {"structured_output"}
    assert parse_chat_request(_raw(model="m", messages=HELLO, response_format={"type": "text"})).needs == set()
    assert parse_chat_request(_raw(model="m", messages=HELLO, logprobs=True)).needs == {"logprobs"}
    assert parse_chat_request(_raw(model="m", messages=HELLO, logprobs=False)).needs == set()


@pytest.mark.parametrize("raw, param", [
    (b"{", None),
    (b"[1]", None),
    (_raw(messages=HELLO), "model"),
    (_raw(model="m", messages=[]), "messages"),
    (_raw(model="m", messages=HELLO, n=2), "n"),
    (_raw(model="m", messages=HELLO, stream="true"), "stream"),
    (_raw(model="m", messages=HELLO, tools={"type": "function"}), "tools"),
    (_raw(model="m", messages=HELLO, response_format={"type": "xml"}), "response_format"),
    (_raw(model="m", messages=HELLO, response_format="json"), "response_format"),
])
def test_invalid_requests(raw: bytes, param: str | None) -> None:
    with pytest.raises(ApiError) as caught:
        parse_chat_request(raw)
    assert caught.value.status == 400 and caught.value.type == "invalid_request_error"
    assert caught.value.param == param


@pytest.mark.parametrize("n", [1, None])
def test_n_of_one_or_null_is_fine(n: object) -> None:
    assert parse_chat_request(_raw(model="m", messages=HELLO, n=n)).model == "m"
