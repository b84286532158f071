"""Parse and validate an OpenAI chat-completions body; unknown fields pass through untouched."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from darkbloom.wire.openai.body import parse_json_object
from darkbloom.wire.openai.errors import invalid_request


@dataclass(frozen=True)
class ChatRequest:
    body: dict[str, Any]
    model: str
    stream: bool
    uses_tools: bool
    uses_images: bool

    def for_provider(self, provider_model_id: str, max_tokens: int) -> bytes:
        """The body the provider receives: its own model id, always streamed, output bounded by
        what admission reserved for."""
        forwarded = dict(self.body, model=provider_model_id, stream=True, max_tokens=max_tokens)
        forwarded.pop("stream_options", None)
        forwarded.pop("max_completion_tokens", None)
        return json.dumps(forwarded, separators=(",", ":")).encode()


def parse_chat_request(raw: bytes) -> ChatRequest:
    body = parse_json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise invalid_request("you must provide a model parameter", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty array of messages.", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid_request(f"messages[{index}] must be an object with a string 'role'.",
                                  param=f"messages[{index}]")
        _check_content(message.get("content"), f"messages[{index}].content")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid_request("'stream' must be a boolean.", param="stream")
    n = body.get("n", 1)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise invalid_request("'n' must be a positive integer.", param="n")
    if n is not None and n > 1:
        raise invalid_request("Only n=1 is supported: ask for one choice per request.", param="n")
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise invalid_request(f"'{field}' must be a positive integer.", param=field)
    for field, (low, high) in _NUMBER_RANGES.items():
        value = body.get(field)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not low <= value <= high):
            raise invalid_request(f"'{field}' must be a number from {low:g} to {high:g}.", param=field)
    return ChatRequest(body=body, model=model.strip(), stream=stream,
                       uses_tools=bool(body.get("tools") or body.get("functions")),
                       uses_images=_has_images(messages))


_NUMBER_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
                  "frequency_penalty": (-2.0, 2.0)}


def _check_content(content: Any, param: str) -> None:
    """A message's content: text, null, or a list of typed parts whose text parts hold text."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise invalid_request(f"'{param}' must be a string or an array of content parts.", param=param)
    for index, part in enumerate(content):
        where = f"{param}[{index}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid_request(f"'{where}' must be an object with a string 'type'.", param=where)
        if part["type"] in ("text", "input_text") and not isinstance(part.get("text"), str):
            raise invalid_request(f"'{where}.text' must be a string.", param=f"{where}.text")


def _has_images(messages: list[Any]) -> bool:
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
                isinstance(part, dict) and part.get("type") in ("image_url", "input_image") for part in content):
            return True
    return False
