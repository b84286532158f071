"""What a `response` object repeats of its request: `check` refuses a bad value at the door (400
naming the field), `echo` renders every field with the value the answer was made with.

The sampling numbers are the ones the node was asked to sample with (`chat_sampling`: the request's,
else the node's defaults), not the OpenAI defaults (1.0) a caller did not get. Fields for features a
stateless edge does not have report what happened instead: `store` and `background` false, one
`service_tier` ("default"), `truncation` "disabled" (an input over the context is a 400).
"""

from __future__ import annotations

from typing import Any

from darkbloom.wire.openai.errors import invalid_request
from darkbloom.wire.openai.parameters import chat_sampling, check_sampling

SERVICE_TIERS = ("auto", "default", "flex", "priority")
TRUNCATIONS = ("auto", "disabled")
_MAX_IDENTIFIER = 64  # safety_identifier, prompt_cache_key, and a metadata key
_MAX_METADATA_PAIRS = 16
_MAX_METADATA_VALUE = 512


def check(body: dict[str, Any]) -> None:
    """400 naming the field for an echoed value out of its documented type or range."""
    check_sampling(body)
    for field in ("store", "background"):
        if body.get(field) is not None and not isinstance(body[field], bool):
            raise invalid_request(f"'{field}' must be a boolean.", param=field)
    _check_choice(body, "service_tier", SERVICE_TIERS)
    _check_choice(body, "truncation", TRUNCATIONS)
    for field in ("safety_identifier", "prompt_cache_key"):
        value = body.get(field)
        if value is not None and (not isinstance(value, str) or len(value) > _MAX_IDENTIFIER):
            raise invalid_request(f"'{field}' must be a string of at most {_MAX_IDENTIFIER} characters.",
                                  param=field)
    _check_int(body, "max_tool_calls", 1, None)
    _check_int(body, "top_logprobs", 0, 20)
    _check_metadata(body.get("metadata"))


def echo(request: dict[str, Any]) -> dict[str, Any]:
    """The request's part of a `response` object (the caller's body as sent, already `check`ed)."""
    return {
        "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": request.get("max_tool_calls"), "metadata": request.get("metadata") or {},
        "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
        **chat_sampling(request),
        "top_logprobs": request.get("top_logprobs") or 0,
        "tool_choice": request.get("tool_choice") or "auto", "tools": _tools(request.get("tools")),
        "text": _text(request.get("text")),
        "truncation": "disabled", "store": False, "background": False, "service_tier": "default",
        "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
        "safety_identifier": request.get("safety_identifier"), "prompt_cache_key": request.get("prompt_cache_key"),
        "user": request.get("user"),
    }


def _tools(tools: Any) -> list[dict[str, Any]]:
    """The request's function tools in the Responses shape (flat)."""
    out = []
    for tool in tools if isinstance(tools, list) else ():
        if not isinstance(tool, dict):
            continue
        spec = tool["function"] if isinstance(tool.get("function"), dict) else tool
        out.append({"type": "function", "name": spec.get("name"), "description": spec.get("description"),
                    "parameters": spec.get("parameters"), "strict": spec.get("strict")})
    return out


def _text(text: Any) -> dict[str, Any]:
    """`text` with its `format` always there (`text` when not asked for), a json_schema format whole."""
    given = text if isinstance(text, dict) else {}
    fmt = given.get("format") if isinstance(given.get("format"), dict) else {"type": "text"}
    if fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "name": fmt.get("name"), "description": fmt.get("description"),
               "schema": fmt.get("schema"), "strict": bool(fmt.get("strict"))}
    out = {"format": fmt}
    if given.get("verbosity") is not None:
        out["verbosity"] = given["verbosity"]
    return out


def _check_choice(body: dict[str, Any], field: str, allowed: tuple[str, ...]) -> None:
    if body.get(field) is not None and body[field] not in allowed:
        raise invalid_request(f"'{field}' must be one of {', '.join(allowed)}.", param=field)


def _check_int(body: dict[str, Any], field: str, low: int, high: int | None) -> None:
    value = body.get(field)
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise invalid_request(f"'{field}' must be an integer {bound}.", param=field)


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > _MAX_METADATA_PAIRS or not all(
            isinstance(key, str) and len(key) <= _MAX_IDENTIFIER and isinstance(value, str)
            and len(value) <= _MAX_METADATA_VALUE for key, value in metadata.items()):
        raise invalid_request(f"'metadata' must be an object of at most {_MAX_METADATA_PAIRS} string values "
                              f"(keys of at most {_MAX_IDENTIFIER} characters, values of at most "
                              f"{_MAX_METADATA_VALUE}).", param="metadata")
