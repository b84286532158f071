"""Parsing chat-completions bodies: validation and pass-through of unknown fields."""

from __future__ import annotations

import json

import pytest

from darkbloom.coordinator.inference.chat_request import parse_chat_request
from darkbloom.wire.openai.errors import ApiError

HELLO = [{"role": "user", "content": "hi"}]


def _raw(**body: object) -> bytes:
    return json.dumps(body).encode()


def test_minimal_request() -> None:
    chat = parse_chat_request(_raw(model=" smollm2-135m ", messages=HELLO))
    assert chat.model == "smollm2-135m"
    assert chat.stream is False and chat.uses_tools is False and chat.uses_images is False


def test_unknown_fields_pass_through_to_the_provider() -> None:
    chat = parse_chat_request(_raw(model="alias", messages=HELLO, stream=False, top_k=40,
                                   stream_options={"include_usage": True}, vendor={"x": [1, 2]}))
    forwarded = json.loads(chat.for_provider("provider-model", max_tokens=64))
    assert forwarded["model"] == "provider-model"
    assert forwarded["max_tokens"] == 64
    assert forwarded["stream"] is True
    assert "stream_options" not in forwarded
    assert forwarded["top_k"] == 40 and forwarded["vendor"] == {"x": [1, 2]}
    assert forwarded["messages"] == HELLO
    assert chat.body["model"] == "alias"  # the caller's body is not modified


def test_tools_and_images_are_detected() -> None:
    assert parse_chat_request(_raw(model="m", messages=HELLO, tools=[{"type": "function"}])).uses_tools
    image = [{"role": "user", "content": [{"type": "text", "text": "what"},
                                          {"type": "image_url", "image_url": {"url": "data:"}}]}]
    assert parse_chat_request(_raw(model="m", messages=image)).uses_images


@pytest.mark.parametrize("raw, param", [
    (b"{", None),
    (b"[1]", None),
    (_raw(messages=HELLO), "model"),
    (_raw(model="m", messages=[]), "messages"),
    (_raw(model="m", messages=HELLO, n=2), "n"),
    (_raw(model="m", messages=HELLO, stream="true"), "stream"),
])
def test_invalid_requests(raw: bytes, param: str | None) -> None:
    with pytest.raises(ApiError) as caught:
        parse_chat_request(raw)
    assert caught.value.status == 400 and caught.value.type == "invalid_request_error"
    assert caught.value.param == param


@pytest.mark.parametrize("n", [1, None])
def test_n_of_one_or_null_is_fine(n: object) -> None:
    assert parse_chat_request(_raw(model="m", messages=HELLO, n=n)).model == "m"
