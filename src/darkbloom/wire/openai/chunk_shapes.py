"""What a node's chunk must look like before anything reads it: the fields the relay and every
presenter read, of the types they read them as. A chunk of any other shape is one that does not open
(the coordinator distrusts its provider), so no presenter ever meets a value it cannot handle.

Only the fields read are checked; anything else in a chunk passes through as it always did.
"""

from __future__ import annotations

import math
from typing import Any

from darkbloom.wire.protocol import Api

_TEXT_FIELDS = ("content", "refusal", "role")
_CALL_TEXT_FIELDS = ("id", "type")
_FUNCTION_FIELDS = ("name", "arguments")
_COMPLETION_LOGPROB_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def chunk_problem(chunk: dict[str, Any], api: Api) -> str | None:
    """What is wrong with this chunk for a request of ``api``, or None when every field a reader
    uses has the type it expects."""
    choices = chunk.get("choices")
    if choices is not None:
        if not isinstance(choices, list):
            return "'choices' is not an array"
        for choice in choices:
            problem = _choice_problem(choice)
            if problem is not None:
                return problem
    if api == "embeddings":
        return _embeddings_problem(chunk.get("data"))
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text_or_none(holder: dict[str, Any], fields: tuple[str, ...]) -> str | None:
    for field in fields:
        value = holder.get(field)
        if value is not None and not isinstance(value, str):
            return field
    return None


def _choice_problem(choice: Any) -> str | None:
    if not isinstance(choice, dict):
        return "a choice is not an object"
    wrong = _text_or_none(choice, ("text", "finish_reason"))
    if wrong is not None:
        return f"a choice's '{wrong}' is not a string"
    delta = choice.get("delta")
    if delta is not None:
        problem = _delta_problem(delta)
        if problem is not None:
            return problem
    logprobs = choice.get("logprobs")
    if logprobs is not None:
        if not isinstance(logprobs, dict):
            return "a choice's 'logprobs' is not an object"
        for field in ("content", *_COMPLETION_LOGPROB_LISTS):
            if logprobs.get(field) is not None and not isinstance(logprobs[field], list):
                return f"'logprobs.{field}' is not an array"
    return None


def _delta_problem(delta: Any) -> str | None:
    if not isinstance(delta, dict):
        return "a choice's 'delta' is not an object"
    wrong = _text_or_none(delta, _TEXT_FIELDS)
    if wrong is not None:
        return f"'delta.{wrong}' is not a string"
    calls = delta.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            return "'delta.tool_calls' is not an array"
        for call in calls:
            if not isinstance(call, dict):
                return "a tool call is not an object"
            if "index" in call and not _is_int(call["index"]):
                return "a tool call's 'index' is not an integer"
            wrong = _text_or_none(call, _CALL_TEXT_FIELDS)
            if wrong is not None:
                return f"a tool call's '{wrong}' is not a string"
            problem = _function_problem(call.get("function"), "a tool call's 'function'")
            if problem is not None:
                return problem
    return _function_problem(delta.get("function_call"), "'delta.function_call'")


def _function_problem(function: Any, where: str) -> str | None:
    if function is None:
        return None
    if not isinstance(function, dict):
        return f"{where} is not an object"
    wrong = _text_or_none(function, _FUNCTION_FIELDS)
    return None if wrong is None else f"{where}.{wrong} is not a string"


def _embeddings_problem(data: Any) -> str | None:
    if data is None:
        return None
    if not isinstance(data, list):
        return "'data' is not an array"
    for item in data:
        if not isinstance(item, dict):
            return "an embedding is not an object"
        if "index" in item and not (_is_int(item["index"]) and item["index"] >= 0):
            return "an embedding's 'index' is not a non-negative integer"
        vector = item.get("embedding")
        if vector is None:
            continue
        if not isinstance(vector, list):
            return "an embedding's 'embedding' is not an array"
        try:
            total = sum(vector, 0.0)  # refuses anything but numbers; NaN or an infinity makes it non-finite
        except TypeError:
            return "an embedding holds something other than numbers"
        if not math.isfinite(total):
            return "an embedding holds a number that is not finite"
    return None
