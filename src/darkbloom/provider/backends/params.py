"""OpenAI chat-completion request body → keyword arguments for llama-cpp-python.

Known parameters are type-checked (a bad value is a 400 naming the parameter); parameters
llama.cpp has no use for (user, metadata, store, stream_options, …) are ignored.
"""

from __future__ import annotations

from typing import Any

from darkbloom.provider.backends.base import BackendError

_FLOATS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "typical_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0), "repeat_penalty": (0.0, 10.0),
}
_INTS: dict[str, tuple[int, int]] = {"top_k": (0, 1_000_000), "seed": (-(2**63), 2**64 - 1),
                                     "top_logprobs": (0, 20)}


def chat_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BackendError(400, "the request body must be a JSON object")
    kwargs: dict[str, Any] = {"messages": _messages(body.get("messages"))}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if not _is_int(max_tokens) or max_tokens < 1:
            raise BackendError(400, "max_tokens must be a positive integer")
        kwargs["max_tokens"] = max_tokens
    n = body.get("n")
    if n is not None and n != 1:
        raise BackendError(400, "n must be 1: this backend returns one choice per request")
    for name, (low, high) in _FLOATS.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise BackendError(400, f"{name} must be a number between {low:g} and {high:g}")
        kwargs[name] = float(value)
    for name, (low, high) in _INTS.items():
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or not low <= value <= high:
            raise BackendError(400, f"{name} must be an integer between {low} and {high}")
        kwargs[name] = value
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BackendError(400, "stop must be a string or a list of strings")
        kwargs["stop"] = [s for s in stop if s]
    if body.get("logprobs") is not None:
        if not isinstance(body["logprobs"], bool):
            raise BackendError(400, "logprobs must be true or false")
        kwargs["logprobs"] = body["logprobs"]
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in ("text", "json_object"):
            raise BackendError(400, "response_format must be {\"type\": \"text\"} or {\"type\": \"json_object\"}")
        if response_format["type"] == "json_object":
            kwargs["response_format"] = {"type": "json_object"}
    return kwargs


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BackendError(400, "messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BackendError(400, f"messages[{index}] must be an object with a string role")
        out.append({**message, "content": _text_content(message.get("content"), index)})
    return out


def _text_content(content: Any, index: int) -> str:
    """Plain text; OpenAI content-part lists are joined when every part is text."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BackendError(400, f"messages[{index}].content: only text parts are supported by this model")
            texts.append(part["text"])
        return "".join(texts)
    raise BackendError(400, f"messages[{index}].content must be a string or a list of text parts")
