"""What a `response` object repeats of its request (checked at the door by the request's schema,
`request.ResponseRequest`): `echo` renders every field with the value the answer was made with.

The sampling numbers are the ones the node was asked to sample with (`chat_sampling`: the request's,
else the node's defaults), not the OpenAI defaults (1.0) a caller did not get. Fields for features a
stateless edge does not have report what happened instead: `store` and `background` false, one
`service_tier` ("default"), `truncation` "disabled" (an input over the context is a 400).
"""

from __future__ import annotations

from typing import Any

from darkbloom.wire.openai.parameters import chat_sampling


def echo(request: dict[str, Any]) -> dict[str, Any]:
    """The request's part of a `response` object (the caller's body as sent, already checked)."""
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
    given: dict[str, Any] = text if isinstance(text, dict) else {}
    fmt: dict[str, Any] = given["format"] if isinstance(given.get("format"), dict) else {"type": "text"}
    if fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "name": fmt.get("name"), "description": fmt.get("description"),
               "schema": fmt.get("schema"), "strict": bool(fmt.get("strict"))}
    out = {"format": fmt}
    if given.get("verbosity") is not None:
        out["verbosity"] = given["verbosity"]
    return out
