"""The request parameters several APIs check alike: the `model` every one names, `stream`, the
ranges of the sampling numbers (chat, which Responses and Messages become, and legacy completions),
and the numbers a node samples with when a request leaves them out."""

from __future__ import annotations

from typing import Any

from darkbloom.wire.openai.errors import invalid_request

SAMPLING_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
                   "frequency_penalty": (-2.0, 2.0)}
# llama-cpp-python's own defaults for a chat completion and for a prompt completion: the llama.cpp
# backend samples with them, and the Responses API reports them as the numbers used
CHAT_SAMPLING_DEFAULTS = {"temperature": 0.2, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "typical_p": 1.0,
                          "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
COMPLETION_SAMPLING_DEFAULTS = {**CHAT_SAMPLING_DEFAULTS, "temperature": 0.8}


def check_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise invalid_request("you must provide a model parameter", param="model")
    return model.strip()


def check_stream(body: dict[str, Any]) -> bool:
    stream = body.get("stream")
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise invalid_request("'stream' must be a boolean.", param="stream")
    return stream


def check_sampling(body: dict[str, Any]) -> None:
    """Each sampling number of SAMPLING_RANGES, when given, a number in its range (400 naming it)."""
    for field, (low, high) in SAMPLING_RANGES.items():
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not low <= value <= high):
            raise invalid_request(f"'{field}' must be a number from {low:g} to {high:g}.", param=field)


def chat_sampling(body: dict[str, Any]) -> dict[str, float]:
    """The OpenAI sampling numbers (SAMPLING_RANGES) a chat request samples with: each as the request
    gives it, else CHAT_SAMPLING_DEFAULTS'."""
    return {field: float(body[field]) if body.get(field) is not None else CHAT_SAMPLING_DEFAULTS[field]
            for field in SAMPLING_RANGES}
