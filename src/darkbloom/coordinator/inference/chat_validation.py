"""Validate an OpenAI chat-completions body (also what the Responses and Messages edges translate to)
and name the capabilities it needs; unknown fields pass through untouched."""

from __future__ import annotations

from typing import Any

from darkbloom.wire.openai.errors import invalid_request
from darkbloom.wire.openai.parameters import SAMPLING_RANGES


def validate_chat_body(body: dict[str, Any]) -> None:
    """400 naming the parameter for what no provider could serve; the rest is the provider's to judge."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty array of messages.", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid_request(f"messages[{index}] must be an object with a string 'role'.",
                                  param=f"messages[{index}]")
        _check_content(message.get("content"), f"messages[{index}].content")
    n = body.get("n", 1)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise invalid_request("'n' must be a positive integer.", param="n")
    if n is not None and n > 1:
        raise invalid_request("Only n=1 is supported: ask for one choice per request.", param="n")
    _validate_sampling(body)
    for field in ("tools", "functions"):
        if body.get(field) is not None and not isinstance(body[field], list):
            raise invalid_request(f"'{field}' must be an array.", param=field)
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict)
                                        or response_format.get("type") not in _RESPONSE_FORMATS):
        raise invalid_request("'response_format.type' must be 'text', 'json_object' or 'json_schema'.",
                              param="response_format")


def _validate_sampling(body: dict[str, Any]) -> None:
    """The output bound and the sampling numbers every generating API shares."""
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise invalid_request(f"'{field}' must be a positive integer.", param=field)
    for field, (low, high) in SAMPLING_RANGES.items():
        value = body.get(field)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not low <= value <= high):
            raise invalid_request(f"'{field}' must be a number from {low:g} to {high:g}.", param=field)


def chat_needs(body: dict[str, Any]) -> frozenset[str]:
    """The capabilities a chat request needs beyond plain text (routing sends it only where they are)."""
    needs = set()
    if (body.get("tools") and body.get("tool_choice") != "none") or \
            (body.get("functions") and body.get("function_call") != "none"):
        needs.add("tools")
    if isinstance(body.get("response_format"), dict) and body["response_format"].get("type") != "text":
        needs.add("structured_output")
    if body.get("logprobs") is True or body.get("top_logprobs"):
        needs.add("logprobs")
    if _has_images(body["messages"]):
        needs.add("images")
    return frozenset(needs)


_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


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
